"""The CUDA TwELL pack kernel against the reference: bit-exact on every input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_twell as jt
from jax_twell.formats import relu_matmul
from jax_twell.testing import synthetic_ffn_inputs
from specs import GPU_SPECS
from test_formats import adversarial_activation

pytestmark = pytest.mark.gpu


def assert_same_fields(got, want, names):
    """Bit-equal arrays (NaN payloads included) for each field in ``names``."""
    for name in names:
        g, w = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        assert g.shape == w.shape and g.dtype == w.dtype, name
        if g.dtype.itemsize == 2:
            g, w = g.view(np.uint16), w.view(np.uint16)
        np.testing.assert_array_equal(g, w, err_msg=name)


def assert_same_twell(got: jt.TwELL, want: jt.TwELL):
    assert (got.f, got.tile) == (want.f, want.tile)
    assert_same_fields(got, want, ("values", "cols", "counts"))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("spec", GPU_SPECS, ids=str)
def test_pack_kernel_matches_reference(spec, dtype):
    inp = synthetic_ffn_inputs(jax.random.key(spec.m), spec.m, spec.d, spec.f, density=spec.density, pattern=spec.pattern, dtype=dtype)
    a = relu_matmul(inp.x, inp.w_gate)
    for tile, capacity in [(256, 32), (64, 4), (128, 128)]:
        got = jax.jit(lambda a: jt.pack_twell(a, tile=tile, capacity=capacity, implementation="cuda"))(a)
        assert_same_twell(got, jt.pack_twell(a, tile=tile, capacity=capacity, implementation="reference"))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_pack_kernel_adversarial(dtype):
    for m, f in [(1, 32), (9, 200), (300, 1000), (7, 4097)]:
        a = adversarial_activation(jax.random.key(m), m, f, dtype=dtype, tile=64)
        a = a.at[-1, -1].set(jnp.nan)  # NaN counts as a non-zero and is kept
        for tile, capacity in [(64, 4), (256, 32), (32, 1)]:
            got = jt.pack_twell(a, tile=tile, capacity=capacity, implementation="cuda")
            want = jt.pack_twell(a, tile=tile, capacity=capacity, implementation="reference")
            assert_same_twell(got, want)
            assert bool(got.overflowed.any()) == (m >= 4)  # rows 1 and 3 overflow


def test_pack_kernel_leading_dims_vmap_and_auto():
    a = adversarial_activation(jax.random.key(5), 60, 520, dtype=jnp.bfloat16).reshape(3, 4, 5, 520)
    want = jt.pack_twell(a, implementation="reference")
    assert_same_twell(jt.pack_twell(a, implementation="cuda"), want)
    assert_same_twell(jax.vmap(lambda a: jt.pack_twell(a, implementation="cuda"))(a), want)
    auto = jax.jit(lambda a: jt.pack_twell(a))
    assert "jax_twell_pack" in auto.lower(a).as_text()
    assert_same_twell(auto(a), want)
    empty = jt.pack_twell(jnp.zeros((0, 300), jnp.bfloat16), implementation="cuda")
    assert empty.values.shape == (0, 2, 32)


@pytest.mark.parametrize("width,backup", [(128, None), (8, 3), (4, 0)])
def test_hybrid_pack_kernel_matches_reference(width, backup):
    a = adversarial_activation(jax.random.key(9), 300, 1000, dtype=jnp.bfloat16)
    got = jax.jit(lambda a: jt.pack_hybrid(a, width=width, backup_capacity=backup, implementation="cuda"))(a)
    want = jt.pack_hybrid(a, width=width, backup_capacity=backup, implementation="reference")
    assert_same_fields(got, want, ("values", "cols", "counts", "backup_values", "backup_rows"))
