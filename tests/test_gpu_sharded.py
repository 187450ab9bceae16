"""The CUDA kernels per shard of a mesh of GPUs (needs 2 or more): data and tensor
parallel sparse FFN through FFNSharding equals the single-device result."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_twell as jt
from jax_twell.testing import synthetic_ffn_inputs
from specs import assert_close, fused_tolerance
from jax_twell.ops.costs import DenseCrossover
from jax_twell.ops.ffn.api import sparse_ffn_for_layer
from jax_twell.ops.ffn_train.api import sparse_ffn_train_for_layer
from jax_twell.ops.plan import FFNOptions, LayerInfo, Side

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(len(jax.devices()) < 2 or jax.devices()[0].platform != "gpu", reason="needs 2 GPUs"),
]


FORCED = LayerInfo(side=Side.SPARSE)  # small shapes run dense under the default rule: the kernels


@pytest.mark.parametrize("layout", ["data", "tensor"])
@pytest.mark.parametrize("gated", [True, False])
def test_sharded_kernels_equal_single_device(layout, gated):
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Auto,))
    sharding = jt.FFNSharding(token_axes=("x",), mesh=mesh) if layout == "data" else jt.FFNSharding(tensor_axis="x", mesh=mesh)
    inp = synthetic_ffn_inputs(jax.random.key(0), 4096, 1024, 2816, density=0.01, pattern="heavy")
    w_gate = inp.w_gate if gated else None
    want = sparse_ffn_for_layer(inp.x, w_gate, inp.w_up, inp.w_down, implementation="cuda", layer=FORCED)
    tok = NamedSharding(mesh, P(sharding.token_axes or None, None))
    col = NamedSharding(mesh, P(None, sharding.tensor_axis))
    row = NamedSharding(mesh, P(sharding.tensor_axis, None))
    args = (
        jax.device_put(inp.x, tok),
        None if w_gate is None else jax.device_put(w_gate, col),
        jax.device_put(inp.w_up, col),
        jax.device_put(inp.w_down, row),
    )
    fn = jax.jit(lambda x, wg, wu, wd: sparse_ffn_for_layer(x, wg, wu, wd, implementation="cuda", sharding=sharding,
                                                            layer=FORCED))
    hlo = fn.lower(*args).compile().as_text()
    assert "jax_twell_ffn" in hlo and "all-gather" not in hlo.split("ENTRY")[-1]
    assert_close(fn(*args), want, 2 * fused_tolerance(jnp.bfloat16, 2816), f"{layout} gated={gated}")


def _sharded_args(mesh, sharding, inp, gated):
    tok = NamedSharding(mesh, P(sharding.token_axes or None, None))
    col = NamedSharding(mesh, P(None, sharding.tensor_axis))
    row = NamedSharding(mesh, P(sharding.tensor_axis, None))
    return (
        jax.device_put(inp.x, tok),
        jax.device_put(inp.w_gate, col) if gated else None,
        jax.device_put(inp.w_up, col),
        jax.device_put(inp.w_down, row),
    )


@pytest.mark.parametrize("layout", ["data", "tensor"])
@pytest.mark.parametrize("gated", [True, False])
def test_sharded_training_kernels_equal_single_device(layout, gated):
    """The training op's kernels per shard: output, L1 term and every gradient equal the
    single-device kernels' (data parallel: tokens split; tensor parallel: f split, local
    sparse formats, partial outputs summed)."""
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Auto,))
    sharding = jt.FFNSharding(token_axes=("x",), mesh=mesh) if layout == "data" else jt.FFNSharding(tensor_axis="x", mesh=mesh)
    inp = synthetic_ffn_inputs(jax.random.key(1), 4096, 1024, 2816, density=0.01, pattern="heavy")
    # The default rule decides this small shape dense at trace time: the kernels, forced.
    _check_sharded_training(mesh, sharding, inp, layout, gated)


def _check_sharded_training(mesh, sharding, inp, layout, gated):
    def loss(x, wg, wu, wd, shard):
        y, aux = sparse_ffn_train_for_layer(x, wg, wu, wd, implementation="cuda", sharding=shard, layer=FORCED)
        return (y.astype(jnp.float32) ** 2).mean() + 1e-3 * aux.l1, (y, aux.l1)

    grad = jax.grad(loss, argnums=(0, 1, 2, 3) if gated else (0, 2, 3), has_aux=True)
    w_gate = inp.w_gate if gated else None
    want_g, (want_y, want_l1) = jax.jit(lambda *a: grad(*a, None))(inp.x, w_gate, inp.w_up, inp.w_down)
    args = _sharded_args(mesh, sharding, inp, gated)
    fn = jax.jit(lambda *a: grad(*a, sharding))
    hlo = fn.lower(*args).compile().as_text()
    assert "jax_twell_train" in hlo
    got_g, (got_y, got_l1) = fn(*args)
    tol = 2 * fused_tolerance(jnp.bfloat16, 2816)
    assert_close(got_y, want_y, tol, f"{layout} y")
    assert_close(got_l1, want_l1, 1e-4, f"{layout} l1")
    for i, (a, b) in enumerate(zip(got_g, want_g)):
        assert_close(a, b, 4 * tol, f"{layout} gated={gated} grad {i}")


def test_sharded_decode_kernel_equals_single_device():
    """Decode-sized calls per shard (tensor parallel, f split) with the decode kernel."""
    options = FFNOptions(rule=DenseCrossover(decode_kernel_max_tokens=64))
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Auto,))
    sharding = jt.FFNSharding(tensor_axis="x", mesh=mesh)
    inp = synthetic_ffn_inputs(jax.random.key(2), 16, 1024, 2816, density=0.01)
    want = sparse_ffn_for_layer(*inp, implementation="cuda", layer=FORCED, options=options)
    args = _sharded_args(mesh, sharding, inp, True)
    fn = jax.jit(lambda x, wg, wu, wd: sparse_ffn_for_layer(x, wg, wu, wd, implementation="cuda", sharding=sharding,
                                                            layer=FORCED, options=options))
    assert "jax_twell_decode" in fn.lower(*args).compile().as_text()
    assert_close(fn(*args), want, 2 * fused_tolerance(jnp.bfloat16, 2816), "decode tensor parallel")
