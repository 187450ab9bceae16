"""The token-blocked fused FFN kernels (ffi/twell_ffn_blocked.cu): bit for bit against their
NumPy model (tests/blocked_emulation.py), and against the reference on every edge."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_twell as jt
from jax_twell.formats import pack_twell_reference, relu_matmul
import blocked_emulation as emu
import stationary_emulation as stat
from jax_twell.testing import synthetic_ffn_inputs, with_extreme_rows
from specs import GPU_SPECS, assert_close, fused_tolerance
from jax_twell.ops.ffn import binding as ffn_binding
from jax_twell.ops.ffn import cuda as ffn_cuda
from jax_twell.ops import layout
from jax_twell.ops.ffn import reference as ffn_reference
from cuda_calls import cuda_ffn
from jax_twell.ops.plan import Side
from test_ffn_contract import FFNContract  # its poisoned operands (not a test class here)

pytestmark = pytest.mark.gpu




def _inputs(m, d, f, density, pattern, dtype, key, *, full=0, empty=0):
    inp = synthetic_ffn_inputs(jax.random.key(key), m, d, f, density=density, pattern=pattern, dtype=dtype)
    inp = with_extreme_rows(inp, full=full, empty=empty)
    return inp.x, inp


# m, d, f, density, pattern, full rows, empty rows
ADVERSARIAL = [
    (1, 64, 260, 0.05, "uniform", 0, 0),
    (3, 64, 520, 0.02, "uniform", 1, 1),
    (77, 128, 300, 0.05, "heavy", 3, 5),
    (1100, 256, 700, 0.02, "heavy", 4, 10),
    (2500, 2048, 1300, 0.01, "heavy", 3, 7),
    (64, 192, 256, 0.5, "dense", 0, 0),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("case", ADVERSARIAL, ids=lambda c: f"m{c[0]}_d{c[1]}_f{c[2]}_{c[4]}")
def test_blocked_matches_emulation_bitwise(case, gated, dtype):
    m, d, f, density, pattern, full, empty = case
    x, inp = _inputs(m, d, f, density, pattern, dtype, m + d, full=full, empty=empty)
    w_up = inp.w_up if gated else None
    w_up_t = inp.w_up.T if gated else None
    for tile, capacity in [(256, 32), (64, 4), (32, 1)]:
        act = pack_twell_reference(relu_matmul(x, inp.w_gate), tile=tile, capacity=capacity)
        need = emu.needed_entries(np.asarray(act.counts), capacity, tile, f)
        max_entries = need + 5
        got = ffn_binding.blocked_ffn(x, act, inp.w_gate, w_up, inp.w_down, w_up_t=w_up_t, max_entries=max_entries, workspace=True)
        y_emu, ws = emu.blocked_ffn(
            x, act.values, act.cols, act.counts, inp.w_gate, w_up, w_up_t, inp.w_down, tile=tile, max_entries=max_entries
        )
        what = f"{case} gated={gated} tile={tile} cap={capacity}"
        np.testing.assert_array_equal(np.asarray(got[1]), ws.seg_start, what)
        np.testing.assert_array_equal(np.asarray(got[2]), ws.tok_off, what)
        np.testing.assert_array_equal(np.asarray(got[3])[:need], ws.entries[:need], what)
        if gated:
            normal = (ws.entries[:need] & emu.RECOMPUTE_FLAG) == 0
            np.testing.assert_array_equal(np.asarray(got[4])[:, :need][:, normal], ws.partial[:, :need][:, normal], what)
        np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint16), np.asarray(y_emu).view(np.uint16), what)
        want = ffn_reference.twell_ffn(x, act, inp.w_gate, w_up, inp.w_down)
        assert_close(got[0], want, fused_tolerance(dtype, f), what)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", ADVERSARIAL, ids=lambda c: f"m{c[0]}_d{c[1]}_f{c[2]}_{c[4]}")
def test_blocked_mma_matches_emulation(case, dtype):
    """The tensor-core steps: same layout and entries as the model, partial sums equal to
    f32 rounding (the tensor cores add in their own order), y as exact as the CUDA-core one."""
    m, d, f, density, pattern, full, empty = case
    x, inp = _inputs(m, d, f, density, pattern, dtype, m + d + 1, full=full, empty=empty)
    for tile, capacity in [(256, 32), (64, 4), (32, 1)]:
        act = pack_twell_reference(relu_matmul(x, inp.w_gate), tile=tile, capacity=capacity)
        need = emu.needed_entries(np.asarray(act.counts), capacity, tile, f)
        max_entries = need + 5
        got = ffn_binding.blocked_ffn(
            x, act, inp.w_gate, inp.w_up, inp.w_down, w_up_t=inp.w_up.T, max_entries=max_entries, workspace=True,
            tensor_cores=True,
        )
        _, ws = emu.blocked_ffn(
            x, act.values, act.cols, act.counts, inp.w_gate, inp.w_up, inp.w_up.T, inp.w_down, tile=tile,
            max_entries=max_entries,
        )
        what = f"{case} tile={tile} cap={capacity}"
        np.testing.assert_array_equal(np.asarray(got[1]), ws.seg_start, what)
        np.testing.assert_array_equal(np.asarray(got[2]), ws.tok_off, what)
        entries = np.asarray(got[3])[:need]
        np.testing.assert_array_equal(entries & 0xFFFF, ws.entries[:need] & 0xFFFF, what)  # columns and flags
        normal = (ws.entries[:need] & emu.RECOMPUTE_FLAG) == 0
        if normal.any():
            assert_close(np.asarray(got[4])[:, :need][:, normal], ws.partial[:, :need][:, normal], 2.0**-16, what)
        want = ffn_reference.twell_ffn(x, act, inp.w_gate, inp.w_up, inp.w_down)
        assert_close(got[0], want, fused_tolerance(dtype, f), what)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", [(1, 256, 260, 0.05, "uniform", 0, 0), (77, 256, 300, 0.05, "heavy", 3, 5),
                                  (1100, 512, 700, 0.02, "heavy", 4, 10), (3000, 768, 1408, 0.01, "uniform", 2, 3)],
                         ids=lambda c: f"m{c[0]}_d{c[1]}_f{c[2]}_{c[4]}")
def test_blocked_union_down_matches_mma(case, dtype):
    """The down step as a union product (``blocked_ffn(down_union=True)``): the layout and
    entries equal the tensor-core kernel's bit for bit, y equals its y to the f32 summation
    order. Entries past ``seg_start[-1]`` are unwritten and not compared."""
    m, d, f, density, pattern, full, empty = case
    x, inp = _inputs(m, d, f, density, pattern, dtype, m + d + 3, full=full, empty=empty)
    for tile, capacity in [(256, 32), (64, 4)]:
        act = pack_twell_reference(relu_matmul(x, inp.w_gate), tile=tile, capacity=capacity)
        max_entries = emu.needed_entries(np.asarray(act.counts), capacity, tile, f) + 5
        run = lambda union: ffn_binding.blocked_ffn(x, act, inp.w_gate, inp.w_up, inp.w_down, w_up_t=inp.w_up.T,
                                             max_entries=max_entries, workspace=True, tensor_cores=True, down_union=union)
        base, union = run(False), run(True)
        what = f"{case} tile={tile} cap={capacity}"
        need = int(base[1][-1])  # entries past seg_start[-1] are unwritten in both
        np.testing.assert_array_equal(np.asarray(union[1]), np.asarray(base[1]), what)
        np.testing.assert_array_equal(np.asarray(union[2]), np.asarray(base[2]), what)
        np.testing.assert_array_equal(np.asarray(union[3])[:need], np.asarray(base[3])[:need], what)
        assert_close(union[0], base[0], 2.0**-7, what)


# m, d, f, density, pattern, full rows, empty rows: one token to three blocks, the last not
# a multiple of 16; rows far past capacity, empty rows; f at the slice's limits
STATIONARY_CASES = [
    (1, 128, 260, 0.05, "uniform", 0, 0),
    (77, 128, 300, 0.05, "heavy", 3, 5),
    (1100, 512, 700, 0.02, "heavy", 4, 10),
    (3000, 768, 1408, 0.01, "uniform", 2, 3),
    (2100, 256, 7264, 0.005, "heavy", 2, 40),
    (64, 192, 256, 0.5, "dense", 0, 0),
    # 8 columns a CTA past f = 7,264 (eight residue classes); f at the sort's limit
    (1500, 192, 7265, 0.005, "heavy", 3, 20),
    (300, 128, 14524, 0.003, "uniform", 2, 7),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", STATIONARY_CASES, ids=lambda c: f"m{c[0]}_d{c[1]}_f{c[2]}_{c[4]}")
def test_blocked_stationary_down_matches_emulation(case, dtype):
    """The down step with the weight stationary (``blocked_ffn(down_stationary=True)``): the
    layout and entries equal the union path's bit for bit, y equals the NumPy model of its
    walk (stationary_emulation.down) bit for bit, and the union product's y to the f32
    summation order."""
    m, d, f, density, pattern, full, empty = case
    x, inp = _inputs(m, d, f, density, pattern, dtype, m + d + 7, full=full, empty=empty)
    for tile, capacity in [(256, 32), (64, 4), (32, 1)]:
        act = pack_twell_reference(relu_matmul(x, inp.w_gate), tile=tile, capacity=capacity)
        max_entries = emu.needed_entries(np.asarray(act.counts), capacity, tile, f) + 5
        while not layout.stationary_down_supported(m, d, f, max_entries):  # the walk's workspace in the partials
            max_entries *= 2
        run = lambda stationary: ffn_binding.blocked_ffn(
            x, act, inp.w_gate, inp.w_up, inp.w_down, w_up_t=inp.w_up.T, max_entries=max_entries, workspace=True,
            tensor_cores=True, up_union=True, down_union=True, down_stationary=stationary)
        base, got = run(False), run(True)
        what = f"{case} tile={tile} cap={capacity}"
        need = int(base[1][-1])
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(base[1]), what)
        np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(base[2]), what)
        entries = np.asarray(got[3])
        np.testing.assert_array_equal(entries[:need], np.asarray(base[3])[:need], what)
        want = stat.down(entries, got[1], got[2], act.counts, inp.w_down, capacity=capacity, tile=tile, f=f, dtype=dtype)
        np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint16), want.view(np.uint16), what)
        assert_close(got[0], base[0], 2.0**-7, what)


@pytest.mark.parametrize("m", [77, 3000])
def test_blocked_stationary_down_over_budget(m):
    """Past the entry budget the stationary step writes NaN (workspace form), and the op
    (with its fallback, the row kernel) is exact."""
    d, f = 256, 700
    x, inp = _inputs(m, d, f, 0.02, "heavy", jnp.bfloat16, m + 11, full=3, empty=2)
    act = pack_twell_reference(relu_matmul(x, inp.w_gate), tile=256, capacity=8)
    need = emu.needed_entries(np.asarray(act.counts), 8, 256, f)
    max_entries = need // 2
    assert layout.stationary_down_supported(m, d, f, max_entries)
    kw = dict(w_up_t=inp.w_up.T, max_entries=max_entries, tensor_cores=True, up_union=True, down_union=True,
              down_stationary=True)
    ws = ffn_binding.blocked_ffn(x, act, inp.w_gate, inp.w_up, inp.w_down, workspace=True, **kw)
    assert np.isnan(np.asarray(ws[0], np.float32)).all()
    y = ffn_binding.blocked_ffn(x, act, inp.w_gate, inp.w_up, inp.w_down, **kw)
    want = ffn_reference.twell_ffn(x, act, inp.w_gate, inp.w_up, inp.w_down)
    assert_close(y, want, fused_tolerance(jnp.bfloat16, f), f"m={m}")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", [(77, 512, 300, 0.05, "heavy", 3, 5), (1100, 512, 700, 0.02, "heavy", 4, 10),
                                  (3000, 768, 1408, 0.01, "uniform", 2, 3), (130, 1024, 2600, 0.1, "uniform", 0, 0)],
                         ids=lambda c: f"m{c[0]}_d{c[1]}_f{c[2]}_{c[4]}")
def test_blocked_union_up_matches_mma(case, dtype):
    """The up step as a union product (``blocked_ffn(up_union=True)``): the layout and the
    entries' low halves equal the tensor-core kernel's bit for bit; h (the high halves) and
    y equal its h and y to the f32 summation order over d. Overflowed tiles (``full``) and
    empty rows included; the last case has unions past one 256-neuron tile."""
    m, d, f, density, pattern, full, empty = case
    x, inp = _inputs(m, d, f, density, pattern, dtype, m + d + 5, full=full, empty=empty)
    for tile, capacity in [(256, 32), (64, 4)]:
        act = pack_twell_reference(relu_matmul(x, inp.w_gate), tile=tile, capacity=capacity)
        max_entries = emu.needed_entries(np.asarray(act.counts), capacity, tile, f) + 5
        assert layout.union_up_supported(m, d, f, max_entries), (case, max_entries)
        run = lambda up, down: ffn_binding.blocked_ffn(
            x, act, inp.w_gate, inp.w_up, inp.w_down, w_up_t=inp.w_up.T, max_entries=max_entries, workspace=True,
            tensor_cores=True, up_union=up, down_union=down)
        base = run(False, False)
        need = int(base[1][-1])  # entries past seg_start[-1] are unwritten in both
        for up, down in [(True, False), (True, True)]:
            out = run(up, down)
            what = f"{case} tile={tile} cap={capacity} down_union={down}"
            np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(base[1]), what)
            np.testing.assert_array_equal(np.asarray(out[2]), np.asarray(base[2]), what)
            got, want = np.asarray(out[3])[:need], np.asarray(base[3])[:need]
            np.testing.assert_array_equal(got & 0xFFFF, want & 0xFFFF, what)
            h = lambda w: (w >> 16).astype(np.uint16).view(np.dtype(dtype)).astype(np.float32)
            # u one unit in the last place off becomes up to two in h = round(g round(u))
            np.testing.assert_allclose(h(got), h(want), rtol=2.0**-6, atol=1e-6, err_msg=what)
            assert np.mean(h(got) == h(want)) > 0.9, what  # most h round the same
            assert_close(out[0], base[0], 2.0**-7, what)


@pytest.mark.parametrize("kernel", ["blocked", "blocked_mma", "blocked_union"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("spec", GPU_SPECS, ids=str)
def test_blocked_ffn_matches_reference(spec, dtype, gated, kernel):
    if spec.d % 64:
        pytest.skip("d not a multiple of 64 (a documented constraint of the blocked kernel)")
    inp = synthetic_ffn_inputs(jax.random.key(spec.m + 7), spec.m, spec.d, spec.f, density=spec.density, pattern=spec.pattern, dtype=dtype)
    w_up = inp.w_up if gated else None
    for tile, capacity in [(256, 32), (64, 4)]:
        act = jt.gate_twell(inp.x, inp.w_gate, tile=tile, capacity=capacity, implementation="reference")
        with jax.default_matmul_precision("highest"):
            y = jax.jit(lambda x, a: ffn_cuda.twell_ffn(x, a, inp.w_gate, w_up, inp.w_down, kernel=kernel))(inp.x, act)
            want = ffn_reference.twell_ffn(inp.x, act, inp.w_gate, w_up, inp.w_down)
        assert y.dtype == dtype and y.shape == (spec.m, spec.d)
        assert_close(y, want, fused_tolerance(dtype, spec.f), f"{spec} {kernel} tile={tile} cap={capacity}")


def test_blocked_sparse_ffn_forced_and_auto():
    """sparse_ffn(kernel="blocked") forced sparse runs the blocked kernel (M >= 256) and
    matches the reference; with the default rule the answer is the same whichever runs."""
    x, inp = _inputs(3000, 512, 1408, 0.01, "heavy", jnp.bfloat16, 21, full=2, empty=3)
    for gated in (True, False):
        wg = inp.w_gate if gated else None
        wu = inp.w_up if gated else inp.w_gate
        want = jt.sparse_ffn(x, wg, wu, inp.w_down, implementation="reference")
        forced = jax.jit(lambda x: cuda_ffn(x, wg, wu, inp.w_down, tile=256, capacity=32, kernel="blocked", side=Side.SPARSE))
        hlo = forced.lower(x).as_text()
        assert "jax_twell_ffn_blocked" in hlo
        assert_close(forced(x), want, fused_tolerance(jnp.bfloat16, 1408), f"forced gated={gated}")
        auto = cuda_ffn(x, wg, wu, inp.w_down, tile=256, capacity=32, kernel="blocked")
        assert_close(auto, want, fused_tolerance(jnp.bfloat16, 1408), f"auto gated={gated}")


def test_blocked_over_budget_falls_back_exactly_or_is_nan():
    x, inp = _inputs(300, 128, 700, 0.05, "heavy", jnp.bfloat16, 5, full=4)
    act = pack_twell_reference(relu_matmul(x, inp.w_gate), tile=128, capacity=8)
    need = emu.needed_entries(np.asarray(act.counts), 8, 128, 700)
    want = ffn_reference.twell_ffn(x, act, inp.w_gate, inp.w_up, inp.w_down)
    y = ffn_cuda.twell_ffn(x, act, inp.w_gate, inp.w_up, inp.w_down, kernel="blocked", max_entries=need - 1)
    assert_close(y, want, fused_tolerance(jnp.bfloat16, 700), "row-kernel fallback")
    raw = ffn_binding.blocked_ffn(x, act, inp.w_gate, inp.w_up, inp.w_down, max_entries=need - 1, workspace=True)
    assert np.isnan(np.asarray(raw[0], np.float32)).all()


def _bits(y):
    return np.asarray(y).view(np.uint16)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("variant", [(False, False), (True, False), (True, True)], ids=["cuda_cores", "mma", "union"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
def test_blocked_handler_runs_the_row_kernel_only_past_its_budget(gated, variant, dtype):
    """The handler's own fallback (``fallback=True``): within the entry budget its row kernel
    exits at once and y keeps the blocked steps' bits; one entry past it, the blocked steps
    write NaN and the row kernel then writes every row, with the row kernel's own bits. 1100
    rows against a fallback grid of 3 CTAs per SM, so its CTAs take several rows each;
    overflowed tiles (``full``) and empty rows included."""
    m, d, f = 1100, 512, 700
    x, inp = _inputs(m, d, f, 0.02, "heavy", dtype, 17, full=4, empty=10)
    w_act, w_up = (inp.w_gate, inp.w_up) if gated else (inp.w_up, None)
    w_up_t = None if w_up is None else w_up.T
    act = pack_twell_reference(relu_matmul(x, w_act), tile=256, capacity=32)
    need = emu.needed_entries(np.asarray(act.counts), 32, 256, f)
    mma, union = variant
    call = lambda budget, fallback: ffn_binding.blocked_call(
        x, act, w_act, w_up, inp.w_down, w_up_t, max_entries=budget, tensor_cores=mma, down_union=union, up_union=union,
        fallback=fallback)[0]
    within = call(need, True)
    assert np.isfinite(np.asarray(within, np.float32)).all()
    np.testing.assert_array_equal(_bits(within), _bits(call(need, False)), "within the budget")
    assert np.isnan(np.asarray(call(need - 1, False), np.float32)).all()
    row = ffn_binding.twell_ffn(x, act, w_act, w_up, inp.w_down, w_up_t)
    np.testing.assert_array_equal(_bits(call(need - 1, True)), _bits(row), "past the budget")
    want = ffn_reference.twell_ffn(x, act, w_act, w_up, inp.w_down)
    assert_close(row, want, fused_tolerance(dtype, f), "row kernel")


def test_blocked_poisoned_output_fully_written_deterministic_leading_dims():
    x, inp = _inputs(1500, 256, 1000, 0.05, "heavy", jnp.bfloat16, 3, full=2)
    act = pack_twell_reference(relu_matmul(x, inp.w_gate), tile=128, capacity=8)
    fn = jax.jit(lambda x, a: ffn_cuda.twell_ffn(x, a, inp.w_gate, inp.w_up, inp.w_down, kernel="blocked"))
    y1, y2 = np.asarray(fn(x, act)), np.asarray(fn(x, act))
    assert np.isfinite(y1.astype(np.float32)).all()
    np.testing.assert_array_equal(y1.view(np.uint16), y2.view(np.uint16))
    x3 = x.reshape(3, 500, 256)
    act3 = jax.tree.map(lambda a: a.reshape(3, 500, *a.shape[1:]), act)
    y3 = ffn_cuda.twell_ffn(x3, act3, inp.w_gate, inp.w_up, inp.w_down, kernel="blocked")
    np.testing.assert_array_equal(np.asarray(y3).reshape(1500, 256).view(np.uint16), y1.view(np.uint16))
    empty = jnp.zeros((0, 256), jnp.bfloat16)
    e_act = pack_twell_reference(relu_matmul(empty, inp.w_gate), tile=128, capacity=8)
    assert ffn_cuda.twell_ffn(empty, e_act, inp.w_gate, inp.w_up, inp.w_down, kernel="blocked").shape == (0, 256)


def test_blocked_clear_errors():
    x = jnp.ones((4, 96), jnp.bfloat16)  # d=96: not a multiple of 64
    w = jnp.ones((96, 300), jnp.bfloat16)
    act = pack_twell_reference(relu_matmul(x, w), tile=64, capacity=4)
    with pytest.raises(ValueError, match="multiple of 64"):
        ffn_cuda.twell_ffn(x, act, w, w, w.T, kernel="blocked")
    x = jnp.ones((4, 64), jnp.bfloat16)
    w = jnp.ones((64, 1024), jnp.bfloat16)
    act = pack_twell_reference(relu_matmul(x, w), tile=512, capacity=4)
    with pytest.raises(ValueError, match="tile <= 256"):
        ffn_cuda.twell_ffn(x, act, w, w, w.T, kernel="blocked")
    with pytest.raises(ValueError, match="kernel must be one of"):
        ffn_cuda.twell_ffn(x, act, w, w, w.T, kernel="warp")


# The per-call TwELL path (the side chosen on the device) with no fixed costs, so that a
# finite call takes its sparse side at the sizes below.
_PER_CALL_RULE = dict(fixed_overhead=0.0, transpose_bandwidth=float("inf"), row_full_tokens=1, per_call_min_tokens=0,
                      per_call_min_d=0, layer_min_tokens=0, layer_min_tokens_no_conditional=0,
                      warp_fixed_overhead=0.0, warp_pack_bandwidth=float("inf"))


@pytest.mark.parametrize("case", ["finite", "nan_w_up_quiet", "inf_w_down_quiet", "nan_x_row", "inf_x_row", "nan_w_act"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("kernel", ["row", "blocked"])
def test_per_call_twell_path_is_the_dense_formula_with_nonfinite_operands(kernel, gated, case):
    """The TwELL path with its side chosen per call on the device, its operands' finite
    checks on the sparse side only (the stand-in test in test_cuda_dispatch.py shows which
    side runs): a NaN or Inf in x or a weight gives NaN / Inf exactly where the dense
    formula (f32) has them, the rest close to it, with the real kernels in the program.
    (Not compared bit for bit with the forced sparse call: that one packs in the fused
    gate's epilogue, whose g may differ from XLA's gate by an ulp.)"""
    if case == "nan_w_up_quiet" and not gated:
        pytest.skip("non-gated: w_up is the activation's weight (nan_w_act)")
    from jax_twell.ops.costs import DenseCrossover

    x, inp = _inputs(1100, 256, 700, 0.02, "heavy", jnp.bfloat16, 31, full=2, empty=3)
    wg, wu = (inp.w_gate, inp.w_up) if gated else (None, inp.w_gate)
    x, wg, wu, wd = (x, wg, wu, inp.w_down) if case == "finite" else FFNContract._poisoned((x, wg, wu, inp.w_down), case)
    rule = DenseCrossover(**_PER_CALL_RULE)
    call = jax.jit(lambda x, wg, wu, wd: cuda_ffn(x, wg, wu, wd, tile=256, capacity=8, kernel=kernel, rule=rule))
    hlo = call.lower(x, wg, wu, wd).as_text()
    assert ("stablehlo.case" in hlo or "stablehlo.if" in hlo), kernel  # the side chosen on the device
    assert ("jax_twell_ffn_blocked" in hlo) == (kernel == "blocked") and "jax_twell_ffn" in hlo, kernel
    y = np.asarray(call(x, wg, wu, wd), np.float64)
    with jax.default_matmul_precision("highest"):
        f32 = [None if a is None else a.astype(jnp.float32) for a in (x, wg, wu, wd)]
        h = jax.nn.relu(f32[0] @ f32[2]) if wg is None else jax.nn.relu(f32[0] @ f32[1]) * (f32[0] @ f32[2])
        want = np.asarray(h @ f32[3], np.float64)
    bad = ~np.isfinite(want)
    assert bad.any() == (case != "finite"), case
    np.testing.assert_array_equal(~np.isfinite(y), bad, err_msg=f"{kernel} {case}: NaN/Inf where the dense formula has them")
    assert_close(np.where(bad, 0, y), np.where(bad, 0, want), fused_tolerance(jnp.bfloat16, 700), f"{kernel} {case}")
