"""The inference op's dispatch (jax_twell.ops.ffn.cuda: plans run with stand-in kernels) on CPU, with reference
stand-ins for the kernels: the counts it decides on, which branch each rule takes, and
that every branch computes the FFN. The kernels themselves are tested on the GPU."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_twell as jt
from jax_twell.formats import pack_twell_reference, relu_matmul
import blocked_emulation as bemu
from jax_twell.testing import synthetic_ffn_inputs, with_extreme_rows
from specs import assert_close, fused_tolerance
from jax_twell.ops.costs import DenseCrossover
from jax_twell.ops.ffn import binding as ffn_binding
from jax_twell.ops.ffn import cuda as ffn_cuda
from jax_twell.ops import stats
from jax_twell.ops import layout
from jax_twell.ops import plan
from jax_twell.ops.ffn import reference as ffn_reference
from jax_twell.ops.ffn import warp
from jax_twell.ops import xla
from cuda_calls import cuda_ffn
from jax_twell.ops import common
from jax_twell.ops.ffn.api import sparse_ffn_for_layer
from jax_twell.ops.ffn.cuda import FFNKernels
from cuda_calls import FUSED_KERNELS
from jax_twell.ops.plan import LayerInfo, Side

pytestmark = pytest.mark.slow  # about 5 CPU-minutes; CI runs it (-m slow)

ROW_MARK, BLOCKED_MARK, WARP_MARK = 3.0, 5.0, 7.0  # constant outputs of the stand-ins: which branch ran
# Rules without fixed costs (nor the row kernel's small-M rate), so that the small test shapes
# are not decided dense at trace time.
NO_FIXED = dict(fixed_overhead=0.0, transpose_bandwidth=float("inf"), row_full_tokens=1, per_call_min_tokens=0,
                per_call_min_d=0, layer_min_tokens=0, layer_min_tokens_no_conditional=0, warp_fixed_overhead=0.0,
                warp_pack_bandwidth=float("inf"))


@functools.partial(jax.jit, static_argnames=("tile", "capacity"))
def stand_in_pack(a, *, tile, capacity):  # a named call, recognisable in a jaxpr
    return pack_twell_reference(a, tile=tile, capacity=capacity)


@functools.partial(jax.jit, static_argnames=("tile", "capacity"))
def stand_in_gate(x, w, *, tile, capacity):  # a named call, recognisable in a jaxpr
    return pack_twell_reference(relu_matmul(x, w), tile=tile, capacity=capacity)


@pytest.fixture
def stand_ins():
    """``install(mark) -> FFNKernels``: the kernels replaced by the reference, passed in as
    ``kernels``; ``mark=True`` makes them return constants (which branch ran)."""

    def install(mark: bool):
        def row(x, act, w_act, w_up, w_down, w_up_t=None):
            if mark:
                return jnp.full(x.shape, ROW_MARK, x.dtype)
            return ffn_reference.twell_ffn(x, act, w_act, w_up, w_down)

        def blocked(x, act, w_act, w_up, w_down, w_up_t, *, max_entries, tensor_cores=False, down_union=False,
                    up_union=False, down_stationary=False, fallback=False):
            y = jnp.full(x.shape, BLOCKED_MARK, x.dtype) if mark else ffn_reference.twell_ffn(x, act, w_act, w_up, w_down)
            if fallback:  # the handler's own row-kernel fallback, where the entries overflow the workspace
                y = jnp.where(ffn_binding.blocked_needed_entries(act) <= max_entries, y, row(x, act, w_act, w_up, w_down))
            return (y,)

        def gate_pack(x, w, *, tile, capacity, variant=None):
            return stand_in_gate(x, w, tile=tile, capacity=capacity)

        def warp_rows(x, act, w_up_t, w_down, *, row_budget, columns=None):
            if not mark:
                return warp.ffn_rows_reference(x, act, w_up_t, w_down, row_budget=row_budget, columns=columns)
            y = jnp.full(x.shape, WARP_MARK, x.dtype)
            if columns is not None:  # the kernel's NaN rule on the marks
                y = common.as_dense_nonfinite(y, x, columns)
            return jnp.where(warp.backed_up(act, row_budget)[:, None], jnp.zeros((), x.dtype), y)

        return FFNKernels(pack=stand_in_pack, gate_pack=gate_pack, row=row, blocked=blocked, warp_rows=warp_rows,
                          warp_backup=None)  # the switch; the device-backup tests set a stand-in

    return install


@pytest.fixture
def decode_stand_ins():
    """``install(kernels) -> (seen, kernels)``: ``kernels`` with the decode kernels replaced
    by the reference; each call appends ``(path, M)`` to ``seen``: "kernel gate"
    (decode_ffn_gate), "xla gate" (decode_ffn) or "rows" (decode_ffn_rows)."""

    def install(kernels):
        seen = []

        def decode(x, g, w_up, w_down, *, w_up_t=None, workspace=False):
            seen.append(("xla gate", x.shape[0]))
            return ffn_reference.twell_ffn(x, pack_twell_reference(g, tile=256, capacity=256), None, w_up, w_down)

        def decode_gate(x, w_act, w_up, w_down, *, w_up_t=None, workspace=False):
            seen.append(("kernel gate", x.shape[0]))
            g = relu_matmul(x, w_act)
            return ffn_reference.twell_ffn(x, pack_twell_reference(g, tile=256, capacity=256), None, w_up, w_down)

        def decode_rows(x, w_act_t, w_down, *, w_up_t=None, workspace=False):
            seen.append(("rows", x.shape[0]))
            g = relu_matmul(x, w_act_t.T)
            w_up = None if w_up_t is None else w_up_t.T
            return ffn_reference.twell_ffn(x, pack_twell_reference(g, tile=256, capacity=256), None, w_up, w_down)

        return seen, dataclasses.replace(kernels, decode=decode, decode_gate=decode_gate, decode_rows=decode_rows)

    return install


def case(m=300, d=128, f=700, density=0.02, full=3, empty=5, key=0):
    inp = synthetic_ffn_inputs(jax.random.key(key), m, d, f, density=density)
    return with_extreme_rows(inp, full=full, empty=empty)


@pytest.mark.parametrize("tile,capacity", [(256, 32), (128, 8), (64, 4)])
@pytest.mark.parametrize("full,empty", [(0, 0), (4, 7), (300, 0)])
def test_gate_counts_match_the_packed_activation(tile, capacity, full, empty):
    # f = 700 is no multiple of any tile; `full` rows overflow every tile.
    inp = case(full=full, empty=empty, key=tile + full)
    g = relu_matmul(inp.x, inp.w_gate)
    act = pack_twell_reference(g, tile=tile, capacity=capacity)
    nnz, n_over, needed = jax.jit(lambda g: stats.gate_counts(g, tile=tile, capacity=capacity))(g)
    assert int(nnz) == int(act.counts.sum()) == int((np.asarray(g, np.float32) != 0).sum())
    assert int(n_over) == int(act.overflowed.sum())
    assert int(needed) == int(ffn_binding.blocked_needed_entries(act))
    if full:
        assert int(n_over) >= full * act.n_tiles  # the adversarial rows did overflow


@pytest.mark.parametrize("kernel", FUSED_KERNELS)
@pytest.mark.parametrize("gated", [True, False])
def test_every_branch_computes_the_ffn(stand_ins, kernel, gated):
    kernels = stand_ins(mark=False)
    inp = case(m=1100, key=3)  # above BLOCKED_MIN_TOKENS, two token blocks
    w_gate = inp.w_gate if gated else None
    want = xla.ffn(inp.x, w_gate, inp.w_up, inp.w_down)
    rule = DenseCrossover(**NO_FIXED)
    for side in Side:
        got = jax.jit(
            lambda x, wg, wu, wd: cuda_ffn(x, wg, wu, wd, tile=256, capacity=8, kernel=kernel, rule=rule, side=side,
                                           kernels=kernels)
        )(inp.x, w_gate, inp.w_up, inp.w_down)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert_close(got, want, fused_tolerance(jnp.bfloat16, 700), f"kernel={kernel} side={side}")


def run(rule, inp, kernel="row", side=Side.AUTO, *, kernels):
    fn = lambda x: cuda_ffn(x, inp.w_gate, inp.w_up, inp.w_down, tile=256, capacity=8, kernel=kernel, rule=rule,
                            side=side, kernels=kernels)
    return np.asarray(jax.jit(fn)(inp.x), np.float32)


def test_the_rule_picks_the_branch_on_the_device(stand_ins):
    kernels = stand_ins(mark=True)
    sparse_inp = case(m=1100, density=0.005, full=0, empty=0, key=5)
    dense_inp = case(m=1100, density=0.3, full=0, empty=0, key=6)
    nnz = {
        name: int(stats.gate_counts(relu_matmul(i.x, i.w_gate), tile=256, capacity=8)[0])
        for name, i in (("sparse", sparse_inp), ("dense", dense_inp))
    }
    assert nnz["sparse"] * 10 < nnz["dense"]
    # A rule whose threshold falls between the two: the row kernel's cost crosses the
    # dense cost at nnz = (dense - fixed) * pair_bandwidth / (2 d itemsize).
    dense_cost = DenseCrossover(**NO_FIXED).dense_cost(1100, 128, 700, 2)
    threshold = (nnz["sparse"] * nnz["dense"]) ** 0.5
    rule = DenseCrossover(pair_bandwidth=threshold * 2 * 128 * 2 / dense_cost, **NO_FIXED)
    assert (run(rule, sparse_inp, kernels=kernels) == ROW_MARK).all()
    y_dense = run(rule, dense_inp, kernels=kernels)
    assert not (y_dense == ROW_MARK).all()
    want = np.asarray(xla.ffn(dense_inp.x, dense_inp.w_gate, dense_inp.w_up, dense_inp.w_down), np.float32)
    np.testing.assert_array_equal(y_dense, want)  # the dense branch is XLA's FFN, bit for bit
    # Forced either way.
    assert (run(DenseCrossover(), dense_inp, side=Side.SPARSE, kernels=kernels) == ROW_MARK).all()
    np.testing.assert_array_equal(run(DenseCrossover(), sparse_inp, side=Side.DENSE, kernels=kernels), np.asarray(
        xla.ffn(sparse_inp.x, sparse_inp.w_gate, sparse_inp.w_up, sparse_inp.w_down), np.float32))
    # Blocked where its cost is lowest and its entries fit; the row kernel where they don't.
    cheap_blocked = DenseCrossover(
        blocked_pair_rate=1e30, blocked_fixed_overhead=0.0, blocked_weight_bandwidth=1e30, **NO_FIXED
    )
    assert (run(cheap_blocked, sparse_inp, kernel="blocked", kernels=kernels) == BLOCKED_MARK).all()
    assert (run(DenseCrossover(), sparse_inp, kernel="blocked", side=Side.SPARSE, kernels=kernels) == BLOCKED_MARK).all()
    # Overflowed tiles cost the blocked kernels a recompute each: a few fully active rows
    # (entries within the workspace) send the call dense, as the penalty prices them.
    tail_inp = case(m=1100, density=0.005, full=8, empty=0, key=9)
    assert int(stats.gate_counts(relu_matmul(tail_inp.x, tail_inp.w_gate), tile=256, capacity=8)[1]) >= 8
    y_tail = run(cheap_blocked, tail_inp, kernel="blocked", kernels=kernels)
    np.testing.assert_array_equal(y_tail, np.asarray(
        xla.ffn(tail_inp.x, tail_inp.w_gate, tail_inp.w_up, tail_inp.w_down), np.float32))
    free_overflow = dataclasses.replace(cheap_blocked, blocked_overflow_penalty=0.0)
    assert (run(free_overflow, tail_inp, kernel="blocked", kernels=kernels) == BLOCKED_MARK).all()
    full_inp = case(m=1100, density=0.005, full=1100, empty=0, key=7)  # every tile overflows
    g = relu_matmul(full_inp.x, full_inp.w_gate)
    assert int(stats.gate_counts(g, tile=256, capacity=8)[2]) > layout.blocked_max_entries(1100, 700, 256, 8)
    assert (run(DenseCrossover(), full_inp, kernel="blocked", side=Side.SPARSE, kernels=kernels) == ROW_MARK).all()


def test_the_pack_runs_only_in_the_sparse_branches(stand_ins):
    kernels = stand_ins(mark=True)
    inp = case(m=1100, key=8)

    def packs_in(eqns):  # nested conditionals included
        n = 0
        for e in eqns:
            n += e.primitive.name in ("pjit", "jit") and e.params.get("name") == "stand_in_pack"
            if e.primitive.name == "cond":
                n += max(packs_in(b.jaxpr.eqns) for b in e.params["branches"])
        return n

    def checks_in(eqns):  # the operands' finite checks (is_finite), nested conditionals included
        n = 0
        for e in eqns:
            n += e.primitive.name == "is_finite"
            if e.primitive.name == "cond":
                n += sum(checks_in(b.jaxpr.eqns) for b in e.params["branches"])
        return n

    for kernel in ("row", "blocked"):
        jaxpr = jax.make_jaxpr(
            lambda x: cuda_ffn(x, inp.w_gate, inp.w_up, inp.w_down, tile=256, capacity=8, kernel=kernel, rule=DenseCrossover(**NO_FIXED), kernels=kernels)
        )(inp.x).jaxpr
        conds = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
        assert packs_in([e for e in jaxpr.eqns if e not in conds]) == 0, kernel  # a dense decision never packs
        assert len(conds) == 1, kernel
        branches = conds[0].params["branches"]
        per_branch = [packs_in(b.jaxpr.eqns) for b in branches]
        # the dense side, then each kernel's (row or blocked chosen with the side)
        assert per_branch == ([0, 1] if kernel == "row" else [0, 1, 1]), (kernel, per_branch)
        # the operands' checks run on the sparse side only: neither before the choice nor on
        # the dense side, each sparse branch holding them and one conditional (its dense
        # products where they fail)
        top = [e for e in jaxpr.eqns if e.primitive.name != "cond"]
        assert checks_in(top) == 0 and checks_in(branches[0].jaxpr.eqns) == 0, kernel
        assert not any(e.primitive.name == "cond" for e in branches[0].jaxpr.eqns), kernel
        for b in branches[1:]:
            assert checks_in(b.jaxpr.eqns) > 0, kernel
            assert sum(e.primitive.name == "cond" for e in b.jaxpr.eqns) == 1, kernel
    # Decode-sized and forced-dense calls are decided at trace time: no pack, no cond.
    jaxpr = jax.make_jaxpr(
        lambda x: cuda_ffn(x, inp.w_gate, inp.w_up, inp.w_down, tile=256, capacity=8, side=Side.DENSE, kernels=kernels)
    )(inp.x).jaxpr
    assert packs_in(jaxpr.eqns) == 0 and not any(e.primitive.name == "cond" for e in jaxpr.eqns)


def test_the_fused_gate_runs_where_the_sparse_side_is_expected(stand_ins):
    """Forced, or with a known fraction the rule sends to the kernels, calls of at least
    FUSED_GATE_MIN_TOKENS tokens take the gate from the fused kernel (no XLA gate matmul,
    no pack, exact counts); a call that then runs dense recomputes the FFN with XLA. The
    per-call rule, small M and shapes the kernel does not take keep XLA's matmul + pack."""
    kernels = stand_ins(mark=False)
    assert plan.FUSED_GATE_MIN_TOKENS == 2048

    def names(fn, x):
        eqns = jax.make_jaxpr(fn)(x).jaxpr.eqns
        found, stack = [], list(eqns)
        while stack:
            e = stack.pop()
            if e.primitive.name in ("pjit", "jit"):
                found.append(e.params.get("name"))
            for v in e.params.values():  # sub-jaxprs: jit bodies, cond branches
                for sub in v if isinstance(v, (tuple, list)) else (v,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        stack.extend(sub.eqns)
        return found

    inp = case(m=2100, f=704, density=0.01, key=10)  # f a multiple of 8: the kernel takes it
    want = xla.ffn(inp.x, inp.w_gate, inp.w_up, inp.w_down)
    forced = lambda x: cuda_ffn(x, inp.w_gate, inp.w_up, inp.w_down, tile=256, capacity=8, side=Side.SPARSE, kernels=kernels)
    known = lambda x: cuda_ffn(x, inp.w_gate, inp.w_up, inp.w_down, tile=256, capacity=8, active_fraction=1e-4, rule=DenseCrossover(**NO_FIXED), kernels=kernels)
    per_call = lambda x: cuda_ffn(x, inp.w_gate, inp.w_up, inp.w_down, tile=256, capacity=8, rule=DenseCrossover(**NO_FIXED), kernels=kernels)
    for fn in (forced, known):
        found = names(fn, inp.x)
        assert "stand_in_gate" in found and "stand_in_pack" not in found
        assert_close(jax.jit(fn)(inp.x), want, fused_tolerance(jnp.bfloat16, 704), "fused gate")
    assert "stand_in_gate" not in names(per_call, inp.x)
    # A known fraction the call's counts contradict: the dense side, XLA's FFN bit for bit.
    dense_inp = case(m=2100, f=704, density=0.3, full=0, empty=0, key=11)
    known_dense = lambda x: cuda_ffn(x, dense_inp.w_gate, dense_inp.w_up, dense_inp.w_down, tile=256, capacity=8, active_fraction=1e-4, rule=DenseCrossover(**NO_FIXED), kernels=kernels)
    assert "stand_in_gate" in names(known_dense, dense_inp.x)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(known_dense)(dense_inp.x), np.float32),
        np.asarray(xla.ffn(dense_inp.x, dense_inp.w_gate, dense_inp.w_up, dense_inp.w_down), np.float32),
    )
    # Below the token bound, or f not a multiple of 8: XLA's matmul + the pack.
    small = case(m=2000, f=704, key=12)
    assert "stand_in_gate" not in names(lambda x: cuda_ffn(x, small.w_gate, small.w_up, small.w_down, tile=256, capacity=8, side=Side.SPARSE, kernels=kernels), small.x)
    odd = case(m=2100, f=700, key=13)
    assert "stand_in_gate" not in names(lambda x: cuda_ffn(x, odd.w_gate, odd.w_up, odd.w_down, tile=256, capacity=8, side=Side.SPARSE, kernels=kernels), odd.x)


def test_gate_twell_takes_the_fused_kernel_from_the_token_bound(monkeypatch):
    """ffn_cuda.gate_twell decides as the FFN paths do: the fused gate from
    FUSED_GATE_MIN_TOKENS tokens (counted over leading dimensions), XLA + the pack below."""
    seen = []
    monkeypatch.setattr(ffn_cuda.binding, "gate_pack", lambda x, w, **k: seen.append("fused") or stand_in_gate(x, w, **k))
    monkeypatch.setattr(ffn_cuda.pack_binding, "pack_twell", lambda a, **k: seen.append("pack") or stand_in_pack(a, **k))
    w = jnp.ones((64, 520), jnp.bfloat16)
    for shape, path in [((2047, 64), "pack"), ((2048, 64), "fused"), ((2, 1024, 64), "fused"), ((2, 1000, 64), "pack")]:
        seen.clear()
        act = ffn_cuda.gate_twell(jnp.ones(shape, jnp.bfloat16), w, tile=256, capacity=32)
        assert seen == [path], shape
        assert act.values.shape == (*shape[:-1], 3, 32)
    seen.clear()
    ffn_cuda.gate_twell(jnp.ones((4096, 64), jnp.bfloat16), jnp.ones((64, 518), jnp.bfloat16), tile=256, capacity=32)
    assert seen == ["pack"]  # f not a multiple of 8


def test_fused_gate_choices():
    assert layout.fused_gate_supported(2048, 5632, 256, 32, jnp.bfloat16)
    assert layout.fused_gate_supported(136, 520, 256, 64, jnp.float16)
    assert not layout.fused_gate_supported(2048, 5632, 256, 32, jnp.float32)
    assert not layout.fused_gate_supported(2048, 5632, 128, 32, jnp.bfloat16)
    assert not layout.fused_gate_supported(2048, 5632, 256, 65, jnp.bfloat16)
    assert not layout.fused_gate_supported(2044, 5632, 256, 32, jnp.bfloat16)
    assert not layout.fused_gate_supported(2048, 5630, 256, 32, jnp.bfloat16)
    assert plan.fused_gate_preferred(plan.FUSED_GATE_MIN_TOKENS, 2048, 5632, 256, 32, jnp.bfloat16)
    assert not plan.fused_gate_preferred(plan.FUSED_GATE_MIN_TOKENS - 1, 2048, 5632, 256, 32, jnp.bfloat16)
    assert layout.fused_gate_variant(2048) == 1 and layout.fused_gate_variant(4096) == 0


def test_blocked_counts_agree_with_the_emulation():
    inp = case(m=1500, full=9, empty=11, key=9)
    g = relu_matmul(inp.x, inp.w_gate)
    act = pack_twell_reference(g, tile=256, capacity=8)
    counts = np.asarray(act.counts)
    assert int(stats.gate_counts(g, tile=256, capacity=8)[2]) == bemu.needed_entries(counts, 8, 256, 700)


def test_default_rule_matches_the_h200_measurements():
    # ffi/notes/twell_ffn.md and twell_ffn_blocked.md: at M=16384, d=2048, f=5632 dense up +
    # down takes 1.10 ms, the row kernel 1.14 ms at 0.5% (461K pairs); after the gate matmul
    # the blocked kernel's path (tensor-core steps, version 4.1) takes ~1.38 ms at 0.5% and
    # ~3.1 ms at 2% (interleaved timing), so dense wins there.
    rule = DenseCrossover()
    m, d, f = 16384, 2048, 5632
    pairs = lambda p: int(p * m * f)
    assert not bool(rule.use_sparse(pairs(0.005), 0, m, d, f, 2))
    assert bool(rule.use_sparse(pairs(0.003), 0, m, d, f, 2))
    assert 1.2e-3 < float(rule.blocked_cost(pairs(0.005), m, d, f, 2)) < 1.5e-3
    assert float(rule.blocked_cost(pairs(0.005), m, d, f, 2)) > rule.dense_cost(m, d, f, 2)
    assert float(rule.blocked_cost(pairs(0.02), m, d, f, 2)) > 2.5 * rule.dense_cost(m, d, f, 2)
    assert not rule.sparse_predicted(m, d, f, 2, 0.005, True, "blocked_mma")
    # (2048, 8192) and (4096, 11008) at 0.5%: the blocked path measured 0.89x and 0.92x of
    # dense overall; the rule must run dense there.
    for d2, f2 in ((2048, 8192), (4096, 11008)):
        assert float(rule.blocked_cost(int(0.005 * m * f2), m, d2, f2, 2)) > rule.margin * rule.dense_cost(m, d2, f2, 2)
    assert not rule.sparse_can_win(64, d, f, 2)  # decode: dense, decided at trace time
    _union_rule_with_union_down(rule)
    _union_rule_with_stationary_down(rule)


def _union_rule_with_union_down(rule):
    """The "blocked_union" price with both steps as union products (the rule's
    ``stationary_down`` off, or f past the stationary step's 7,264)."""
    rule = dataclasses.replace(rule, stationary_down=False)
    m, d, f = 16384, 2048, 5632
    # With both steps as union products, refit at 2b4db29 (inference_union_sweep_2b4db29.json
    # and the acceptance run at b6d0b51): after the gate matmul, with w_up_t, 0.67 ms at 0.5%
    # and 1.61 ms at 2%, (2048, 8192) 1.01 ms and (4096, 11008) 2.47 ms at 0.5%. Forced,
    # the kernels measured 1.07x at 0.84% and 1.02-1.04x at 1%: sparse up to ~0.85%
    # (margin 0.95), dense from ~0.95% on.
    union = lambda p, d2=d, f2=f, m2=m, t=True: float(rule.union_cost(int(p * m2 * f2), m2, d2, f2, 2, None, t))
    assert 0.63e-3 < union(0.005) < 0.71e-3 and 1.55e-3 < union(0.02) < 1.75e-3
    assert 0.9e-3 < union(0.005, 2048, 8192) < 1.06e-3 and 2.35e-3 < union(0.005, 4096, 11008) < 2.6e-3
    for p in (0.0025, 0.005, 0.007, 0.008, 0.0085):
        assert rule.sparse_predicted(m, d, f, 2, p, True, "blocked_union")
    for p in (0.0095, 0.01):
        assert not rule.sparse_predicted(m, d, f, 2, p, True, "blocked_union")
    for d2, f2 in ((2048, 8192), (4096, 11008)):
        assert rule.sparse_predicted(m, d2, f2, 2, 0.005, True, "blocked_union")
    # Smaller M (same sweep): at M=4,096 the kernels measured 1.11-1.17x at 0.5% and 0.97-0.99x
    # at 0.75%; at M=2,048 1.17x at 0.25% and 1.00-1.04x at 0.5% without w_up_t.
    assert rule.sparse_predicted(4096, d, f, 2, 0.005, False, "blocked_union")
    assert not rule.sparse_predicted(4096, d, f, 2, 0.0075, True, "blocked_union")
    assert rule.sparse_predicted(2048, d, f, 2, 0.0025, False, "blocked_union")
    assert not rule.sparse_predicted(2048, d, f, 2, 0.005, False, "blocked_union")
    # The up weight's transpose is priced where the call is not given w_up_t: at (4096, 11008),
    # M=1,024, 0.5% the kernels measured 0.99x without w_up_t and 1.13x with it.
    transpose = union(0.005, 4096, 11008, 1024, False) - union(0.005, 4096, 11008, 1024, True)
    assert transpose == pytest.approx(2 * 4096 * 11008 * 2 / rule.union_transpose_bandwidth, rel=1e-3)
    assert not rule.sparse_predicted(1024, 4096, 11008, 2, 0.005, False, "blocked_union")
    assert rule.sparse_predicted(1024, 4096, 11008, 2, 0.005, True, "blocked_union")
    # The row kernel below row_full_tokens (inference_row_small_m_ebac2a0.json): at (4096,
    # 11008) with w_up_t, 0.25% active, it measured 0.92x at M=128 and 0.97x at M=256 (dense
    # now), 1.14x at M=384 and 1.07x at M=512 (still the row kernel).
    for m2, side in ((128, False), (256, False), (384, True), (512, True)):
        assert rule.sparse_predicted(m2, 4096, 11008, 2, 0.0025, True, "blocked_union") is side, m2
    nnz = 0.0025 * 128 * 11008
    scaled, full = (float(rule.row_cost(nnz, 0, 4096, 11008, 2, True, m2)) for m2 in (128, None))
    assert scaled - rule.fixed_overhead == pytest.approx(4 * (full - rule.fixed_overhead), rel=1e-5)
    assert float(rule.row_cost(nnz, 0, 4096, 11008, 2, True, 4096)) == pytest.approx(full)


def _union_rule_with_stationary_down(rule):
    """The "blocked_union" price where its down step runs with the weight stationary (the
    default where f <= 14,524 and it is priced below the union product), refit at fc4b868
    and with the 8-column walk (inference_stationary_sweep_fc4b868.json,
    inference_stationary8_ab_c8wip.json). Forced, at M=16,384 the kernels measured 1.44x at
    0.5%, 1.13-1.15x at 1%, 1.02-1.04x at 1.27% (margin 0.95: dense); at M=4,096 1.15-1.18x
    at 0.5%, 1.04x / 1.07x at 0.75% without / with w_up_t; at M=2,048 0.97x / 1.04x at 0.5%;
    (1024, 2816) 0.79x at 1%; (2048, 8192) 1.36x (union down 1.32x) and (4096, 11008) 1.45x
    (1.38x) at 0.5%."""
    m, d, f = 16384, 2048, 5632
    assert rule.stationary_runs(m, d, f) and rule.stationary_runs(m, d, 8192) and not rule.stationary_runs(m, d, 16384)
    for shape in ((m, d, f), (m, d, 8192), (m, 4096, 11008)):
        assert rule.down_stationary(*shape, 2) and rule.down_stationary(*shape, 2, 0.005, False)
    union = lambda p, d2=d, f2=f, m2=m, t=True: float(rule.union_cost(int(p * m2 * f2), m2, d2, f2, 2, None, t))
    # after the gate, with w_up_t: measured 0.58 ms at 0.5%, 0.91 ms at 1% (fit within 7%)
    assert 0.55e-3 < union(0.005) < 0.61e-3 and 0.88e-3 < union(0.01) < 0.97e-3
    # (2048, 8192) 0.93 ms, (4096, 11008) 2.23 ms at 0.5% with w_up_t
    assert 0.87e-3 < union(0.005, 2048, 8192) < 0.99e-3 and 2.1e-3 < union(0.005, 4096, 11008) < 2.4e-3
    for p in (0.0025, 0.005, 0.0075, 0.01):
        assert rule.sparse_predicted(m, d, f, 2, p, True, "blocked_union") and rule.sparse_predicted(
            m, d, f, 2, p, False, "blocked_union")
    for p in (0.0125, 0.015):
        assert not rule.sparse_predicted(m, d, f, 2, p, True, "blocked_union")
    assert rule.sparse_predicted(4096, d, f, 2, 0.005, False, "blocked_union")
    assert rule.sparse_predicted(4096, d, f, 2, 0.0075, True, "blocked_union")
    assert not rule.sparse_predicted(4096, d, f, 2, 0.0075, False, "blocked_union")
    assert not rule.sparse_predicted(2048, d, f, 2, 0.005, False, "blocked_union")
    assert not rule.sparse_predicted(m, 1024, 2816, 2, 0.01, True, "blocked_union")
    # the walk's pairs cost per wave of CTAs, one a SM: 16 columns a CTA up to f = 7,264,
    # 8 above (a constant of its own)
    p, u = 0.005, layout.uniform_union(0.005)
    walk = lambda d2, f2: rule._stationary_seconds(p * m * f2, m, d2, f2, 2, u, True) - 0.5 * rule.union_row_bytes(
        m, d2, f2, 2, u) / rule.stationary_up_bandwidth
    assert walk(2048, f) == pytest.approx(walk(1024, f), rel=1e-4)
    assert walk(4096, f) - walk(2048, f) == pytest.approx(p * m * f * rule.stationary_pair_seconds, rel=1e-4)
    assert walk(2048, 8192) - walk(1024, 8192) == pytest.approx(p * m * 8192 * rule.stationary_pair_seconds_8, rel=1e-4)
    # where the union product is priced lower, "blocked_union" keeps it for the down step
    cheap_union = dataclasses.replace(rule, union_row_bandwidth=1e15)
    assert cheap_union.stationary_runs(m, d, f) and not cheap_union.down_stationary(m, d, f, 2)
    assert float(cheap_union.union_cost(p * m * f, m, d, f, 2, u)) == pytest.approx(
        cheap_union._union_model_seconds(p * m * f, m, d, f, 2, u, True))


@pytest.mark.parametrize("f", [700, 704], ids=["f700", "f704"])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("check", [None, 0.02])
def test_decode_sized_calls_take_the_decode_kernel(decode_stand_ins, stand_ins, gated, check, f):
    """With ``decode_kernel_max_tokens`` set, calls of at most that many tokens run the
    decode kernels (here reference stand-ins) with no pack: the gate on our kernel
    (``decode_ffn_gate``) where it takes the shape (f a multiple of 8), the call has at most
    ``decode_fused_gate_max_tokens`` tokens and no device check is asked for, else XLA's
    gate then ``decode_ffn``; past the decode size, or with the device
    check on a dense call, the FFN is still right."""
    kernels = stand_ins(mark=False)
    seen, kernels = decode_stand_ins(kernels)
    rule = DenseCrossover(decode_kernel_max_tokens=64, decode_dense_above=check, decode_fused_gate=True, **NO_FIXED)
    fn = jax.jit(lambda x, wg, wu, wd: cuda_ffn(x, wg, wu, wd, tile=256, capacity=32, rule=rule, kernels=kernels))
    for m, density in ((1, 0.02), (64, 0.02), (64, 0.5)):
        inp = synthetic_ffn_inputs(jax.random.key(m), m, 128, f, density=density)
        w_gate = inp.w_gate if gated else None
        jaxpr = str(jax.make_jaxpr(fn)(inp.x, w_gate, inp.w_up, inp.w_down))
        assert "stand_in_pack" not in jaxpr
        y = fn(inp.x, w_gate, inp.w_up, inp.w_down)
        want = xla.ffn(inp.x, w_gate, inp.w_up, inp.w_down)
        assert_close(y, want, 2 * fused_tolerance(jnp.bfloat16, f), f"m={m} density={density}")
    kernel_gate = check is None and f % 8 == 0  # and at most decode_fused_gate_max_tokens (32) tokens
    assert seen and {m for _, m in seen} <= {1, 64}
    assert {p for p, m in seen if m == 1} == {"kernel gate" if kernel_gate else "xla gate"}
    assert {p for p, m in seen if m == 64} == {"xla gate"}
    inp = case(m=65, key=9)  # past the decode size: the usual path
    seen.clear()
    fn(inp.x, inp.w_gate if gated else None, inp.w_up, inp.w_down)
    assert not seen


def test_decode_ffn_rejects_shapes_it_cannot_take():
    x = jnp.zeros((2, 12), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 8"):
        ffn_binding.decode_ffn(x, jnp.zeros((2, 40), jnp.bfloat16), None, jnp.zeros((40, 12), jnp.bfloat16))
    with pytest.raises(ValueError, match="bf16 or f16"):
        ffn_binding.decode_ffn(x, jnp.zeros((2, 40), jnp.float32), None, jnp.zeros((40, 16), jnp.float32))
    assert not layout.decode_supported(16, 60000, jnp.bfloat16) and layout.decode_supported(16, 50000, jnp.float16)
    with pytest.raises(ValueError, match="at most 64 tokens"):
        ffn_binding.decode_ffn_gate(jnp.zeros((65, 16), jnp.bfloat16), jnp.zeros((16, 40), jnp.bfloat16), None,
                             jnp.zeros((40, 16), jnp.bfloat16))
    assert not layout.decode_gate_supported(4, 24, 64) and not layout.decode_gate_supported(4, 32, 60)
    with pytest.raises(ValueError, match="splits must be in"):
        ffn_binding.decode_ffn_gate(jnp.zeros((2, 128), jnp.bfloat16), jnp.zeros((128, 40), jnp.bfloat16), None,
                             jnp.zeros((40, 128), jnp.bfloat16), splits=3)


def test_decode_rows_rejects_shapes_it_cannot_take():
    x = jnp.zeros((5, 64), jnp.bfloat16)
    w = jnp.zeros((256, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="1 to 4 tokens"):
        ffn_binding.decode_ffn_rows(x, w, w, w_up_t=w)
    with pytest.raises(ValueError, match="w_up_t must be"):
        ffn_binding.decode_ffn_rows(x[:2], w, w, w_up_t=w.T)
    with pytest.raises(ValueError, match="multiple of 8"):
        ffn_binding.decode_ffn_rows(x[:2, :60], w[:, :60], w[:, :60])
    with pytest.raises(ValueError, match="bf16 or f16"):
        ffn_binding.decode_ffn_rows(x[:2].astype(jnp.float32), w.astype(jnp.float32), w.astype(jnp.float32))
    assert layout.decode_rows_supported(4, 8192, 2**20, jnp.float16)
    assert not layout.decode_rows_supported(0, 64, 256, jnp.bfloat16) and not layout.decode_rows_supported(1, 8200, 256, jnp.bfloat16)


def test_decode_gate_splits_fill_the_sms_within_a_cluster():
    # <= 3 CTAs per SM: 44 column blocks of f=5632 -> 8 K ranges (9 capped), 64 of f=8192 -> 6, 86 of f=11008 -> 4.
    assert ffn_binding.decode_gate_splits(1, 2048, 5632, sms=132) == 8
    assert ffn_binding.decode_gate_splits(64, 2048, 5632, sms=132) == 8  # m does not change it
    assert ffn_binding.decode_gate_splits(8, 2048, 8192, sms=132) == 6
    assert ffn_binding.decode_gate_splits(8, 4096, 11008, sms=132) == 4
    assert ffn_binding.decode_gate_splits(4, 128, 512, sms=132) == 2  # capped by d's 64-row stages
    assert ffn_binding.decode_gate_splits(4, 4096, 512, sms=132) == 8  # capped by the portable cluster size
    for m, d, f in [(1, 16, 8), (64, 8192, 50000), (7, 16, 5632)]:
        splits = ffn_binding.decode_gate_splits(m, d, f, sms=132)
        assert 1 <= splits <= min(8, -(-d // 64))


def test_decode_wins_follows_the_measured_bounds():
    rule = DenseCrossover()
    assert rule.decode_wins(1, 0.02) and not rule.decode_wins(1, 0.03)
    assert rule.decode_wins(16, 0.01) and not rule.decode_wins(16, 0.02)
    assert rule.decode_wins(64, 0.003) and not rule.decode_wins(64, 0.005)
    assert rule.decode_wins(2, 0.01) and not rule.decode_wins(2, 0.02)  # M=2 takes M=16's bound
    assert not rule.decode_wins(65, 0.0) and not rule.decode_wins(0, 0.0)
    with pytest.raises(ValueError, match="active_fraction"):
        rule.decode_wins(1, 2.0)


@pytest.mark.parametrize("gated", [True, False])
def test_known_active_fraction_picks_decode_at_trace_time(decode_stand_ins, stand_ins, gated):
    """With the layer's active fraction known, decode-sized calls take the decode kernels
    where they win, with no device check and no pack, under the default rule (decode off);
    elsewhere the usual paths; gated calls need w_up_t."""
    kernels = stand_ins(mark=False)
    seen, kernels = decode_stand_ins(kernels)
    assert DenseCrossover().decode_kernel_max_tokens == 0  # the default: decode off without knowledge
    for m, fraction, with_t, want in [
        (1, 0.005, True, "kernel gate"),
        (16, 0.01, True, "kernel gate"),
        (64, 0.003, True, "xla gate"),  # above decode_fused_gate_max_tokens
        (64, 0.02, True, None),  # past the M=64 bound: dense
        (1, 0.005, False, "kernel gate" if not gated else None),  # gated needs w_up_t
        (65, 0.0, True, None),
    ]:
        inp = synthetic_ffn_inputs(jax.random.key(m), m, 128, 704, density=0.02)
        w_gate = inp.w_gate if gated else None
        w_up_t = inp.w_up.T if (with_t and gated) else None
        fn = jax.jit(lambda x, wg, wu, wd, wut: cuda_ffn(x, wg, wu, wd, tile=256, capacity=32, w_up_t=wut, active_fraction=fraction, kernels=kernels))
        seen.clear()
        jaxpr = str(jax.make_jaxpr(fn)(inp.x, w_gate, inp.w_up, inp.w_down, w_up_t))
        if want is not None:
            assert seen == [(want, m)] and "cond" not in jaxpr and "stand_in_pack" not in jaxpr, (m, fraction)
        else:
            assert not seen, (m, fraction, with_t)
            if m <= 64:  # decode-sized and known: dense at trace time, no device check, no row kernel
                assert "cond" not in jaxpr and "stand_in_pack" not in jaxpr, (m, fraction, with_t)
        y = fn(inp.x, w_gate, inp.w_up, inp.w_down, w_up_t)
        assert_close(y, xla.ffn(inp.x, w_gate, inp.w_up, inp.w_down), 2 * fused_tolerance(jnp.bfloat16, 704), f"m={m}")


@pytest.mark.parametrize("side", list(Side), ids=lambda s: s.value)
def test_no_tokens_give_an_empty_output(stand_ins, side):
    """M = 0 returns [0, d] on any side, with nothing traced to count or pack."""
    kernels = stand_ins(mark=True)
    inp = case(m=4, key=2)
    x = jnp.zeros((0, inp.x.shape[1]), inp.x.dtype)
    y = cuda_ffn(x, inp.w_gate, inp.w_up, inp.w_down, tile=256, capacity=32, side=side, kernels=kernels)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert stats.sampled_gate_counts(jnp.zeros((0, 700), jnp.bfloat16), tile=256, capacity=32, rows=8)[0] == 0


def test_known_fraction_past_the_decode_bound_runs_dense_at_decode_sizes(decode_stand_ins, stand_ins):
    """Decode-sized, the fraction known and above the decode kernels' bound: XLA's dense
    FFN at trace time, even where the rule's row-kernel costs (here without fixed costs)
    would send the call through the per-call check to the row kernel."""
    kernels = stand_ins(mark=False)
    seen, kernels = decode_stand_ins(kernels)
    rule = DenseCrossover(**NO_FIXED)
    inp = synthetic_ffn_inputs(jax.random.key(4), 4, 128, 704, density=0.02)
    fn = lambda p: jax.jit(lambda x, wg, wu, wd, wut: cuda_ffn(x, wg, wu, wd, tile=256, capacity=32, w_up_t=wut, active_fraction=p, rule=rule, kernels=kernels))
    jaxpr = str(jax.make_jaxpr(fn(0.02))(inp.x, inp.w_gate, inp.w_up, inp.w_down, inp.w_up.T))
    assert not seen and "cond" not in jaxpr and "stand_in_pack" not in jaxpr
    big = case(m=65, key=9)  # past decode sizes, at a fraction the rule calls sparse: the per-call check
    assert "cond" in str(jax.make_jaxpr(fn(0.005))(*big, big.w_up.T))


@pytest.mark.parametrize("gated", [True, False])
def test_activation_weight_by_neuron_picks_the_rows_kernel(decode_stand_ins, stand_ins, gated):
    """With the activation's weight also given as [f, d] (``w_act_t``), calls of at most
    ``decode_rows_max_tokens`` tokens that take the decode kernels run decode_ffn_rows;
    more tokens, no w_act_t, gated without w_up_t, or a fraction past the bound do not."""
    kernels = stand_ins(mark=False)
    seen, kernels = decode_stand_ins(kernels)
    for m, fraction, with_t, with_act, rule, want in [
        (1, 0.005, True, True, None, "rows"),
        (2, 0.005, True, True, None, "kernel gate"),  # past decode_rows_max_tokens (1)
        (2, 0.005, True, True, DenseCrossover(decode_rows_max_tokens=4), "rows"),
        (1, 0.005, True, False, None, "kernel gate"),
        (1, 0.005, False, True, None, None if gated else "rows"),  # gated needs w_up_t
        (1, 0.05, True, True, None, None),  # past the M=1 bound: dense
    ]:
        inp = synthetic_ffn_inputs(jax.random.key(m), m, 128, 704, density=0.02)
        w_gate = inp.w_gate if gated else None
        w_up_t = inp.w_up.T if (with_t and gated) else None
        w_act_t = (inp.w_gate if gated else inp.w_up).T if with_act else None
        fn = jax.jit(lambda x, wg, wu, wd, wut, wat: cuda_ffn(x, wg, wu, wd, tile=256, capacity=32, w_up_t=wut, active_fraction=fraction, w_act_t=wat, rule=rule, kernels=kernels))
        seen.clear()
        jaxpr = str(jax.make_jaxpr(fn)(inp.x, w_gate, inp.w_up, inp.w_down, w_up_t, w_act_t))
        if want is not None:
            assert seen == [(want, m)] and "cond" not in jaxpr, (m, fraction, with_t, with_act)
        else:
            assert not seen, (m, fraction, with_t, with_act)
        y = fn(inp.x, w_gate, inp.w_up, inp.w_down, w_up_t, w_act_t)
        assert_close(y, xla.ffn(inp.x, w_gate, inp.w_up, inp.w_down), 2 * fused_tolerance(jnp.bfloat16, 704), f"m={m}")


@pytest.mark.parametrize("kernel", FUSED_KERNELS)
@pytest.mark.parametrize("gated", [True, False])
def test_known_active_fraction_past_decode_sizes(stand_ins, kernel, gated):
    """Past decode sizes a known fraction where the rule predicts dense gives the dense FFN
    itself (the same jaxpr as xla.ffn_unmerged, the plan's dense side: no counts, no pack,
    no device branch); where it predicts sparse, the per-call device choice still runs on
    the true counts."""
    kernels = stand_ins(mark=False)
    rule = DenseCrossover(**NO_FIXED)
    inp = case(m=1100, key=5)
    w_gate = inp.w_gate if gated else None
    assert rule.sparse_predicted(1100, 128, 700, 2, 0.0, kernel=kernel)
    assert not rule.sparse_predicted(1100, 128, 700, 2, 1.0, kernel=kernel)
    with pytest.raises(ValueError, match="active_fraction"):
        rule.sparse_predicted(1100, 128, 700, 2, -0.1)
    dense_jaxpr = str(jax.make_jaxpr(xla.ffn_unmerged)(inp.x, w_gate, inp.w_up, inp.w_down))
    for fraction, dense in [(1.0, True), (0.0, False)]:
        fn = lambda x, wg, wu, wd: cuda_ffn(x, wg, wu, wd, tile=256, capacity=8, kernel=kernel, active_fraction=fraction, rule=rule, kernels=kernels)
        jaxpr = str(jax.make_jaxpr(fn)(inp.x, w_gate, inp.w_up, inp.w_down))
        assert (jaxpr == dense_jaxpr) == dense, fraction
        if not dense:
            assert "cond" in jaxpr or "switch" in jaxpr
        y = jax.jit(fn)(inp.x, w_gate, inp.w_up, inp.w_down)
        assert_close(y, xla.ffn(inp.x, w_gate, inp.w_up, inp.w_down), 2 * fused_tolerance(jnp.bfloat16, 700), f"{fraction}")


def test_per_call_sample_rows():
    """An eighth of the tokens, at least count_sample_min_rows, never past count_sample_rows
    (the cap a user sets wins over the floor)."""
    rule = DenseCrossover()
    assert [rule.sample_rows(m) for m in (256, 2048, 4096, 8192, 65536)] == [256, 256, 512, 1024, 1024]
    assert DenseCrossover(count_sample_rows=64).sample_rows(4096) == 64


@pytest.mark.parametrize("pattern", ["uniform", "heavy"])
def test_sampled_gate_counts(pattern):
    """The per-call choice's estimate: exact below twice the sample size, else within a few
    percent of the true counts on 2% uniform and heavy-tailed activations."""
    inp = synthetic_ffn_inputs(jax.random.key(11), 4500, 128, 704, density=0.02, pattern=pattern)
    g = relu_matmul(inp.x, inp.w_gate)
    nnz, n_over, _ = stats.gate_counts(g, tile=256, capacity=8)
    exact = stats.sampled_gate_counts(g, tile=256, capacity=8, rows=4000)
    assert float(exact[0]) == int(nnz) and float(exact[1]) == int(n_over)
    est_nnz, est_over = jax.jit(lambda g: stats.sampled_gate_counts(g, tile=256, capacity=8, rows=1000))(g)
    assert abs(float(est_nnz) / int(nnz) - 1) < 0.1, (float(est_nnz), int(nnz))
    assert est_nnz.dtype == jnp.float32 and est_over.dtype == jnp.float32
    with pytest.raises(ValueError, match="rows"):
        stats.sampled_gate_counts(g, tile=256, capacity=8, rows=0)


@pytest.fixture
def cuda_ops_as_stand_ins(monkeypatch):
    """The public ops' "cuda" implementations with the kernels replaced by XLA and the
    reference; returns the list of token shapes each stand-in was traced with."""

    seen = []

    def ffn(x, wg, wu, wd, **kwargs):
        seen.append(x.shape)
        return xla.ffn(x, wg, wu, wd)

    def gate(x, w, *, tile, capacity):
        seen.append(x.shape)
        return pack_twell_reference(relu_matmul(x, w), tile=tile, capacity=capacity)

    def twell(x, act, w_act, w_up, w_down):
        seen.append(x.shape)
        return ffn_reference.twell_ffn(x, act, w_act, w_up, w_down)

    monkeypatch.setattr(ffn_cuda, "sparse_ffn", ffn)
    monkeypatch.setattr(ffn_cuda, "gate_twell", gate)
    monkeypatch.setattr(ffn_cuda, "twell_ffn", twell)
    monkeypatch.setattr(common._kernels, "kernels_available", lambda: True)
    return seen


def test_vmap_over_tokens_runs_the_cuda_ops_once_on_the_whole_batch(cuda_ops_as_stand_ins):
    """vmap with only the tokens batched: sparse_ffn runs once with the batch folded into
    the tokens (a (3 x 40, d) call), gate_twell and twell_ffn (x and its TwELL batched)
    once with the batch as one more leading dimension; the results are the per-element
    ones. A batched weight, or x batched without its TwELL, maps per element instead."""
    import jax_twell as jt

    seen = cuda_ops_as_stand_ins
    inp = synthetic_ffn_inputs(jax.random.key(3), 40, 64, 256, density=0.05, dtype=jnp.float32)
    xb = jnp.stack([inp.x, 2 * inp.x, -inp.x])
    ffn = lambda x, w_up=inp.w_up: jt.sparse_ffn(x, inp.w_gate, w_up, inp.w_down, implementation="cuda")
    got = jax.jit(jax.vmap(ffn))(xb)
    assert (120, 64) in seen
    for i in range(3):
        np.testing.assert_allclose(got[i], xla.ffn(xb[i], inp.w_gate, inp.w_up, inp.w_down), rtol=1e-5, atol=1e-5)
    nested = jax.vmap(jax.vmap(ffn))(xb.reshape(3, 1, 40, 64))
    np.testing.assert_allclose(nested.reshape(got.shape), got, rtol=1e-6, atol=1e-6)

    seen.clear()
    w_ups = jnp.stack([inp.w_up, 0.5 * inp.w_up, inp.w_up[:, ::-1]])
    got_w = jax.vmap(ffn)(xb, w_ups)
    assert (120, 64) not in seen
    for i in range(3):
        np.testing.assert_allclose(got_w[i], xla.ffn(xb[i], inp.w_gate, w_ups[i], inp.w_down), rtol=1e-5, atol=1e-5)

    seen.clear()
    tw = jax.vmap(lambda x: jt.gate_twell(x, inp.w_gate, tile=64, capacity=8, implementation="cuda"))(xb)
    assert (3, 40, 64) in seen
    for i in range(3):
        want = pack_twell_reference(relu_matmul(xb[i], inp.w_gate), tile=64, capacity=8)
        for name in ("values", "cols", "counts"):
            np.testing.assert_array_equal(getattr(tw, name)[i], getattr(want, name))

    seen.clear()
    act = jax.vmap(lambda x: pack_twell_reference(relu_matmul(x, inp.w_gate), tile=64, capacity=8))(xb)
    twell = lambda x, a: jt.twell_ffn(x, a, inp.w_gate, inp.w_up, inp.w_down, implementation="cuda")
    y = jax.vmap(twell)(xb, act)
    assert (3, 40, 64) in seen
    seen.clear()
    y_single_act = jax.vmap(twell, in_axes=(0, None))(xb, jax.tree.map(lambda a: a[0], act))
    assert (3, 40, 64) not in seen
    for i in range(3):
        act_i = jax.tree.map(lambda a: a[i], act)
        want = ffn_reference.twell_ffn(xb[i], act_i, inp.w_gate, inp.w_up, inp.w_down)
        np.testing.assert_allclose(y[i], want, rtol=1e-6, atol=1e-6)
        want0 = ffn_reference.twell_ffn(xb[i], jax.tree.map(lambda a: a[0], act), inp.w_gate, inp.w_up, inp.w_down)
        np.testing.assert_allclose(y_single_act[i], want0, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(len(jax.devices("cpu")) < 4, reason="needs 4 host devices")
@pytest.mark.parametrize("layout", ["data", "tensor"])
def test_cuda_ffn_under_a_mesh_with_stand_ins(cuda_ops_as_stand_ins, layout):
    """The "cuda" inference op (its vmap folding and dense-formula VJP included) runs per
    shard under jit with a mesh, data or tensor parallel, and (tensor parallel, tokens
    replicated) under vmap of that; results and gradients equal XLA's FFN's."""
    import jax_twell as jt
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices("cpu")[:4])
    sharding = jt.FFNSharding(token_axes=("x",), mesh=mesh) if layout == "data" else jt.FFNSharding(tensor_axis="x", mesh=mesh)
    inp = synthetic_ffn_inputs(jax.random.key(4), 64, 32, 512, density=0.05, dtype=jnp.float32)
    want = xla.ffn(inp.x, inp.w_gate, inp.w_up, inp.w_down)
    col, row = NamedSharding(mesh, P(None, sharding.tensor_axis)), NamedSharding(mesh, P(sharding.tensor_axis, None))
    x = jax.device_put(inp.x, NamedSharding(mesh, P(sharding.token_axes or None, None)))
    ws = (jax.device_put(inp.w_gate, col), jax.device_put(inp.w_up, col), jax.device_put(inp.w_down, row))
    fn = jax.jit(lambda x, *w: jt.sparse_ffn(x, *w, implementation="cuda", sharding=sharding))
    np.testing.assert_allclose(fn(x, *ws), want, rtol=1e-5, atol=1e-5)
    grads = jax.jit(jax.grad(lambda x, *w: jnp.sum(fn(x, *w) ** 2), argnums=(0, 2)))(x, *ws)
    grads_want = jax.grad(lambda x, w: jnp.sum(xla.ffn(x, inp.w_gate, w, inp.w_down) ** 2), argnums=(0, 1))(inp.x, inp.w_up)
    for a, b in zip(grads, grads_want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    if layout == "data":  # vmap over a call whose tokens are sharded needs a sharded batch; not this test's point
        return
    xb = jnp.stack([inp.x, -inp.x])
    got = jax.vmap(lambda x: jt.sparse_ffn(x, *ws, implementation="cuda", sharding=sharding))(xb)
    np.testing.assert_allclose(got[1], xla.ffn(-inp.x, inp.w_gate, inp.w_up, inp.w_down), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gated", [True, False])
def test_grad_through_the_cuda_ffn_is_the_dense_formulas(monkeypatch, gated):
    """The "cuda" inference op has no JAX derivative of its own (its stand-in here is a host
    callback, which has none either): grad, and vmap of grad, give jax.grad of XLA's dense
    FFN; the transposed weight copies get zero cotangents."""
    import jax_twell as jt

    def opaque(x, wg, wu, wd, **kwargs):
        out = jax.ShapeDtypeStruct(x.shape, x.dtype)
        host = lambda *a: np.asarray(xla.ffn(*[None if v is None else jnp.asarray(v) for v in a]))
        return jax.pure_callback(lambda x, wg, wu, wd: host(x, wg, wu, wd), out, x, wg, wu, wd) if wg is not None else \
            jax.pure_callback(lambda x, wu, wd: host(x, None, wu, wd), out, x, wu, wd)

    monkeypatch.setattr(ffn_cuda, "sparse_ffn", opaque)
    monkeypatch.setattr(common._kernels, "kernels_available", lambda: True)
    inp = synthetic_ffn_inputs(jax.random.key(5), 24, 32, 128, density=0.1, dtype=jnp.float32)
    w_gate = inp.w_gate if gated else None
    ct = jax.random.normal(jax.random.key(6), inp.x.shape, jnp.float32)

    def loss(impl, x, w_up, w_up_t=None):
        y = sparse_ffn_for_layer(x, w_gate, w_up, inp.w_down, implementation=impl, w_up_t=w_up_t)
        return jnp.sum(y * ct)

    want = jax.grad(lambda x, w: loss("xla", x, w), argnums=(0, 1))(inp.x, inp.w_up)
    got = jax.jit(jax.grad(lambda x, w: loss("cuda", x, w), argnums=(0, 1)))(inp.x, inp.w_up)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    if gated:
        g_t = jax.grad(lambda t: loss("cuda", inp.x, inp.w_up, t))(inp.w_up.T)
        assert not np.asarray(g_t).any()
    xb = jnp.stack([inp.x, 0.5 * inp.x])
    per = jax.vmap(jax.grad(lambda x: loss("cuda", x, inp.w_up)))(xb)
    np.testing.assert_allclose(per[1], jax.grad(lambda x: loss("xla", x, inp.w_up))(xb[1]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pattern", ["uniform", "skewed"])
def test_sampled_block_union(pattern):
    """The per-call union estimate for "blocked_union": exact (every block) below twice the
    sample size, close to it from a sample, and below the uniform formula's value on the
    skewed pattern, whose union cost it then lowers."""
    m, f = 4480, 704
    inp = synthetic_ffn_inputs(jax.random.key(12), m, 128, f, density=0.01, pattern=pattern)
    g = relu_matmul(inp.x, inp.w_gate)
    mask = np.asarray(g) > 0
    exact = mask[: m // 64 * 64].reshape(m // 64, 64, f).any(axis=1).mean()
    assert float(stats.sampled_block_union(g, rows=4000)) == pytest.approx(exact, rel=1e-6)
    est = float(jax.jit(lambda g: stats.sampled_block_union(g, rows=1024))(g))
    assert abs(est / exact - 1) < 0.1, (est, exact)
    p = mask.mean()
    uniform = 1 - (1 - p) ** 64
    rule = DenseCrossover()
    nnz = int(mask.sum())
    measured, formula = (float(rule.union_cost(nnz, m, 128, f, 2, u)) for u in (est, None))
    if pattern == "uniform":
        assert exact == pytest.approx(uniform, rel=0.05) and measured == pytest.approx(formula, rel=0.05)
    else:
        assert exact < 0.8 * uniform and measured < formula
    # Under one block: the union of the rows themselves; nothing: 0.
    assert float(stats.sampled_block_union(g[:10], rows=64)) == pytest.approx(mask[:10].any(axis=0).mean())
    assert float(stats.sampled_block_union(g[:0], rows=64)) == 0.0
    with pytest.raises(ValueError, match="positive"):
        stats.sampled_block_union(g, rows=0)


def test_block_union_fraction_and_known_union():
    """block_union_fraction is the exact mean union over full 64-token blocks (the rows
    themselves under one block); a layer's known union_fraction prices the union kernels
    at trace time: at 1% active the uniform formula's union (47% of f) runs the benchmark
    shape dense, while a skewed layer's smaller union (30% here; the skewed pattern's is
    ~17% at 0.5% against the uniform ~27%, inference_quick_f40be9b_command_buffers.json)
    prices the union kernels below dense (the rule's constants as refit at 6dbecd9); with
    the down step stationary (refit at fc4b868) the same holds at 1.5% (uniform union 62%)."""
    m, f = 200, 384
    inp = synthetic_ffn_inputs(jax.random.key(5), m, 64, f, density=0.02, pattern="skewed")
    g = relu_matmul(inp.x, inp.w_gate)
    mask = np.asarray(g) > 0
    want = mask[:192].reshape(3, 64, f).any(axis=1).mean()
    assert float(stats.block_union_fraction(g)) == pytest.approx(want, rel=1e-6)
    assert float(jax.jit(stats.block_union_fraction)(g)) == pytest.approx(want, rel=1e-6)
    assert float(stats.block_union_fraction(g[:10])) == pytest.approx(mask[:10].any(axis=0).mean(), rel=1e-6)
    assert float(stats.block_union_fraction(g[:0])) == 0.0
    rule = DenseCrossover()
    shape = (16384, 2048, 5632, 2, 0.015, True, "blocked_union")
    assert not rule.sparse_predicted(*shape)
    assert rule.sparse_predicted(*shape, 0.3)
    assert not rule.sparse_predicted(*shape[:-1], "blocked_mma", 0.3)  # only the union kernels read unions
    with pytest.raises(ValueError, match="union_fraction"):
        rule.sparse_predicted(*shape, 1.5)
    x, wg, wu, wd = inp
    with pytest.raises(ValueError, match="union_fraction"):
        LayerInfo(union_fraction=-0.1)
    np.testing.assert_array_equal(  # other implementations ignore it
        sparse_ffn_for_layer(x, wg, wu, wd, implementation="xla", layer=LayerInfo(union_fraction=0.2)),
        jt.sparse_ffn(x, wg, wu, wd, implementation="xla"),
    )


def _count_conds(jaxpr) -> int:
    """``cond`` equations in a jaxpr, nested ones (branches, jit bodies) included."""
    n = 0
    for e in jaxpr.eqns:
        n += e.primitive.name == "cond"
        for v in e.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    n += _count_conds(inner)
                elif hasattr(sub, "eqns"):
                    n += _count_conds(sub)
    return n


@pytest.mark.parametrize("kernel", ["blocked", "blocked_mma", "blocked_union"])
def test_device_branches_of_the_blocked_paths(stand_ins, kernel):
    """Each device branch is a conditional node in XLA's command buffer (~10 us per call on
    the H200), so the blocked paths keep as few as their choices need: forced, none (the
    entry budget is the handler's own fallback); a known active fraction, one (dense or
    sparse on the call's counts; row or blocked at trace time) of two branches; no
    fraction, one of three (dense, row or blocked, decided together on the device). Each
    sparse branch holds one more, the operands' finite checks' (so that the dense side
    reads no operand for them). All three compute the FFN."""
    kernels = stand_ins(mark=False)
    inp = case(m=1100, key=9)
    want = xla.ffn(inp.x, inp.w_gate, inp.w_up, inp.w_down)
    rule = DenseCrossover(**NO_FIXED)
    for side, fraction, conds, branches in [(Side.SPARSE, None, 0, 0), (Side.AUTO, 0.0, 1 + 1, 2),
                                            (Side.AUTO, None, 1 + 2, 3)]:
        fn = lambda x: cuda_ffn(x, inp.w_gate, inp.w_up, inp.w_down, tile=256, capacity=8, kernel=kernel,
                                active_fraction=fraction, rule=rule, side=side, kernels=kernels)
        jaxpr = jax.make_jaxpr(fn)(inp.x).jaxpr
        assert _count_conds(jaxpr) == conds, (side, fraction)
        top = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
        assert sum(len(e.params["branches"]) for e in top) == branches, (side, fraction)
        assert_close(jax.jit(fn)(inp.x), want, 2 * fused_tolerance(jnp.bfloat16, 700), f"{fraction}")
    # The static choice between the row and blocked kernels agrees with the costs it compares.
    rule = DenseCrossover()
    for m, fraction in [(256, 0.0001), (16384, 0.005), (2048, 0.02)]:
        nnz = fraction * m * 5632
        row = float(rule.row_cost(nnz, 0, 2048, 5632, 2, False))
        blocked = float(rule.union_cost(nnz, m, 2048, 5632, 2, None, False) if kernel == "blocked_union"
                        else rule.blocked_cost(nnz, m, 2048, 5632, 2))
        assert rule.blocked_preferred(m, 2048, 5632, 2, fraction, False, kernel) == (blocked < row), (m, fraction)
    assert not rule.blocked_preferred(255, 2048, 5632, 2, 0.005, False, kernel)  # below BLOCKED_MIN_TOKENS
    with pytest.raises(ValueError, match="active_fraction"):
        rule.blocked_preferred(4096, 2048, 5632, 2, 1.5)


@pytest.mark.parametrize("kernel", FUSED_KERNELS)
def test_non_finite_operands_run_dense_and_a_kept_weight_check_is_used(stand_ins, kernel):
    """A NaN or Inf in x or the weights gives the dense formula's NaN: a forced side marks
    y's rows and columns, a device choice takes the dense side; a caller's
    ``weights_finite`` replaces the weights' check, not x's."""
    kernels = stand_ins(mark=True)
    inp = case(m=1100, density=0.005, full=0, empty=0, key=5)
    options = plan.FFNOptions(tile=256, capacity=8, kernel=kernel, rule=DenseCrossover(**NO_FIXED))
    sparse_ran = lambda y: np.isin(y, [ROW_MARK, BLOCKED_MARK, WARP_MARK]).mean() > 0.5  # dense y hits a mark rarely

    def call(x, w_down, **kw):
        fn = lambda x, wd: ffn_cuda.sparse_ffn(x, inp.w_gate, inp.w_up, wd, layer=LayerInfo(side=Side.SPARSE),
                                               options=options, kernels=kernels, **kw)
        return np.asarray(jax.jit(fn)(x, w_down), np.float32)

    assert sparse_ran(call(inp.x, inp.w_down)), "finite operands: the sparse side"
    bad_w = inp.w_down.at[0, 3].set(jnp.inf)
    assert not np.isfinite(call(inp.x, bad_w)[:, 3]).any(), "Inf in w_down: column 3 not finite, as dense"
    kept = jnp.ones(inp.x.shape[1], bool)
    assert np.isfinite(call(inp.x, bad_w, weights_finite=kept)[:, 3]).all(), "the kept check replaces the call's"
    bad_x = inp.x.at[4, 0].set(jnp.nan)
    y = call(bad_x, inp.w_down, weights_finite=kept)
    assert np.isnan(y[4]).all() and np.isfinite(np.delete(y, 4, axis=0)).all(), "x is checked in every call"


@pytest.mark.parametrize("kernel", ["row", "blocked"])
def test_per_call_twell_path_checks_its_operands_on_its_sparse_side(stand_ins, kernel):
    """The TwELL path with its side chosen per call: finite operands run the sparse kernels;
    a NaN or Inf in x or a weight runs the dense products inside the sparse side (no kernel
    mark), so y has the dense formula's values and NaN; a caller's ``weights_finite``
    replaces the weights' check, not x's."""
    kernels = stand_ins(mark=True)
    inp = case(m=1100, density=0.005, full=0, empty=0, key=6)
    rule = DenseCrossover(pair_bandwidth=1e30, **NO_FIXED)  # the sparse side wins wherever it may run
    options = plan.FFNOptions(tile=256, capacity=8, kernel=kernel, rule=rule)
    marked = lambda y: np.isin(y, [ROW_MARK, BLOCKED_MARK, WARP_MARK]).mean() > 0.5  # dense y hits a mark rarely

    def call(x, w_down, **kw):
        fn = lambda x, wd: ffn_cuda.sparse_ffn(x, inp.w_gate, inp.w_up, wd, options=options, kernels=kernels, **kw)
        text = jax.jit(fn).lower(x, w_down).as_text()
        assert "stablehlo.case" in text or "stablehlo.if" in text, "the side is chosen on the device"
        return np.asarray(jax.jit(fn)(x, w_down), np.float32)

    def dense(x, w_down):
        return np.asarray(xla.ffn(x, inp.w_gate, inp.w_up, w_down), np.float32)

    assert marked(call(inp.x, inp.w_down)), "finite operands: the sparse kernels"
    for x, w_down, what in ((inp.x.at[4, 0].set(jnp.nan), inp.w_down, "NaN in x"),
                            (inp.x.at[7, 2].set(-jnp.inf), inp.w_down, "-Inf in x"),
                            (inp.x, inp.w_down.at[0, 3].set(jnp.inf), "Inf in w_down")):
        y, want = call(x, w_down), dense(x, w_down)
        assert not marked(y) and (~np.isfinite(want)).any(), what
        np.testing.assert_array_equal(y, want, err_msg=what)  # the dense products, bit for bit
    kept = jnp.ones(inp.x.shape[1], bool)
    assert marked(call(inp.x, inp.w_down.at[0, 3].set(jnp.inf), weights_finite=kept)), "the kept check replaces the call's"
    y = call(inp.x.at[4, 0].set(jnp.nan), inp.w_down, weights_finite=kept)
    assert not marked(y) and np.isnan(y[4]).all(), "x is checked in every call"


def test_the_module_keeps_its_weights_check_with_the_decode_layout():
    from flax import nnx

    from jax_twell.modules import SparseFFN

    ffn = SparseFFN(64, 256, rngs=nnx.Rngs(0))
    ffn.cache_transposed_up_weight(jnp.float32)
    assert np.asarray(ffn.weights_finite[...]).all()
    ffn.w_down[...] = ffn.w_down[...].at[0, 5].set(jnp.nan)
    ffn.cache_transposed_up_weight(jnp.float32)
    np.testing.assert_array_equal(np.asarray(ffn.weights_finite[...]), np.arange(64) != 5)
    y = ffn.infer(jnp.ones((3, 64), jnp.float32))
    assert np.isnan(np.asarray(y)[:, 5]).all()
    ffn.clear_inference_cache()
    assert ffn.weights_finite is None


# The device backups' stand-ins: the mma.sync kernel's contract and the wgmma kernel's, the
# per-call choice a lax.cond; and the wgmma kernel's with the rule's floor of the form with
# no conditional set, where the choice is the backup's device flag.
# With the dense side's kernel (warp.dense_ffn_if's contract), no conditional either.
# name: (kernel, conditionals in the per-call form, rule fields, FFNKernels.warp_dense)
DEVICE_BACKUPS = {"cond": (warp.backup_rows_reference, 1, {}, None),
                  "gemm_cond": (warp.backup_rows_gemm_reference, 1, {}, None),
                  "flag": (warp.backup_rows_gemm_reference, 0, {"per_call_min_tokens_no_conditional": 0}, None),
                  "dense_if": (warp.backup_rows_reference, 0, {}, warp.dense_ffn_if_reference)}


@pytest.mark.parametrize("from_g", [False, True], ids=["pack", "from_g"])
@pytest.mark.parametrize("backup", sorted(DEVICE_BACKUPS))
@pytest.mark.parametrize("gated", [True, False])
def test_warp_path_with_the_device_backup(stand_ins, gated, backup, from_g):
    """With a backup that reads its row count on the device (``FFNKernels.warp_backup``,
    here its reference contract): a known or forced layer's warp path holds no conditional
    at all, the per-call form only the sample's choice (none where the backup takes it as
    a device flag); every side computes the dense formula, with rows past the switch's
    largest size and with non-finite operands. With ``warp_rows_g`` (the rows listed from
    g in the kernel; the bindings keep the pack, measured faster) the known layer and the per-call form's sparse
    side run no pack; the forms with no conditional keep it (their kernels' skip flag)."""
    kernel, per_call_conds, fields, dense = DEVICE_BACKUPS[backup]
    kernels = dataclasses.replace(stand_ins(mark=False), warp_backup=kernel, warp_dense=dense,
                                  warp_rows_g=warp.ffn_rows_from_g_reference if from_g else None)
    inp = case(m=1100, f=704, density=0.005, full=200, empty=5, key=14)  # 200 rows: past the switch's M/8
    w_gate = inp.w_gate if gated else None
    rule = DenseCrossover(**NO_FIXED, **fields)

    def call(side=Side.AUTO, active_fraction=None):
        return lambda x, wd: cuda_ffn(x, w_gate, inp.w_up, wd, tile=256, capacity=8, kernel="warp", rule=rule, side=side,
                                      active_fraction=active_fraction, kernels=kernels)

    def conditionals(fn):
        text = str(jax.make_jaxpr(fn)(inp.x, inp.w_down))
        return text.count(" cond[")

    for fn, n_cond, per_call in ((call(Side.SPARSE), 0, False), (call(active_fraction=0.005), 0, False),
                                 (call(), per_call_conds, True)):
        text = str(jax.make_jaxpr(fn)(inp.x, inp.w_down))
        assert "stand_in_gate" not in text  # below the fused gate's bound
        # the pack runs unless the rows are listed from g (the per-call forms with no
        # conditional keep it: their kernels take the dense side's skip flag)
        assert ("stand_in_pack" in text) == (not from_g or (per_call and per_call_conds == 0))
        assert conditionals(fn) == n_cond
        for x, w_down in ((inp.x, inp.w_down), (inp.x.at[3, 1].set(jnp.nan), inp.w_down),
                          (inp.x, inp.w_down.at[2, 5].set(jnp.inf))):
            y = np.asarray(jax.jit(fn)(x, w_down), np.float32)
            want = np.asarray(xla.ffn(x, w_gate, inp.w_up, w_down), np.float32)
            assert np.array_equal(np.isnan(y), np.isnan(want))
            ok = np.isfinite(want)
            assert_close(np.where(ok, y, 0), np.where(ok, want, 0), fused_tolerance(jnp.bfloat16, 704), "device backup")


def test_known_layer_past_the_fused_gate_bound_with_the_device_backup(stand_ins):
    """A known layer past the fused gate's token bound, with the device backup: XLA's gate
    and the pack (the fused gate would make the backup recompute its rows' gate, slower on
    heavy tails), no conditional; exact with rows past the switch's largest size."""
    kernels = dataclasses.replace(stand_ins(mark=False), warp_backup=warp.backup_rows_reference)
    inp = case(m=2100, f=704, density=0.005, full=300, empty=5, key=15)
    fn = lambda x: cuda_ffn(x, inp.w_gate, inp.w_up, inp.w_down, tile=256, capacity=8, kernel="warp",
                            rule=DenseCrossover(**NO_FIXED), active_fraction=1e-4, kernels=kernels)
    text = str(jax.make_jaxpr(fn)(inp.x))
    assert "stand_in_gate" not in text and "stand_in_pack" in text and " cond[" not in text
    assert_close(jax.jit(fn)(inp.x), xla.ffn(inp.x, inp.w_gate, inp.w_up, inp.w_down), fused_tolerance(jnp.bfloat16, 704),
                 "known layer, device backup")


@pytest.mark.parametrize("backup", sorted(DEVICE_BACKUPS))
def test_the_per_call_choice_with_the_device_backup_uses_the_plans_rule(stand_ins, backup):
    """The per-call form with the device backup chooses its side by the rule the plan was
    given: sparse rows under the default margin (the warp stand-in's mark shows), the
    dense formula itself where the rule's margin leaves the sparse side no room (with the
    flag: the backup over every row)."""
    kernel, _, fields, dense = DEVICE_BACKUPS[backup]
    kernels = dataclasses.replace(stand_ins(mark=True), warp_backup=kernel, warp_dense=dense)
    inp = case(m=1100, f=704, density=0.005, key=16)

    def call(rule):
        return jax.jit(lambda x: cuda_ffn(x, inp.w_gate, inp.w_up, inp.w_down, tile=256, capacity=8, kernel="warp",
                                          rule=rule, kernels=kernels))

    sparse = np.asarray(call(DenseCrossover(**NO_FIXED, **fields))(inp.x), np.float32)
    assert (sparse == np.float32(WARP_MARK)).all(axis=1).mean() > 0.9  # the sparse side: the stand-in's rows
    dense = np.asarray(call(DenseCrossover(**dict(NO_FIXED, margin=0.0), **fields))(inp.x), np.float32)
    want = np.asarray(xla.ffn(inp.x, inp.w_gate, inp.w_up, inp.w_down), np.float32)
    assert not (dense == np.float32(WARP_MARK)).any()
    np.testing.assert_array_equal(dense, want)


def test_the_choice_is_on_the_device_only_where_the_kernels_hold_no_conditional():
    """``FFNOptions.choice_on_device`` (which lowers the per-call floor to the rule's
    no-conditional one) follows the bound kernels: a dense side behind a device flag that
    can run, or the wgmma backup's flag where the rule sets that floor; never the
    bindings' default, a dense_ffn_if that is unavailable here, or no device backup."""
    rule = DenseCrossover()
    floor = dataclasses.replace(rule, per_call_min_tokens_no_conditional=2048)
    on = ffn_cuda._choice_on_device
    assert not on(FFNKernels(), rule) and not on(FFNKernels(), floor)
    assert on(FFNKernels(warp_dense=warp.dense_ffn_if_reference), rule)
    assert on(FFNKernels(warp_dense=warp.dense_ffn_if), rule) == warp.dense_if_available()  # False on the CPU
    assert not on(FFNKernels(warp_backup=None, warp_dense=warp.dense_ffn_if_reference), rule)
    gemm = FFNKernels(warp_backup=warp.backup_rows_gemm_reference)
    assert on(gemm, floor) and not on(gemm, rule)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_dense_side_keeps_the_gate_and_up_products_apart(stand_ins, gated, dtype):
    """A call the plan runs dense (nothing known, below the per-call floor) runs
    xla.ffn_unmerged up to xla.UNMERGED_MAX_TOKENS tokens: the gated FFN's gate and up products behind an optimization barrier
    on x (XLA's GPU pipeline would otherwise merge them over a concatenation of their
    weights made on every call), with the dense formula's values bit for bit, NaN
    included; the non-gated FFN has one product of x and no barrier."""
    inp = case(m=64, d=64, f=256, density=0.05, full=2, empty=2, key=31)
    inp = inp._replace(x=inp.x.astype(dtype).at[5, 3].set(jnp.nan), w_gate=inp.w_gate.astype(dtype),
                       w_up=inp.w_up.astype(dtype), w_down=inp.w_down.astype(dtype))
    w_gate = inp.w_gate if gated else None
    fn = lambda x: cuda_ffn(x, w_gate, inp.w_up, inp.w_down, rule=DenseCrossover(), kernels=stand_ins(mark=True))
    text = str(jax.make_jaxpr(fn)(inp.x))
    assert ("optimization_barrier" in text) == gated
    assert "stand_in_pack" not in text and "stand_in_gate" not in text  # the dense plan
    y = np.asarray(jax.jit(fn)(inp.x), np.float32)
    want = np.asarray(jax.jit(xla.ffn)(inp.x, w_gate, inp.w_up, inp.w_down), np.float32)
    np.testing.assert_array_equal(y, want)
    assert np.isnan(y[5]).all()
    # past UNMERGED_MAX_TOKENS the dense side is XLA's own FFN (its merge pays there)
    big = case(m=xla.UNMERGED_MAX_TOKENS + 8, d=16, f=32, density=0.05, full=2, empty=2, key=32)
    w_gate_big = big.w_gate if gated else None
    fn = lambda x: cuda_ffn(x, w_gate_big, big.w_up, big.w_down, rule=DenseCrossover(), kernels=stand_ins(mark=True))
    text = str(jax.make_jaxpr(fn)(big.x))
    assert "optimization_barrier" not in text and "stand_in_pack" not in text
    np.testing.assert_array_equal(np.asarray(jax.jit(fn)(big.x), np.float32),
                                  np.asarray(jax.jit(xla.ffn)(big.x, w_gate_big, big.w_up, big.w_down), np.float32))
