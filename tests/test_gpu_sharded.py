"""The CUDA kernels per shard of a mesh of GPUs (needs 2 or more): data and tensor
parallel sparse FFN through FFNSharding equals the single-device result."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_twell as jt
from jax_twell.ops import cuda
from jax_twell.testing import synthetic_ffn_inputs
from specs import assert_close, fused_tolerance

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(len(jax.devices()) < 2 or jax.devices()[0].platform != "gpu", reason="needs 2 GPUs"),
]


@pytest.fixture
def always_sparse():
    previous = cuda.set_dense_crossover(cuda.DenseCrossover(margin=float("inf")))
    yield
    cuda.set_dense_crossover(previous)


@pytest.mark.parametrize("layout", ["data", "tensor"])
@pytest.mark.parametrize("gated", [True, False])
def test_sharded_kernels_equal_single_device(always_sparse, layout, gated):
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Auto,))
    sharding = jt.FFNSharding(token_axes=("x",), mesh=mesh) if layout == "data" else jt.FFNSharding(tensor_axis="x", mesh=mesh)
    inp = synthetic_ffn_inputs(jax.random.key(0), 4096, 1024, 2816, density=0.01, pattern="heavy")
    w_gate = inp.w_gate if gated else None
    want = jt.sparse_ffn(inp.x, w_gate, inp.w_up, inp.w_down, implementation="cuda")
    tok = NamedSharding(mesh, P(sharding.token_axes or None, None))
    col = NamedSharding(mesh, P(None, sharding.tensor_axis))
    row = NamedSharding(mesh, P(sharding.tensor_axis, None))
    args = (
        jax.device_put(inp.x, tok),
        None if w_gate is None else jax.device_put(w_gate, col),
        jax.device_put(inp.w_up, col),
        jax.device_put(inp.w_down, row),
    )
    fn = jax.jit(lambda x, wg, wu, wd: jt.sparse_ffn(x, wg, wu, wd, implementation="cuda", sharding=sharding))
    hlo = fn.lower(*args).compile().as_text()
    assert "jax_twell_ffn" in hlo and "all-gather" not in hlo.split("ENTRY")[-1]
    assert_close(fn(*args), want, 2 * fused_tolerance(jnp.bfloat16, 2816), f"{layout} gated={gated}")
