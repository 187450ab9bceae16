"""The ops under a device mesh (4 host CPU devices): data and tensor parallel results,
statistics and gradients equal the single-device ones; no weight is all-gathered."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_twell as jt
from jax_twell.ops.ffn.api import sparse_ffn_for_layer
from jax_twell.ops.ffn_train.api import sparse_ffn_train_for_layer
from jax_twell.ops.plan import FFNOptions, TrainOptions
from jax_twell.testing import synthetic_ffn_inputs
from specs import assert_close, tolerance

pytestmark = pytest.mark.skipif(len(jax.devices("cpu")) < 4, reason="needs 4 host devices")

LAYOUTS = {
    "data": jt.FFNSharding(token_axes=("data", "tensor")),
    "tensor": jt.FFNSharding(tensor_axis="tensor", token_axes=()),
    "data+tensor": jt.FFNSharding(token_axes=("data",), tensor_axis="tensor"),
}


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 2), ("data", "tensor"), devices=jax.devices("cpu")[:4])


def place(mesh, sharding, x, w_gate, w_up, w_down):
    tok = NamedSharding(mesh, P(sharding.token_axes or None, None))
    col = NamedSharding(mesh, P(None, sharding.tensor_axis))
    row = NamedSharding(mesh, P(sharding.tensor_axis, None))
    return (jax.device_put(x, tok), None if w_gate is None else jax.device_put(w_gate, col), jax.device_put(w_up, col), jax.device_put(w_down, row))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("gated", [True, False])
def test_sharded_training_equals_unsharded(mesh, layout, gated):
    inp = synthetic_ffn_inputs(jax.random.key(0), 64, 32, 256, density=0.05, pattern="heavy", dtype=jnp.float32)
    args = (inp.x, inp.w_gate if gated else None, inp.w_up, inp.w_down)
    sharding = jt.FFNSharding(token_axes=LAYOUTS[layout].token_axes, tensor_axis=LAYOUTS[layout].tensor_axis, mesh=mesh)
    cot = jax.random.normal(jax.random.key(1), inp.x.shape)
    argnums = (0, 1, 2, 3) if gated else (0, 2, 3)
    for impl in ("reference", "xla"):
        def loss(sh, *a):
            y, aux = sparse_ffn_train_for_layer(*a, implementation=impl, sharding=sh, options=TrainOptions(width=8))
            return (y * cot).sum() + 0.3 * aux.l1, (y, aux)

        (_, (y0, aux0)), g0 = jax.value_and_grad(lambda *a: loss(None, *a), argnums, has_aux=True)(*args)
        step = jax.jit(jax.value_and_grad(lambda *a: loss(sharding, *a), argnums, has_aux=True))
        (_, (y1, aux1)), g1 = step(*place(mesh, sharding, *args))
        tol = tolerance(jnp.float32, 300, grad=True)
        assert_close(y1, y0, tol, f"{impl} y")
        for a, b, name in zip(g1, g0, ["dx", "dw_gate", "dw_up", "dw_down"][-len(argnums):] if gated else ["dx", "dw_up", "dw_down"]):
            assert_close(a, b, tol, f"{impl} {layout} {name}")
        assert_close(aux1.l1, aux0.l1, tol, "l1")
        np.testing.assert_allclose(aux1.nnz_mean, aux0.nnz_mean, rtol=1e-6)
        assert int(aux1.nnz_max) == int(aux0.nnz_max)
        assert int(aux1.rows_over_capacity) == int(aux0.rows_over_capacity)
        np.testing.assert_array_equal(aux1.neuron_fired, aux0.neuron_fired)


IMPLEMENTATIONS = ("reference", "xla", None) + (("cpu",) if jt.cpu_kernels_available() else ())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tokens", [24, 128])  # per call: below and above the CPU path's unchecked-dense bound
def test_sharded_inference_equals_unsharded(mesh, layout, tokens):
    inp = synthetic_ffn_inputs(jax.random.key(2), 2 * tokens, 32, 512, density=0.01)
    sharding = jt.FFNSharding(token_axes=LAYOUTS[layout].token_axes, tensor_axis=LAYOUTS[layout].tensor_axis, mesh=mesh)
    want = jt.sparse_ffn(*inp, implementation="xla")
    x = inp.x.reshape(2, tokens, 32)  # leading batch dimensions are kept
    for impl in IMPLEMENTATIONS:
        placed = place(mesh, sharding, inp.x, *inp[1:])
        fn = jax.jit(lambda x, *w: sparse_ffn_for_layer(x, *w, implementation=impl, sharding=sharding, options=FFNOptions(tile=64, capacity=4)))
        y = fn(placed[0].reshape(x.shape), *placed[1:])
        assert y.shape == x.shape
        assert_close(y.reshape(want.shape), want, tolerance(jnp.bfloat16, 600), impl)


@pytest.mark.skipif(not jt.cpu_kernels_available(), reason="the CPU kernels are not built here")
@pytest.mark.parametrize("bad", [None, "inf", "nan"])
def test_kept_finite_check_is_used_per_shard_where_f_is_not_split(bad):
    """A serving layer's kept finite check (weights_finite) reaches the kernel under a
    sharding whose tensor axis has one device (as a model bound for one device has): the
    decode-sized call runs the CPU kernel instead of the dense FFN, and equals the dense
    formula, non-finite weights included. Where f is split, each shard checks its own."""
    one = jax.make_mesh((4, 1), ("data", "tensor"), devices=jax.devices("cpu")[:4])
    inp = synthetic_ffn_inputs(jax.random.key(4), 4, 64, 512, density=0.01, dtype=jnp.float32)
    w_down = inp.w_down
    if bad is not None:
        w_down = w_down.at[3, 5].set(jnp.inf if bad == "inf" else jnp.nan)
    weights = (inp.w_gate, inp.w_up, w_down)
    ok = jt.ops.common.finite_columns(inp.w_up, w_down)
    want = jt.sparse_ffn(inp.x, *weights, implementation="xla")
    sharding = jt.FFNSharding(token_axes=("data",), tensor_axis="tensor", mesh=one)
    fn = jax.jit(lambda x, wg, wu, wd, ok: sparse_ffn_for_layer(x, wg, wu, wd, weights_finite=ok, sharding=sharding))
    lowered = fn.lower(*place(one, sharding, inp.x, *weights), ok)
    assert "jax_twell_cpu_up_down" in lowered.as_text(), "the kept check should let one token per shard run the kernel"
    y = fn(*place(one, sharding, inp.x, *weights), ok)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(y), np.isinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(np.asarray(y)[finite], np.asarray(want)[finite], rtol=1e-5, atol=1e-5)


def test_tensor_parallel_never_gathers_weights(mesh):
    inp = synthetic_ffn_inputs(jax.random.key(3), 64, 32, 256, density=0.05)
    sharding = jt.FFNSharding(token_axes=("data",), tensor_axis="tensor", mesh=mesh)

    def loss(*a):
        y, aux = sparse_ffn_train_for_layer(*a, implementation="reference", sharding=sharding, options=TrainOptions(width=8))
        return (y.astype(jnp.float32) ** 2).sum() + aux.l1

    hlo = jax.jit(jax.grad(loss, (1, 2, 3))).lower(*place(mesh, sharding, *inp)).compile().as_text()
    gathers = [line for line in hlo.splitlines() if "all-gather" in line and "=" in line]
    assert not gathers, "weights all-gathered:\n" + "\n".join(gathers)
    assert "all-reduce" in hlo  # the partial outputs are summed over the tensor axis
