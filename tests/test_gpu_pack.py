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


def clustered_activation(key, m: int, f: int, tile: int, lane_width: int, dtype) -> jax.Array:
    """[m, f] whose rows put their non-zeros where the pack kernel's two steps part ways:
    in runs of consecutive columns (a few lanes of a warp step hold them all, some of those
    past any capacity: 1 to 5 lanes' worth), spread one per lane (every lane active), mixed
    within one row, with -0.0 (a zero) and NaN (a non-zero) among them; plus an empty row and
    a full one. ``lane_width``: the columns one lane reads per step (16 bytes of elements)."""
    rows = []
    rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**30)))
    for r in range(m):
        row = np.zeros(f, np.float32)
        kind = r % 6
        if kind == 1:  # runs: one to five lanes' worth of consecutive columns per tile
            for t0 in range(0, f, tile):
                end = min(t0 + tile, f)
                run = min(int(rng.integers(1, 5 * lane_width + 1)), end - t0)
                start = t0 + int(rng.integers(0, end - t0 - run + 1))
                row[start:start + run] = rng.uniform(0.5, 2.0, run)
        elif kind == 2:  # one non-zero in every lane's 16 bytes
            cols = np.arange(int(rng.integers(0, lane_width)), f, lane_width)
            row[cols] = rng.uniform(0.5, 2.0, cols.size)
        elif kind == 3:  # mixed: a few scattered, one dense run
            row[rng.choice(f, size=min(f, 6), replace=False)] = -1.5
            row[: min(f, 3 * lane_width)] = 0.75
        elif kind == 4:  # the whole row
            row[:] = rng.uniform(-2.0, 2.0, f)
        elif kind == 5:  # signed zeros (zeros) and a NaN (a non-zero) among few non-zeros
            row[rng.choice(f, size=min(f, 8), replace=False)] = -0.0
            row[int(rng.integers(0, f))] = np.nan
            row[int(rng.integers(0, f))] = 3.0
        rows.append(row)  # kind 0: empty
    return jnp.asarray(np.stack(rows)).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("steps", [1, 2, 4])
def test_pack_kernel_steps_on_clustered_rows(dtype, steps):
    """The layouts the batched kernel takes (tile = 32, 64, 128 lanes' worth of columns),
    the last tile partial, capacities from 1 to past a tile's step: the few-lane step (runs
    held by up to four lanes, some past capacity) and the prefix-sum step give the
    reference's bits."""
    lane_width = 16 // jnp.dtype(dtype).itemsize
    tile = 32 * lane_width * steps
    f = 2 * tile + tile // 2 + lane_width  # a partial last tile, f a multiple of the lane width
    a = clustered_activation(jax.random.key(steps), 61, f, tile, lane_width, dtype)
    for capacity in (1, 4, lane_width + 3, 2 * lane_width, 64):
        pack = jax.jit(lambda a: jt.pack_twell(a, tile=tile, capacity=capacity, implementation="cuda"))
        got = pack(a)
        assert_same_twell(got, jt.pack_twell(a, tile=tile, capacity=capacity, implementation="reference"))
        assert bool(got.overflowed.any())  # the full rows at least


@pytest.mark.parametrize("width,backup", [(128, None), (8, 3), (4, 0)])
def test_hybrid_pack_kernel_matches_reference(width, backup):
    a = adversarial_activation(jax.random.key(9), 300, 1000, dtype=jnp.bfloat16)
    got = jax.jit(lambda a: jt.pack_hybrid(a, width=width, backup_capacity=backup, implementation="cuda"))(a)
    want = jt.pack_hybrid(a, width=width, backup_capacity=backup, implementation="reference")
    assert_same_fields(got, want, ("values", "cols", "counts", "backup_values", "backup_rows"))
