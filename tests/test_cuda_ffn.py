"""The fused TwELL FFN kernels (ffi/twell_ffn.cu) against the reference, on every edge."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_twell as jt
from jax_twell.formats import pack_twell_reference, relu_matmul
from jax_twell.testing import synthetic_ffn_inputs
from specs import GPU_SPECS, assert_close, fused_tolerance, tolerance
from jax_twell.ops.costs import DenseCrossover
from jax_twell.ops.ffn import cuda as ffn_cuda
from jax_twell.ops import layout
from jax_twell.ops.ffn import reference as ffn_reference
from cuda_calls import cuda_ffn
from jax_twell.ops.ffn.api import sparse_ffn_for_layer
from jax_twell.ops.plan import LayerInfo, Side

pytestmark = pytest.mark.gpu

FORCED = LayerInfo(side=Side.SPARSE)  # the kernels, whatever the rule says


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("spec", GPU_SPECS, ids=str)
def test_fused_ffn_matches_reference(spec, dtype, gated):
    if spec.d % (16 // jnp.dtype(dtype).itemsize):
        pytest.skip("d not a multiple of 16 bytes of elements (a documented constraint)")
    inp = synthetic_ffn_inputs(jax.random.key(spec.m + 7), spec.m, spec.d, spec.f, density=spec.density, pattern=spec.pattern, dtype=dtype)
    w_gate = inp.w_gate if gated else None
    w_up = inp.w_up if gated else inp.w_gate
    for tile, capacity in [(256, 32), (64, 4)]:
        fn = jax.jit(lambda x, wg, wu, wd: cuda_ffn(x, wg, wu, wd, tile=tile, capacity=capacity, side=Side.SPARSE))
        # f32: no TF32 in either the op's XLA gate matmul or the reference.
        with jax.default_matmul_precision("highest"):
            y = fn(inp.x, w_gate, w_up, inp.w_down)
            want = ffn_reference.ffn(inp.x, w_gate, w_up, inp.w_down, tile=tile, capacity=capacity)
        assert y.dtype == dtype and y.shape == (spec.m, spec.d)
        assert_close(y, want, fused_tolerance(dtype, spec.f), f"{spec} tile={tile} cap={capacity}")


def test_fused_ffn_adversarial_rows():
    """Empty rows, rows far past capacity, fully dense rows, M=1 and M not a tile multiple."""
    d, f = 64, 520
    for m in (1, 3, 77):
        inp = synthetic_ffn_inputs(jax.random.key(m), m, d, f, density=0.02, dtype=jnp.bfloat16)
        x = inp.x
        if m > 2:
            x = x.at[0, 0].set(50.0)  # row 0 fires nowhere: empty row
            x = x.at[1, 0].set(-50.0)  # row 1 fires everywhere: every tile overflows
        g = relu_matmul(x, inp.w_gate)
        for gated in (True, False):
            w_up = inp.w_up if gated else inp.w_gate
            for tile, capacity in [(256, 32), (32, 1), (64, 4)]:
                act = pack_twell_reference(g, tile=tile, capacity=capacity)
                args = (x, act, inp.w_gate, w_up if gated else None, inp.w_down)
                y = jt.twell_ffn(*args, implementation="cuda")
                want = jt.twell_ffn(*args, implementation="reference")
                assert_close(y, want, fused_tolerance(jnp.bfloat16, f), f"m={m} gated={gated} tile={tile} cap={capacity}")
                if m > 2:  # the last, partial tile (8 columns) can fit the capacity
                    assert bool(act.overflowed[1, :-1].all()) and int(act.counts[0].sum()) == 0


@pytest.mark.parametrize("d", [2048, 4096, 1000])
def test_fused_ffn_many_rows_with_overflow(d):
    """Many rows of several widths, with tiles past capacity, dense rows and empty rows."""
    m, f = 1500, 1300
    inp = synthetic_ffn_inputs(jax.random.key(d), m, d, f, density=0.03, pattern="heavy", dtype=jnp.bfloat16)
    x = inp.x.at[:7, 0].set(-50.0).at[7:20, 0].set(50.0)  # dense rows (every tile over), empty rows
    g = relu_matmul(x, inp.w_gate)
    for gated in (True, False):
        w_up = inp.w_up if gated else None
        act = pack_twell_reference(g, tile=128, capacity=8)
        assert bool(act.overflowed.any())
        y = ffn_cuda.twell_ffn(x, act, inp.w_gate, w_up, inp.w_down)
        want = ffn_reference.twell_ffn(x, act, inp.w_gate, w_up, inp.w_down)
        assert_close(y, want, fused_tolerance(jnp.bfloat16, f), f"d={d} gated={gated}")


def test_fused_ffn_poisoned_output_fully_written_and_deterministic():
    inp = synthetic_ffn_inputs(jax.random.key(3), 300, 256, 1000, density=0.05, pattern="heavy", dtype=jnp.bfloat16)
    act = pack_twell_reference(relu_matmul(inp.x, inp.w_gate), tile=128, capacity=8)
    fn = jax.jit(lambda *a: ffn_cuda.twell_ffn(*a))
    args = (inp.x, act, inp.w_gate, inp.w_up, inp.w_down)
    y1 = np.asarray(fn(*args))
    y2 = np.asarray(fn(*args))
    assert np.isfinite(y1).all()
    np.testing.assert_array_equal(y1, y2)




def test_fused_ffn_leading_dims_vmap_and_auto_dispatch():
    """The layer's side given sparse (small shapes run dense under the default rule)."""
    inp = synthetic_ffn_inputs(jax.random.key(11), 60, 128, 700, density=0.03, dtype=jnp.bfloat16)
    x = inp.x.reshape(3, 4, 5, 128)
    want = sparse_ffn_for_layer(x, inp.w_gate, inp.w_up, inp.w_down, implementation="reference", layer=FORCED)
    tol = fused_tolerance(jnp.bfloat16, 700)
    got = sparse_ffn_for_layer(x, inp.w_gate, inp.w_up, inp.w_down, implementation="cuda", layer=FORCED)
    assert got.shape == x.shape
    assert_close(got, want, tol, "leading dims")
    auto = jax.jit(lambda x: sparse_ffn_for_layer(x, inp.w_gate, inp.w_up, inp.w_down, layer=FORCED))
    assert "jax_twell_ffn_gated" in auto.lower(x).as_text()
    assert_close(auto(x), want, tol, "auto")
    vm = jax.vmap(lambda x: sparse_ffn_for_layer(x, inp.w_gate, inp.w_up, inp.w_down, implementation="cuda", layer=FORCED))(x)
    assert_close(vm, want, tol, "vmap")
    # twell_ffn on a batched TwELL.
    act = jt.gate_twell(x, inp.w_gate, implementation="cuda")
    y = jt.twell_ffn(x, act, inp.w_gate, inp.w_up, inp.w_down, implementation="cuda")
    assert_close(y, want, tol, "twell_ffn leading dims")
    empty = sparse_ffn_for_layer(jnp.zeros((0, 128), jnp.bfloat16), inp.w_gate, inp.w_up, inp.w_down, implementation="cuda",
                                 layer=FORCED)
    assert empty.shape == (0, 128)


@pytest.mark.parametrize("gated", [True, False])
def test_grad_and_vmap_through_the_kernels(gated):
    """On the kernels: vmap over tokens (one folded call) gives the per-element results, and
    jax.grad (also vmapped) equals jax.grad of XLA's dense FFN (the op's VJP recomputes it;
    up to XLA's own fusion differences)."""
    inp = synthetic_ffn_inputs(jax.random.key(12), 96, 128, 700, density=0.03, dtype=jnp.bfloat16)
    w_gate = inp.w_gate if gated else None
    xb = inp.x.reshape(4, 24, 128)
    tol = fused_tolerance(jnp.bfloat16, 700)
    ffn = lambda x: sparse_ffn_for_layer(x, w_gate, inp.w_up, inp.w_down, implementation="cuda", layer=FORCED)
    want = sparse_ffn_for_layer(xb, w_gate, inp.w_up, inp.w_down, implementation="reference", layer=FORCED)
    assert_close(jax.jit(jax.vmap(ffn))(xb), want, tol, "vmap")
    ct = jax.random.normal(jax.random.key(13), xb.shape[1:], jnp.float32)
    loss = lambda impl: lambda x: jnp.sum(sparse_ffn_for_layer(x, w_gate, inp.w_up, inp.w_down, implementation=impl, layer=FORCED).astype(jnp.float32) * ct)
    got = jax.jit(jax.vmap(jax.grad(loss("cuda"))))(xb)
    grad_want = jax.vmap(jax.grad(loss("xla")))(xb)
    assert_close(got, grad_want, tolerance(jnp.bfloat16, 700, grad=True), "vmapped grad")


def test_dense_crossover_rule_is_inspectable_and_overridable():
    inp = synthetic_ffn_inputs(jax.random.key(2), 64, 128, 512, density=0.5, pattern="dense", dtype=jnp.bfloat16)
    want = jt.sparse_ffn(inp.x, inp.w_gate, inp.w_up, inp.w_down, implementation="xla")
    rule = DenseCrossover()
    assert isinstance(rule, DenseCrossover)
    # At 50% density the rule picks dense; forcing either side still gives the same y.
    assert not bool(rule.use_sparse(jnp.int32(64 * 256), jnp.int32(64 * 2), 64, 128, 512, 2))
    assert not rule.sparse_can_win(64, 128, 512, 2)  # decode-sized: dense at trace time
    assert rule.sparse_can_win(16384, 2048, 5632, 2)
    big = dict(m=16384, d=2048, f=5632, itemsize=2)
    # The row kernel (up weight transposed in the call) wins below ~0.3% active there
    # (test_cuda_dispatch.test_default_rule_matches_the_h200_measurements has the figures).
    assert bool(rule.use_sparse(16384 * 10, 0, **big)) and not bool(rule.use_sparse(16384 * 28, 0, **big))
    device_side = DenseCrossover(fixed_overhead=0.0, transpose_bandwidth=float("inf"), hbm_bandwidth=1e18)
    for side, rule in ((Side.DENSE, None), (Side.SPARSE, None), (Side.AUTO, None), (Side.AUTO, device_side)):
        y = cuda_ffn(inp.x, inp.w_gate, inp.w_up, inp.w_down, tile=256, capacity=32, rule=rule, side=side)
        assert_close(y, want, fused_tolerance(jnp.bfloat16, 512), f"side={side} rule={rule}")


def test_fused_ffn_clear_errors():
    x = jnp.ones((4, 12), jnp.bfloat16)  # d=12: not a multiple of 8 bf16 elements
    w = jnp.ones((12, 64), jnp.bfloat16)
    act = pack_twell_reference(relu_matmul(x, w), tile=64, capacity=4)
    with pytest.raises(ValueError, match="multiple of 8"):
        ffn_cuda.twell_ffn(x, act, w, w, w.T)
    assert not layout.row_supported(12, jnp.bfloat16) and layout.row_supported(2048, jnp.bfloat16)
    # The automatic choice falls back to dense XLA for shapes the kernel does not take.
    y = jt.sparse_ffn(x, w, w, w.T)
    assert_close(y, jt.sparse_ffn(x, w, w, w.T, implementation="xla"), 0.0, "fallback")
