"""The training FFN kernels' algorithm (NumPy model of ffi/twell_train.cu) on CPU: gradients
against train_reference.ffn_with_aux and the dense formula on adversarial inputs, the residual
layout, and the op's glue (custom_vjp, dense crossover, statistics) with the model standing
in for the kernels."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_twell as jt
from jax_twell.formats import pack_twell_reference, relu_matmul
import blocked_emulation as bemu
import train_emulation as emu
from jax_twell.testing import synthetic_ffn_inputs, with_extreme_rows
from specs import assert_close
from test_ops import dense_ffn  # the statement of the math (docs/design.md, section 1, The job)
from jax_twell.ops.costs import DenseCrossover
from jax_twell.ops.costs import TrainCrossover
from jax_twell.ops import costs
from jax_twell.ops import layout
from jax_twell.ops.ffn_train import binding as train_binding
from jax_twell.ops.ffn_train import reference as train_reference
from jax_twell.ops import xla
from cuda_calls import cuda_ffn_train
from jax_twell.ops.ffn_train import vjp as train_cuda
from jax_twell.ops.ffn_train.vjp import TrainKernels
from jax_twell.ops.plan import LayerInfo, Side, TrainOptions, default_train_rule, plan_ffn_train

pytestmark = pytest.mark.slow  # the NumPy model of the training kernels: CI runs it (-m slow)

L1 = 0.37
# bf16 gradients against f32 math: g, u, h and the outputs are rounded to bf16 (2^-9
# relative each); errors relative to the largest magnitude of the tensor.
GRAD_TOL = 2.0**-5


def make_case(m, d, f, density, pattern, gated, *, full=0, empty=0, key=0, dtype=jnp.bfloat16):
    inp = synthetic_ffn_inputs(jax.random.key(key), m, d, f, density=density, pattern=pattern, dtype=dtype)
    inp = with_extreme_rows(inp, full=full, empty=empty)
    dy = jax.random.normal(jax.random.key(key + 1), (m, d), jnp.float32).astype(dtype)
    w_gate = inp.w_gate if gated else None
    w_up = inp.w_up if gated else inp.w_gate  # non-gated: the same activation pattern
    return inp.x, w_gate, w_up, inp.w_down, dy


def emulate(x, w_gate, w_up, w_down, dy, *, tile, capacity, max_entries=None, l1_grad=None):
    gated = w_gate is not None
    w_act = w_gate if gated else w_up
    act = pack_twell_reference(relu_matmul(x, w_act), tile=tile, capacity=capacity)
    need = bemu.needed_entries(np.asarray(act.counts), capacity, tile, act.f)
    e = need + 3 if max_entries is None else max_entries
    y, res, h_source, l1, fired = emu.train_forward(
        x, act.values, act.cols, act.counts, w_act, w_up if gated else None, w_up.T if gated else None, w_down,
        tile=tile, max_entries=e,
    )
    m = x.shape[0]
    l1_grad = L1 / m if l1_grad is None else l1_grad
    bwd = emu.train_backward(x, dy, w_act.T, w_up.T if gated else None, w_down, res, l1_grad, tile=tile)
    return act, (y, res, h_source, l1, fired), bwd


def grads_of(fn, x, w_gate, w_up, w_down, dy):
    out, vjp = jax.vjp(fn, x, w_gate, w_up, w_down)
    return out, vjp((dy.astype(out[0].dtype), jnp.float32(L1)))


def check_against_reference(x, w_gate, w_up, w_down, dy, act, fwd, bwd, what):
    y, res, h_source, l1, fired = fwd
    dx, dw_down, dw_act_t, dw_up_t = bwd[:4]
    gated = w_gate is not None
    got = {"y": y, "dx": dx, "dw_down": dw_down}
    if gated:
        got.update(dw_gate=dw_act_t.T, dw_up=dw_up_t.T)
    else:
        got.update(dw_up=dw_act_t.T)
    ref_fn = lambda *a: train_reference.ffn_with_aux(*a, width=16, backup_capacity=None)[:2]
    (y_ref, l1_ref), g_ref = grads_of(ref_fn, x, w_gate, w_up, w_down, dy)
    (y_dense, l1_dense), g_dense = grads_of(dense_ffn, x, w_gate, w_up, w_down, dy)
    names = ["dx", "dw_gate", "dw_up", "dw_down"]
    for name, r, dn in zip(names, g_ref, g_dense):
        if r is None:
            continue
        assert_close(got[name], r, GRAD_TOL / 2, f"{what} {name} vs reference")
        assert_close(got[name], dn, GRAD_TOL, f"{what} {name} vs dense")
    assert_close(y, y_ref, GRAD_TOL, f"{what} y vs reference")
    assert_close(y, y_dense, GRAD_TOL, f"{what} y vs dense")
    np.testing.assert_allclose(l1, l1_dense, rtol=2e-2, err_msg=what)
    active = np.asarray(relu_matmul(x, w_gate if gated else w_up)) != 0
    np.testing.assert_array_equal(fired, active.any(0), what)


# m, d, f, density, pattern, full rows (every tile overflowed), empty rows
CASES = [
    (1, 64, 260, 0.05, "uniform", 0, 0),  # M=1, f not a multiple of the tile
    (3, 64, 520, 0.02, "uniform", 1, 1),  # a row far past capacity and an empty row
    (77, 128, 300, 0.05, "heavy", 3, 5),  # heavy-tailed rows
    (1100, 64, 700, 0.02, "heavy", 4, 10),  # two token blocks, the second partial
    (40, 64, 256, 0.5, "dense", 0, 0),  # every row overflowing
    (600, 64, 700, 0.02, "skewed", 0, 0),  # neurons over 1/16 of a tile: shared by all weight-gradient groups
    (1100, 64, 520, 0.01, "skewed", 0, 0),  # one neuron with 44% of its tile's entries
    (600, 128, 700, 0.02, "skewed", 0, 0),  # the same with 16-lane weight-gradient groups (d % 128 == 0)
]


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"m{c[0]}_d{c[1]}_f{c[2]}_{c[4]}")
def test_emulated_gradients_match_reference(case, gated):
    m, d, f, density, pattern, full, empty = case
    x, wg, wu, wd, dy = make_case(m, d, f, density, pattern, gated, full=full, empty=empty, key=m + f)
    for tile, capacity in [(256, 32), (64, 4)]:
        act, fwd, bwd = emulate(x, wg, wu, wd, dy, tile=tile, capacity=capacity)
        what = f"{case} gated={gated} tile={tile} cap={capacity}"
        if full:
            assert bool(act.overflowed[: full].any())
        check_against_reference(x, wg, wu, wd, dy, act, fwd, bwd, what)


def test_emulated_f16():
    x, wg, wu, wd, dy = make_case(200, 64, 400, 0.05, "heavy", True, full=2, empty=2, key=5, dtype=jnp.float16)
    act, fwd, bwd = emulate(x, wg, wu, wd, dy, tile=128, capacity=8)
    check_against_reference(x, wg, wu, wd, dy, act, fwd, bwd, "f16")


def test_forward_is_the_blocked_kernel_and_residuals_are_sparse():
    """y and h equal the inference model's bits; entries keep g, up keeps u; by_col lists
    each segment's fired entries by (column, token); nothing is M x f."""
    x, wg, wu, wd, dy = make_case(1500, 64, 600, 0.03, "heavy", True, full=2, empty=3, key=9)
    tile, capacity = 128, 8
    act, (y, res, h_source, l1, fired), _ = emulate(x, wg, wu, wd, dy, tile=tile, capacity=capacity)
    need = bemu.needed_entries(np.asarray(act.counts), capacity, tile, 600)
    y_inf, ws = bemu.blocked_ffn(x, act.values, act.cols, act.counts, wg, wu, wu.T, wd, tile=tile, max_entries=need + 3)
    np.testing.assert_array_equal(np.asarray(y).view(np.uint16), np.asarray(y_inf).view(np.uint16))
    np.testing.assert_array_equal(h_source[:need], ws.entries[:need])
    # Entries keep g (the TwELL value of stored entries) with the inference layout's low half.
    np.testing.assert_array_equal(res.entries[:need] & 0xFFFF, ws.entries[:need] & 0xFFFF)
    m = x.shape[0]
    n_blocks, n_tiles = res.tok_off.shape[:2]
    assert res.col_off.shape == (n_blocks, n_tiles, tile + 1)
    defined = by_col = res.by_col[emu.by_col_defined(res)]
    assert defined.size == int((np.asarray(relu_matmul(x, wg)) != 0).sum())
    for s in range(n_blocks * n_tiles):
        start, co = res.seg_start[s], res.col_off.reshape(-1, tile + 1)[s]
        words = res.by_col[start : start + co[-1]]
        local = words & ((1 << emu.TOKEN_SHIFT) - 1)
        cols = res.entries[start + local] & bemu.COLUMN_MASK
        assert np.all(np.diff(cols.astype(np.int64)) >= 0)
        for c in np.nonzero(np.diff(co))[0]:
            assert np.all(cols[co[c] - 0 : co[c + 1]] == c)
            tokens = words[co[c] : co[c + 1]] >> emu.TOKEN_SHIFT
            assert np.all(np.diff(tokens.astype(np.int64)) > 0)
    residual_bytes = sum(a.nbytes for a in (res.seg_start, res.tok_off, res.entries, res.up, res.col_off, by_col))
    assert residual_bytes < m * 600 * 2  # smaller than one dense bf16 activation even here


def test_rows_computed_alone_give_the_same_bits():
    """dx of a token does not depend on the other tokens of its block (fixed per-token order;
    the L1 cotangent per token, dl1 / M, held fixed)."""
    x, wg, wu, wd, dy = make_case(40, 64, 300, 0.05, "heavy", True, full=1, empty=1, key=4)
    _, _, bwd = emulate(x, wg, wu, wd, dy, tile=64, capacity=4)
    for t in (0, 1, 17, 39):
        _, _, one = emulate(x[t : t + 1], wg, wu, wd, dy[t : t + 1], tile=64, capacity=4, l1_grad=L1 / 40)
        np.testing.assert_array_equal(np.asarray(one[0]).view(np.uint16), np.asarray(bwd[0][t : t + 1]).view(np.uint16))


# ---------------------------------------------------------------------------------------
# The op around the kernels: the model stands in for the pack and both handlers.


KERNEL_CALLS: list[str] = []  # which emulated handlers ran (lax.cond picks at run time)


def _callback(fn, shapes, *args):
    return jax.pure_callback(fn, shapes, *args, vmap_method="sequential")


def _emulated_pack(g, *, tile, capacity):
    return pack_twell_reference(g, tile=tile, capacity=capacity)


def _emulated_forward(x, act, w_act, w_up, w_down, *, max_entries, tensor_cores=False, down_union=False, up_union=False,
                      down_stationary=False):
    gated = w_up is not None
    # the token order the kernels' stationary down walk keeps (zeros here: the model's dx
    # computes its own order)
    stationary = train_binding.forward_down_stationary(x.shape[0], x.shape[1], w_down.shape[0], max_entries, gated,
                                                    down_stationary)
    shapes = train_binding.residual_shapes(x.shape[0], act.n_tiles, act.tile, max_entries, gated, stationary)
    out_shapes = (jax.ShapeDtypeStruct(x.shape, x.dtype), shapes, jax.ShapeDtypeStruct((max_entries,), jnp.uint32))

    def run(x, values, cols, counts, w_act, w_down, *w_up):
        KERNEL_CALLS.append("forward")
        y, r, h_source, _, _ = emu.train_forward(
            x, values, cols, counts, w_act, w_up[0] if gated else None, w_up[0].T if gated else None, w_down,
            tile=act.tile, max_entries=max_entries,
        )
        order = np.zeros(shapes.stat_order.shape, np.int32) if stationary else None
        res = train_binding.Residuals(r.seg_start, r.tok_off, r.entries, r.up, r.col_off, r.by_col, order)
        return np.asarray(y), res, h_source

    extra = (w_up,) if gated else ()
    return _callback(run, out_shapes, x, act.values, act.cols, act.counts, w_act, w_down, *extra)


def _emulated_backward(x, dy, w_gate, w_up, w_down, res, l1_grad, *, tile, tensor_cores=False, dx_tensor_cores=False, dx_union=False,
                       dh_union=False, dx_stationary=False, transposed=False):
    gated = w_gate is not None
    w_act = w_gate if gated else w_up
    # dw_gate and dw_up as the handler writes them ([f, d]) where asked, else as the weights
    flip = (lambda a: a) if transposed else (lambda a: a.T)
    grad = lambda w: jax.ShapeDtypeStruct(w.shape, x.dtype)
    grad_t = lambda w: jax.ShapeDtypeStruct(w.shape[::-1] if transposed else w.shape, x.dtype)
    shapes = (grad(x), grad_t(w_act), grad(w_down)) + ((grad_t(w_up),) if gated else ())

    def run(x, dy, w_act, w_up, w_down, res, l1_grad):
        KERNEL_CALLS.append("backward")
        r = emu.TrainResiduals(*(np.asarray(a) if a is not None else None for a in
                                 (res.seg_start, res.tok_off, res.entries, res.up, res.col_off, res.by_col)))
        dx, dw_down, dw_act_t, dw_up_t, _, _ = emu.train_backward(
            x, dy, np.asarray(w_act).T, np.asarray(w_up).T if gated else None, w_down, r, float(l1_grad), tile=tile
        )
        out = (np.asarray(dx), flip(np.asarray(dw_act_t)), np.asarray(dw_down))
        return out + ((flip(np.asarray(dw_up_t)),) if gated else ())

    out = _callback(run, shapes, x, dy, w_act, w_up, w_down, res, l1_grad)
    if gated:
        dx, dw_gate, dw_down, dw_up = out
        return dx, dw_gate, dw_up, dw_down
    dx, dw_up, dw_down = out
    return dx, None, dw_up, dw_down


EMULATED = TrainKernels(pack=_emulated_pack, forward=_emulated_forward, backward=_emulated_backward)


@pytest.fixture
def emulated_kernels():
    """The NumPy model standing in for the pack and both handlers (passed as ``kernels``)."""
    KERNEL_CALLS.clear()
    return EMULATED


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize(
    "side,width,backup",
    [(Side.SPARSE, 128, None), (Side.DENSE, 128, None), (Side.SPARSE, 2, None), (Side.SPARSE, 128, 0)],
    ids=["sparse", "dense_side", "over_budget", "backup_exceeded"],
)
def test_op_glue_with_emulated_kernels(emulated_kernels, side, width, backup, gated):
    x, wg, wu, wd, dy = make_case(300, 64, 520, 0.03, "heavy", gated, full=2, empty=3, key=11)
    fn = functools.partial(cuda_ffn_train, width=width, backup_capacity=backup, side=side, kernels=emulated_kernels)
    (y, l1), grads = grads_of(jax.jit(lambda *a: fn(*a)[:2]), x, wg, wu, wd, dy)
    (y_ref, l1_ref), g_ref = grads_of(lambda *a: train_reference.ffn_with_aux(*a, width=16, backup_capacity=None)[:2], x, wg, wu, wd, dy)
    jax.block_until_ready(grads)
    assert KERNEL_CALLS == (["forward", "backward"] if side == Side.SPARSE and width > 2 and backup is None else [])
    for name, g, r in zip(["dx", "dw_gate", "dw_up", "dw_down"], grads, g_ref):
        if r is None:
            assert g is None
            continue
        assert g.dtype == jnp.bfloat16
        assert_close(g, r, GRAD_TOL, f"{name} width={width} backup={backup}")
    assert_close(y, y_ref, GRAD_TOL, "y")
    np.testing.assert_allclose(l1, l1_ref, rtol=2e-2)
    _, l1_, counts, fired = fn(x, wg, wu, wd)
    active = np.asarray(relu_matmul(x, wg if gated else wu)) != 0
    np.testing.assert_array_equal(counts, active.sum(-1))
    np.testing.assert_array_equal(fired, active.any(0))


def test_sparse_path_runs_the_kernels_and_keeps_no_dense_residual(emulated_kernels):
    x, wg, wu, wd, dy = make_case(300, 64, 520, 0.03, "heavy", True, key=12)
    fn = lambda *a: cuda_ffn_train(*a, width=128, side=Side.SPARSE, kernels=emulated_kernels)[:2]
    _, residuals = jax.vjp(fn, x, wg, wu, wd)
    leaves = jax.tree.leaves(residuals)
    assert not any(a.ndim == 2 and a.shape[1] == 520 and a.shape[0] >= 300 for a in leaves)


@pytest.mark.parametrize("width", [128, 2], ids=["sparse", "over_budget"])
def test_fused_gate_in_the_training_forward(emulated_kernels, width):
    """A plan with the fused gate (decided for the kernels, from FUSED_GATE_MIN_TOKENS
    tokens) takes TwELL from the fused gate kernel instead of XLA's matmul + the pack; past
    the entry budget the dense branch recomputes the gate. Gradients and statistics as
    the reference's either way. (The plan for 300 tokens, given the fused gate.)"""
    gates = []

    def gate(x, w, *, tile, capacity):
        gates.append(x.shape)
        return pack_twell_reference(relu_matmul(x, w), tile=tile, capacity=capacity)

    def no_pack(*a, **k):
        pytest.fail("the pack ran")

    kernels = dataclasses.replace(emulated_kernels, gate_pack=gate, pack=no_pack)
    x, wg, wu, wd, dy = make_case(300, 64, 520, 0.03, "heavy", True, full=2, empty=3, key=14)
    plan = plan_ffn_train(300, 64, 520, jnp.bfloat16, gated=True, layer=LayerInfo(side=Side.SPARSE),
                          options=TrainOptions(width=width))
    assert not plan.fused_gate  # under FUSED_GATE_MIN_TOKENS
    plan = dataclasses.replace(plan, fused_gate=True)
    fn = lambda *a: train_cuda.run(plan, *a, kernels)
    (y, l1), grads = grads_of(jax.jit(lambda *a: fn(*a)[:2]), x, wg, wu, wd, dy)
    (y_ref, l1_ref), g_ref = grads_of(lambda *a: train_reference.ffn_with_aux(*a, width=16, backup_capacity=None)[:2], x, wg, wu, wd, dy)
    jax.block_until_ready(grads)
    assert gates and KERNEL_CALLS == (["forward", "backward"] if width > 2 else [])
    for name, g, r in zip(["dx", "dw_gate", "dw_up", "dw_down"], grads, g_ref):
        assert_close(g, r, GRAD_TOL, f"{name} width={width}")
    assert_close(y, y_ref, GRAD_TOL, "y")
    np.testing.assert_allclose(l1, l1_ref, rtol=2e-2)
    _, _, counts, fired = fn(x, wg, wu, wd)
    active = np.asarray(relu_matmul(x, wg)) != 0
    np.testing.assert_array_equal(counts, active.sum(-1))
    np.testing.assert_array_equal(fired, active.any(0))


def test_api_default_takes_the_kernels_where_available():
    """implementation=None: the kernels on a Hopper GPU with the library (the per-call
    device choice when nothing is known about the layer); on a CPU the CPU training op
    (which runs XLA's own step at this size), else XLA."""
    x, wg, wu, wd, _ = make_case(64, 64, 256, 0.05, "uniform", True, key=13)
    y_default, aux = jt.sparse_ffn_train(x, wg, wu, wd)
    y_xla, _ = jt.sparse_ffn_train(x, wg, wu, wd, implementation="xla")
    if not jt.kernels_available():
        np.testing.assert_array_equal(np.asarray(y_default, np.float32), np.asarray(y_xla, np.float32))
        jaxpr = str(jax.make_jaxpr(lambda *a: jt.sparse_ffn_train(*a)[0])(x, wg, wu, wd))
        # no CUDA kernels here: a branch for the CPU where its kernels are built, else XLA only
        assert ("platform_index" in jaxpr) == jt.cpu_kernels_available()
        assert "jax_twell_cpu_backward" not in jaxpr  # 64 tokens: XLA's own step
        with pytest.raises(RuntimeError, match="kernels are unavailable"):
            jt.sparse_ffn_train(x, wg, wu, wd, implementation="cuda")


def test_crossover_rule_predictions():
    rule = TrainCrossover()
    m, d, f = 16384, 2048, 5632
    assert rule.sparse_can_win(m, d, f, 2) and not rule.sparse_can_win(64, d, f, 2)
    pairs = lambda p: int(p * m * f)
    # Fitted to the H200 (benchmarks/fit_train_rule.py, training_fit_e593e40_*.json, steps
    # timed as value_and_grad): the kernels at 0.5% take ~2.28 ms against XLA's ~4.6 ms,
    # 1.37x at 0.99%, 1.15x at 1.27%, 1.12x at 1.38% and 1.01x at 1.50% (uniform rows); per
    # call (the union unknown: the uniform pattern's) the rule crosses over near 1.5% active.
    for p in (0.003, 0.005, 0.007, 0.009, 0.01, 0.012, 0.013, 0.014, 0.0145):
        assert bool(rule.use_sparse(pairs(p), 0, m, d, f, 2)), p
    for p in (0.015, 0.016, 0.02, 0.5):
        assert not bool(rule.use_sparse(pairs(p), 0, m, d, f, 2)), p
    # Each overflowed tile adds to the sparse estimate.
    assert not bool(rule.use_sparse(pairs(0.003), 200_000, m, d, f, 2))
    # A measured union prices the union products by it. The benchmark's points at 1%
    # active: uniform rows (union 47% of f) win on the kernels (1.37x), skewed ones (union
    # 27%, a trained layer's spread) more (1.45x); at 1.27% uniform (union 56%) 1.15x and at
    # 1.24% skewed (union 30%) 1.21x. The rule keeps both sparse, and a skewed layer stays
    # sparse further than a uniform one.
    assert rule.prefers_sparse(m, d, f, 2, 0.0099, 0.472)
    assert rule.prefers_sparse(m, d, f, 2, 0.0100, 0.267)
    assert rule.prefers_sparse(m, d, f, 2, 0.0124, 0.296)
    assert rule.prefers_sparse(m, d, f, 2, 0.0127, 0.558)
    assert rule.prefers_sparse(m, d, f, 2, 0.016, 0.267) and not rule.prefers_sparse(m, d, f, 2, 0.016, 0.644)
    assert not rule.prefers_sparse(m, d, f, 2, 0.015)  # unknown union: the uniform pattern's
    assert rule.uniform_union(0.01) == pytest.approx(0.474, abs=1e-3)
    unknown = rule.sparse_cost(pairs(0.01), 0, m, d, f, 2)
    as_uniform = rule.sparse_cost(pairs(0.01), 0, m, d, f, 2, union=rule.uniform_union(0.01))
    np.testing.assert_allclose(unknown, as_uniform, rtol=1e-5)
    # A smaller union is cheaper, by its rows: 5 tables x d x 2 B per union row and block.
    saved = float(as_uniform - rule.sparse_cost(pairs(0.01), 0, m, d, f, 2, union=0.2))
    np.testing.assert_allclose(saved, (m // 64) * (rule.uniform_union(0.01) - 0.2) * f * 5 * d * 2 / rule.union_bandwidth,
                               rtol=1e-4)
    with pytest.raises(ValueError, match="union_fraction"):
        rule.prefers_sparse(m, d, f, 2, 0.01, 1.2)
    with pytest.raises(ValueError, match="multiple of 64"):
        layout.check_train_supported(96)


# Crosses over at 0.5% active for d=64 (no fixed costs): dense is 16 M d f / rate, sparse
# 0.005 M f (8 d + 4 d) / 1e12 at the crossover.
CROSSES_AT_HALF_PERCENT = TrainCrossover(
    matmul_rate=16 * 64 / (0.005 * 12 * 64 / 1e12), hbm_bandwidth=1e30, union_bandwidth=1e30,
    transpose_bandwidth=1e30, pair_rate=1e12, grad_stream_bandwidth=1e12, fixed_overhead=0.0, min_tokens=1,
)


@pytest.mark.parametrize("fraction,sparse", [(0.001, True), (0.02, False)], ids=["sparse", "dense"])
def test_active_fraction_decides_at_trace_time(emulated_kernels, fraction, sparse):
    """Given the layer's active fraction, the op is either the kernels with no cost check
    on the device, or plain XLA autodiff with no kernel and no cond; both exact."""
    rule = CROSSES_AT_HALF_PERCENT
    assert rule.prefers_sparse(300, 64, 520, 2, fraction) == sparse
    x, wg, wu, wd, dy = make_case(300, 64, 520, 0.03, "heavy", True, full=2, empty=3, key=15)
    fn = lambda *a: cuda_ffn_train(*a, width=128, active_fraction=fraction, rule=rule, kernels=emulated_kernels)[:2]
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda *a: fn(*a)[0].astype(jnp.float32).sum(), (0, 1, 2, 3)))(x, wg, wu, wd))
    assert ("cond" in jaxpr) == sparse  # sparse: only the entry-budget check remains
    assert ("callback" in jaxpr) == sparse
    if not sparse:
        xla_jaxpr = str(jax.make_jaxpr(jax.grad(lambda *a: xla.ffn_with_aux(*a)[0].astype(jnp.float32).sum(), (0, 1, 2, 3)))(x, wg, wu, wd))
        assert jaxpr == xla_jaxpr  # the dense formula's autodiff, nothing added
    (y, l1), grads = grads_of(jax.jit(fn), x, wg, wu, wd, dy)
    (y_ref, l1_ref), g_ref = grads_of(lambda *a: train_reference.ffn_with_aux(*a, width=16, backup_capacity=None)[:2], x, wg, wu, wd, dy)
    jax.block_until_ready(grads)
    assert KERNEL_CALLS == (["forward", "backward"] if sparse else [])
    for name, g, r in zip(["dx", "dw_gate", "dw_up", "dw_down"], grads, g_ref):
        assert_close(g, r, GRAD_TOL, f"{name} fraction={fraction}")
    assert_close(y, y_ref, GRAD_TOL, "y")
    np.testing.assert_allclose(l1, l1_ref, rtol=2e-2)


def test_default_rule_prices_the_steps_that_run():
    """The default rule holds where the stationary walks run (fitted there); where they do
    not (f past 7,264, where dx's walks would hold 8 columns, or the walks off), the union steps'
    constants of the fit before them; a rule passed in the options is used as given."""
    default = TrainCrossover()
    assert default_train_rule(16384, 2048, 5632, 2) == default
    unions = dataclasses.replace(default, **costs.UNION_STEPS_CONSTANTS)
    assert default_train_rule(16384, 2048, 8192, 2) == unions  # 16,384 table rows
    off = TrainOptions(dx_stationary=False)
    assert plan_ffn_train(16384, 2048, 5632, jnp.bfloat16, gated=True, options=off).rule == unions
    # the union steps cost more: the crossover moves down where the walks do not run
    assert default.prefers_sparse(16384, 2048, 5632, 2, 0.01) and not unions.prefers_sparse(16384, 2048, 5632, 2, 0.01)
    custom = dataclasses.replace(default, margin=0.9)
    plan = plan_ffn_train(16384, 2048, 8192, jnp.bfloat16, gated=True, options=TrainOptions(rule=custom))
    assert plan.rule == custom


def test_active_fraction_is_checked_and_follows_the_rule():
    rule = CROSSES_AT_HALF_PERCENT
    assert rule.prefers_sparse(300, 64, 520, 2, 0.0) and not rule.prefers_sparse(300, 64, 520, 2, 1.0)
    assert not dataclasses.replace(rule, min_tokens=301).prefers_sparse(300, 64, 520, 2, 0.0)
    # The fitted H200 rule at the benchmark shape: dense from ~1.5% active.
    h200 = TrainCrossover()
    assert h200.prefers_sparse(16384, 2048, 5632, 2, 0.0145) and not h200.prefers_sparse(16384, 2048, 5632, 2, 0.015)
    with pytest.raises(ValueError, match="active_fraction"):
        rule.prefers_sparse(300, 64, 520, 2, 1.5)
    with pytest.raises(ValueError, match="active_fraction"):
        LayerInfo(active_fraction=-0.1)
    with pytest.raises(ValueError, match="union_fraction"):
        LayerInfo(active_fraction=0.01, union_fraction=2.0)


def test_union_fraction_decides_with_the_active_fraction(emulated_kernels):
    """A measured union moves the trace-time choice: at a density where the uniform
    pattern's union makes the kernels lose, a small union keeps them (a rule where only
    union rows and pairs cost). Without active_fraction it is refused."""
    rule = dataclasses.replace(CROSSES_AT_HALF_PERCENT, pair_rate=1e30, grad_stream_bandwidth=1e30,
                               union_bandwidth=1e12)
    m, d, f = 300, 64, 520
    # dense 16 m d f / rate; the union term blocks x union x f x 5 d x 2 B at union_bandwidth
    at_cost = rule.dense_cost(m, d, f) * rule.union_bandwidth / (-(-m // 64) * f * 5 * d * 2)  # both the same
    assert 0.2 < at_cost < 0.5
    assert rule.prefers_sparse(m, d, f, 2, 0.01, 0.9 * at_cost)
    assert not rule.prefers_sparse(m, d, f, 2, 0.01, 1.1 * at_cost)
    x, wg, wu, wd, _ = make_case(m, d, f, 0.03, "heavy", True, key=17)
    fn = lambda u: lambda *a: cuda_ffn_train(*a, width=128, active_fraction=0.01, union_fraction=u, rule=rule,
                                             kernels=emulated_kernels)[0]
    for union, kernels in ((0.9 * at_cost, True), (1.1 * at_cost, False)):
        jaxpr = str(jax.make_jaxpr(fn(union))(x, wg, wu, wd))
        assert ("callback" in jaxpr) == kernels, union
    with pytest.raises(ValueError, match="with active_fraction"):
        cuda_ffn_train(x, wg, wu, wd, width=128, union_fraction=0.1)


@pytest.mark.skipif(len(jax.devices("cpu")) < 4, reason="needs 4 host devices")
@pytest.mark.parametrize("layout", ["data", "tensor", "data+tensor"])
def test_op_glue_under_a_mesh(emulated_kernels, layout):
    """Per shard under shard_map (data and/or tensor parallel): both lax.cond branches agree
    on device-varying types, weight gradients are summed over the token shards."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jax_twell.ops.sharded import shard_ffn_train

    mesh = jax.make_mesh((2, 2), ("data", "tensor"), devices=jax.devices("cpu")[:4])
    token_axes, tensor_axis = {"data": (("data", "tensor"), None), "tensor": ((), "tensor"), "data+tensor": (("data",), "tensor")}[layout]
    sharding = jt.FFNSharding(token_axes=token_axes, tensor_axis=tensor_axis, mesh=mesh)
    x, wg, wu, wd, dy = make_case(256, 64, 512, 0.03, "heavy", True, full=2, empty=3, key=14)
    fn = functools.partial(cuda_ffn_train, width=128, side=Side.SPARSE, kernels=emulated_kernels)

    def loss(*a):
        y, aux = shard_ffn_train(fn, sharding, 128, *a)
        return (y.astype(jnp.float32) * dy.astype(jnp.float32)).sum() + L1 * aux.l1

    tok = NamedSharding(mesh, P(token_axes or None, None))
    col, row = NamedSharding(mesh, P(None, tensor_axis)), NamedSharding(mesh, P(tensor_axis, None))
    placed = (jax.device_put(x, tok), jax.device_put(wg, col), jax.device_put(wu, col), jax.device_put(wd, row))
    grads = jax.block_until_ready(jax.jit(jax.grad(loss, (0, 1, 2, 3)))(*placed))
    assert "forward" in KERNEL_CALLS and "backward" in KERNEL_CALLS
    ref = lambda *a: train_reference.ffn_with_aux(*a, width=16, backup_capacity=None)[:2]
    _, g_ref = grads_of(ref, x, wg, wu, wd, dy)
    for name, g, r in zip(["dx", "dw_gate", "dw_up", "dw_down"], grads, g_ref):
        assert_close(g, r, GRAD_TOL, f"{layout} {name}")


def _backward_options_seen(keys, calls, key=14, d=64):
    """The backward call's options ``keys`` for each set of ``TrainOptions`` fields in
    ``calls`` (the NumPy model standing in for the kernels, passed in). The backward is
    traced once for each static backup size of the sparse side; every trace of one call
    must ask the same."""
    seen, traced = [], []

    def backward(*args, **kwargs):
        traced.append(tuple(kwargs[k] for k in keys))
        return _emulated_backward(*args, **kwargs)

    kernels = dataclasses.replace(EMULATED, backward=backward)
    x, wg, wu, wd, dy = make_case(300, d, 520, 0.03, "heavy", True, key=key)
    for kw in calls:
        traced.clear()
        fn = lambda *a, kw=kw: cuda_ffn_train(*a, width=128, side=Side.SPARSE, kernels=kernels, **kw)[:2]
        grads_of(jax.jit(fn), x, wg, wu, wd, dy)
        assert traced and len(set(traced)) == 1, (kw, traced)
        seen.append(traced[0])
    return seen


def test_dx_tensor_cores_follow_tensor_cores_unless_given(emulated_kernels):
    """The plan asks the backward call for dx on tensor cores when ``dx_tensor_cores`` says
    so, and by default exactly when ``tensor_cores`` does (the default: both on)."""
    calls = ({}, dict(tensor_cores=False), dict(dx_tensor_cores=False), dict(tensor_cores=False, dx_tensor_cores=True))
    seen = _backward_options_seen(("tensor_cores", "dx_tensor_cores"), calls)
    assert seen == [(True, True), (False, False), (True, False), (False, True)]


@pytest.mark.parametrize("option, needs, d, key", [("dx_union", "dx_tensor_cores", 256, 15),
                                                   ("dh_union", "tensor_cores", 384, 16)])
def test_backward_union_steps_follow_their_options(emulated_kernels, option, needs, d, key):
    """The plan asks the backward call for dx (dh) as a union product by default (on), or
    as told, and never without dx on tensor cores (the tensor-core steps)."""
    calls = ({}, {option: True}, {option: False}, {needs: False, option: True})
    seen = _backward_options_seen((needs, option), calls, key=key, d=d)
    assert seen == [(True, True), (True, True), (True, False), (False, False)]


def test_dx_stationary_reaches_the_backward_call(emulated_kernels):
    """The plan asks the backward call for dx by the stationary walk when told, by default
    where the inference rule's price of the walk says so, and never without dx on tensor
    cores."""
    calls = ({}, dict(dx_stationary=True), dict(dx_stationary=False), dict(dx_tensor_cores=False, dx_stationary=True))
    default = DenseCrossover().down_stationary(300, 256, 520, 2)
    seen = _backward_options_seen(("dx_tensor_cores", "dx_stationary"), calls, key=18, d=256)
    assert seen == [(True, default), (True, True), (True, False), (False, False)]


@pytest.mark.parametrize("option", ["up_union", "down_union", "down_stationary"])
def test_union_steps_reach_the_forward_call(emulated_kernels, option):
    """The plan asks the forward call for the up or down step as a union product, or the
    down step with the weight stationary, when told (default: on; the stationary step where
    the inference rule prices it below the union product), never without tensor cores."""
    seen = []

    def forward(*args, **kwargs):
        seen.append(kwargs[option])
        return _emulated_forward(*args, **kwargs)

    kernels = dataclasses.replace(emulated_kernels, forward=forward)
    x, wg, wu, wd, dy = make_case(300, 384, 520, 0.03, "heavy", True, key=17)
    default = True
    if option == "down_stationary":
        default = DenseCrossover().down_stationary(300, 384, 520, 2)
    cases = (({}, default), ({option: True}, True), ({option: False}, False),
             ({option: True, "tensor_cores": False}, False))
    for kw, expected in cases:
        seen.clear()
        fn = lambda *a, kw=kw: cuda_ffn_train(*a, width=128, side=Side.SPARSE, kernels=kernels, **kw)[:2]
        grads_of(jax.jit(fn), x, wg, wu, wd, dy)
        assert seen and all(v == expected for v in seen), (kw, seen)


def test_union_steps_state_their_constraints():
    """The forward's union steps: the down step needs d a multiple of 256, the up step ~4
    words per entry after u's row (d at least 320); both f at most 65536."""
    e = layout.train_max_entries(16384, 5632, 128)
    assert layout.union_down_supported(16384, 2048, 5632, e)
    assert not layout.union_down_supported(16384, 128 + 64, 5632, 10**6)  # d not a multiple of 256
    assert layout.union_up_supported(16384, 2048, 5632, e)
    assert not layout.union_up_supported(16384, 256, 5632, e)
    assert not layout.union_up_supported(64, 2048, 70000, 10**6)  # f past 65536


def test_union_dx_supported_states_its_constraints():
    """The union dx's constraints: d a multiple of 256, f at most 65536, its layout below
    2^31 words; the layout is ~2 words per coefficient (R per entry), whatever the budget."""
    e = layout.train_max_entries(16384, 5632, 128)
    assert layout.union_dx_supported(16384, 2048, 5632, e, True)
    assert layout.union_dx_supported(16384, 2048, 5632, e, False)
    assert not layout.union_dx_supported(16384, 2048 + 64, 5632, e, True)  # d not a multiple of 256
    assert not layout.union_dx_supported(64, 2048, 70000, 10**6, True)  # f past 65536
    assert not layout.union_dx_supported(2**20, 2048, 5632, 2**29, True)  # layout past 2^31 words
    assert layout.union_dx_supported(1, 256, 260, 6, True)  # a tight budget is fine
    for gated in (True, False):
        r = 2 if gated else 1
        assert 2 * r * e < layout.union_workspace_ints(16384, e, gated) < 2.1 * r * e + 16384


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("stationary", [True, False], ids=["stationary", "union"])
def test_backward_hands_the_weights_in_the_layout_its_dx_step_reads(monkeypatch, gated, stationary):
    """train_backward passes Wact (and Wu) to the handler as they are, [d, f], where dx runs
    the stationary walk (mma bit 4: the walk stages its table from them), and their
    transposes [f, d] for the other dx steps; bit 4 is set exactly then. A stand-in for the
    FFI call records the operands (no kernels on the CPU)."""
    m, d, f, e, tile = 300, 256, 512, 60000, 256  # e: room for dx's f32 sums in the partials
    calls = []

    def fake_kernel_call(target, result_types, *, vmap_method):
        def call(*operands, **attrs):
            calls.append((target, [o.shape for o in operands], attrs))
            return [jnp.zeros(r.shape, r.dtype) for r in result_types]
        return call

    monkeypatch.setattr(train_binding, "kernel_call", fake_kernel_call)
    key = jax.random.split(jax.random.key(3), 4)
    x = jax.random.normal(key[0], (m, d), jnp.bfloat16)
    wg = jax.random.normal(key[1], (d, f), jnp.bfloat16) if gated else None
    wu = jax.random.normal(key[2], (d, f), jnp.bfloat16)
    wd = jax.random.normal(key[3], (f, d), jnp.bfloat16)
    res = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                       train_binding.residual_shapes(m, f // tile, tile, e, gated))
    assert layout.walk_supported(m, d, f, e, 2 if gated else 1)
    train_binding.train_backward(x, x, wg, wu, wd, res, jnp.float32(0.0), tile=tile, tensor_cores=True, dx_tensor_cores=True,
                              dx_union=True, dx_stationary=stationary)
    (target, shapes, attrs), = calls
    assert target == ("jax_twell_train_bwd_gated" if gated else "jax_twell_train_bwd")
    want = (d, f) if stationary else (f, d)
    weights = shapes[2:4] if gated else shapes[2:3]
    assert all(w == want for w in weights), (weights, want)
    assert bool(int(attrs["mma"]) & 16) == stationary


def test_kept_token_order_composes_with_vmap_and_grad(emulated_kernels):
    """Where the forward's down walk keeps its token order (``Residuals.stat_order``), the
    op still composes: under jit and vmap over a batch of token sets its gradients equal
    those of each set alone, and the residual is there (an array, not None) to be kept."""
    m, d, f = 300, 256, 520
    assert train_binding.forward_down_stationary(m, d, f, layout.train_max_entries(m, f, 128), True, True)
    cases = [make_case(m, d, f, 0.03, "heavy", True, full=2, empty=3, key=k) for k in (31, 32)]
    wg, wu, wd = cases[0][1:4]
    fn = functools.partial(cuda_ffn_train, width=128, side=Side.SPARSE, kernels=emulated_kernels, down_stationary=True,
                           dx_stationary=True)

    def grads(x, dy):
        return grads_of(lambda *a: fn(*a)[:2], x, wg, wu, wd, dy)

    _, res_shapes = jax.eval_shape(lambda x: jax.vjp(lambda *a: fn(*a)[:2], x, wg, wu, wd), cases[0][0])
    kept = [leaf for leaf in jax.tree.leaves(res_shapes) if leaf.shape == (layout.walk_order_words(m),)]
    assert kept and all(leaf.dtype == jnp.int32 for leaf in kept)
    xs = jnp.stack([c[0] for c in cases])
    dys = jnp.stack([c[4] for c in cases])
    (ys, l1s), gs = jax.jit(jax.vmap(grads))(xs, dys)
    for i, c in enumerate(cases):
        (y, l1), g = jax.jit(grads)(c[0], c[4])
        np.testing.assert_array_equal(np.asarray(ys[i]), np.asarray(y))
        for a, b in zip(gs, g):
            np.testing.assert_array_equal(np.asarray(a[i]), np.asarray(b))


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("full,sparse", [(0, True), (5, True), (30, True), (100, False)],
                         ids=["none", "bucket_8", "bucket_40", "past_the_buckets"])
def test_rows_past_the_width_go_to_the_dense_backup(emulated_kernels, gated, full, sparse):
    """Rows past the hybrid width (here fully active tokens) are computed dense over their
    gathered rows at the smallest static size that holds them (300 tokens: 8, 16, 24, 40, 80 rows):
    the kernels see those rows empty, the call stays on the sparse side, and y, the L1
    term, the statistics and every gradient are the dense formula's. More rows than the
    largest size: the call runs dense."""
    seen = []

    def forward(x, act, *a, **k):
        jax.debug.callback(lambda c: seen.append(np.asarray(c).sum(axis=-1)), act.counts)
        return _emulated_forward(x, act, *a, **k)

    kernels = dataclasses.replace(emulated_kernels, forward=forward)
    assert layout.train_backup_buckets(300) == (0, 8, 16, 24, 40, 80)
    x, wg, wu, wd, dy = make_case(300, 64, 520, 0.01, "uniform", gated, key=21)
    rows = np.random.default_rng(full).choice(300, full, replace=False)
    wg_or_wu = wg if gated else wu
    # rows along the activation weight's column sums: most neurons fire, far past the width (128 of 520)
    x = x.at[rows, :].set(jnp.sign(jnp.asarray(wg_or_wu, jnp.float32).sum(axis=1)).astype(x.dtype) * 2.0)
    fn = functools.partial(cuda_ffn_train, width=128, side=Side.SPARSE, kernels=kernels)
    (y, l1), grads = grads_of(jax.jit(lambda *a: fn(*a)[:2]), x, wg, wu, wd, dy)
    (y_ref, l1_ref), g_ref = grads_of(lambda *a: train_reference.ffn_with_aux(*a, width=16, backup_capacity=None)[:2],
                                      x, wg, wu, wd, dy)
    jax.block_until_ready(grads)
    active = np.asarray(relu_matmul(x, wg_or_wu)) != 0
    over = active.sum(-1) > 128
    assert over.sum() >= full and (over.sum() <= 80) == sparse
    assert KERNEL_CALLS == (["forward", "backward"] if sparse else [])
    if sparse:
        assert np.all(seen[-1][over] == 0) and np.array_equal(seen[-1][~over], active[~over].sum(-1))
    for name, g, r in zip(["dx", "dw_gate", "dw_up", "dw_down"], grads, g_ref):
        if r is None:
            assert g is None
            continue
        assert_close(g, r, GRAD_TOL, f"{name} full={full}")
    assert_close(y, y_ref, GRAD_TOL, "y")
    np.testing.assert_allclose(l1, l1_ref, rtol=2e-2)
    _, _, counts, fired = fn(x, wg, wu, wd)
    np.testing.assert_array_equal(counts, active.sum(-1))
    np.testing.assert_array_equal(fired, active.any(0))
