"""The CUDA training FFN kernels (ffi/twell_train.cu): bit for bit against their NumPy model
(tests/train_emulation.py), gradients against jax.grad of the dense formula on the
adversarial set, determinism, and the op's branches (sparse, dense rule, over budget)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_twell as jt
from jax_twell.ops.ffn_train.api import sparse_ffn_train_for_layer
from jax_twell.formats import pack_twell_reference, relu_matmul
import blocked_emulation as bemu
import stationary_emulation as stat
import train_emulation as emu
from specs import GPU_SPECS, assert_close
from test_train_emulation import GRAD_TOL, L1, dense_ffn, grads_of, make_case
from jax_twell.ops import layout
from jax_twell.ops.ffn_train import binding as train_binding
from jax_twell.ops.ffn_train import reference as train_reference
from cuda_calls import cuda_ffn_train
from jax_twell.ops.plan import LayerInfo, Side, TrainOptions

pytestmark = pytest.mark.gpu


# m, d, f, density, pattern, full rows, empty rows
ADVERSARIAL = [
    (1, 64, 260, 0.05, "uniform", 0, 0),
    (3, 64, 520, 0.02, "uniform", 1, 1),
    (77, 128, 300, 0.05, "heavy", 3, 5),
    (1100, 256, 700, 0.02, "heavy", 4, 10),
    (2500, 2048, 1300, 0.01, "heavy", 3, 7),
    (64, 192, 256, 0.5, "dense", 0, 0),
    (1100, 256, 700, 0.02, "skewed", 0, 0),  # neurons over 1/16 of a tile: shared by all weight-gradient groups
    (1100, 64, 520, 0.01, "skewed", 0, 0),  # one neuron with 44% of its tile's entries
]


def _raw(x, w_gate, w_up, w_down, dy, tile, capacity):
    """Kernel results and the model's, for one forward + backward with explicit layout."""
    gated = w_gate is not None
    w_act = w_gate if gated else w_up
    act = pack_twell_reference(relu_matmul(x, w_act), tile=tile, capacity=capacity)
    need = bemu.needed_entries(np.asarray(act.counts), capacity, tile, act.f)
    e = need + 5
    m = x.shape[0]
    y, res, h_source = train_binding.train_forward(x, act, w_act, w_up if gated else None, w_down, max_entries=e)
    bwd = train_binding.train_backward(x, dy, w_gate, w_up, w_down, res, jnp.float32(L1 / m), tile=tile, workspace=True)
    y_e, res_e, h_e, _, _ = emu.train_forward(
        x, act.values, act.cols, act.counts, w_act, w_up if gated else None, w_up.T if gated else None, w_down,
        tile=tile, max_entries=e,
    )
    bwd_e = emu.train_backward(x, dy, w_act.T, w_up.T if gated else None, w_down, res_e, L1 / m, tile=tile)
    return need, (y, res, h_source, bwd), (y_e, res_e, h_e, bwd_e)


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("case", ADVERSARIAL, ids=lambda c: f"m{c[0]}_d{c[1]}_f{c[2]}_{c[4]}")
def test_train_kernels_match_emulation_bitwise(case, gated, dtype):
    m, d, f, density, pattern, full, empty = case
    x, wg, wu, wd, dy = make_case(m, d, f, density, pattern, gated, full=full, empty=empty, key=m + d, dtype=dtype)
    for tile, capacity in [(256, 32), (64, 4)]:
        need, (y, res, h_source, bwd), (y_e, res_e, h_e, bwd_e) = _raw(x, wg, wu, wd, dy, tile, capacity)
        what = f"{case} gated={gated} tile={tile} cap={capacity}"
        eq = lambda a, b, name: np.testing.assert_array_equal(_bits(a), _bits(b), f"{what} {name}")
        eq(res.seg_start, res_e.seg_start, "seg_start")
        eq(res.tok_off, res_e.tok_off, "tok_off")
        eq(np.asarray(res.entries)[:need], res_e.entries[:need], "entries")
        if gated:
            eq(np.asarray(res.up)[:need], res_e.up[:need], "up")
        eq(np.asarray(h_source)[:need], h_e[:need], "h words")
        eq(res.col_off, res_e.col_off, "col_off")
        defined = emu.by_col_defined(res_e)
        eq(np.asarray(res.by_col)[defined], res_e.by_col[defined], "by_col")
        eq(y, y_e, "y")
        dx, dw_down, dw_act_t = bwd[:3]
        partial, coef = bwd[-2:]
        dx_e, dw_down_e, dw_act_t_e, dw_up_t_e, partial_e, coef_e = bwd_e
        eq(np.asarray(partial)[:, :need], partial_e[:, :need], "dh partials")
        eq(np.asarray(coef)[:, :need], coef_e[:, :need], "coefficients")
        eq(dx, dx_e, "dx")
        eq(dw_down, dw_down_e, "dw_down")
        eq(dw_act_t, dw_act_t_e, "dw_act_t")
        if gated:
            eq(bwd[3], dw_up_t_e, "dw_up_t")


def test_weight_grads_past_32_blocks_match_emulation_bitwise():
    """33 token blocks (M=33,000): each neuron's list of records spans every block, in
    block order, and the skewed pattern sends some tiles through the warp queue."""
    x, wg, wu, wd, dy = make_case(33000, 64, 260, 0.01, "skewed", True, key=7)
    need, (y, res, h_source, bwd), (y_e, res_e, h_e, bwd_e) = _raw(x, wg, wu, wd, dy, 256, 32)
    assert res.col_off.shape[0] == 33
    for got, want, name in zip(bwd[1:4], bwd_e[1:4], ("dw_down", "dw_act_t", "dw_up_t")):
        np.testing.assert_array_equal(_bits(got), _bits(want), name)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("case", ADVERSARIAL, ids=lambda c: f"m{c[0]}_d{c[1]}_f{c[2]}_{c[4]}")
def test_dx_on_tensor_cores_matches_cuda_cores(case, gated):
    """dx on tensor cores (``train_backward(dx_tensor_cores=True)``): the weight gradients,
    partial sums and coefficients equal the CUDA-core backward's bit for bit; dx equals it to
    the rounding of its coefficients to bf16 (XLA's dense backward rounds dg and du so too)."""
    m, d, f, density, pattern, full, empty = case
    x, wg, wu, wd, dy = make_case(m, d, f, density, pattern, gated, full=full, empty=empty, key=m + d + 5)
    w_act = wg if gated else wu
    act = pack_twell_reference(relu_matmul(x, w_act), tile=256, capacity=32)
    need = bemu.needed_entries(np.asarray(act.counts), 32, 256, act.f)
    _, res, _ = train_binding.train_forward(x, act, w_act, wu if gated else None, wd, max_entries=need + 5)
    l1 = jnp.float32(L1 / m)
    cc = train_binding.train_backward(x, dy, wg, wu, wd, res, l1, tile=256, workspace=True)
    tc = train_binding.train_backward(x, dy, wg, wu, wd, res, l1, tile=256, workspace=True, dx_tensor_cores=True)
    for i in range(1, len(cc) - 2):  # the weight gradients
        np.testing.assert_array_equal(_bits(tc[i]), _bits(cc[i]), f"result {i}")
    for i in (-2, -1):  # partials and coefficients: defined for the first `need` entries only
        np.testing.assert_array_equal(_bits(tc[i][:, :need]), _bits(cc[i][:, :need]), f"result {i}")
    # Each coefficient rounded to bf16 (2^-9 relative) before a sum that may cancel: a
    # single-token row of ~13 terms measured 0.0165 of the row's largest value. A wrong or
    # lost entry moves dx by a whole term (O(1) here).
    assert_close(tc[0], cc[0], 2.0**-5, f"dx {case} gated={gated}")


# d a multiple of 256 (the union product's constraint): one and two consumer warp groups
# (d = 256, 768 against 512, 2048), M = 1, M not a multiple of 64, full and empty rows.
UNION_CASES = [
    (1, 256, 260, 0.05, "uniform", 0, 0),
    (77, 256, 300, 0.05, "heavy", 3, 5),
    (1100, 512, 700, 0.02, "heavy", 4, 10),
    (2500, 2048, 1300, 0.01, "heavy", 3, 7),
    (64, 256, 256, 0.5, "dense", 0, 0),
    (3000, 768, 1408, 0.01, "uniform", 2, 3),
]


def _packed_case(case, gated, dtype, key):
    """A case's inputs, its activation weight, the TwELL of its gate and the entries it
    needs: ``(x, wg, wu, wd, dy, w_act, act, need)``."""
    m, d, f, density, pattern, full, empty = case
    x, wg, wu, wd, dy = make_case(m, d, f, density, pattern, gated, full=full, empty=empty, key=key, dtype=dtype)
    w_act = wg if gated else wu
    act = pack_twell_reference(relu_matmul(x, w_act), tile=256, capacity=32)
    return x, wg, wu, wd, dy, w_act, act, bemu.needed_entries(np.asarray(act.counts), 32, 256, act.f)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("case", UNION_CASES, ids=lambda c: f"m{c[0]}_d{c[1]}_f{c[2]}_{c[4]}")
def test_dx_union_matches_tensor_cores(case, gated, dtype):
    """dx as a union product (``train_backward(dx_union=True)``): every other result equals
    the tensor-core backward's bit for bit; dx equals its dx to the summation order (the
    same coefficients rounded to the element type, f32 sums in another order)."""
    m, d, f = case[:3]
    x, wg, wu, wd, dy, w_act, act, need = _packed_case(case, gated, dtype, key=m + d + 9)
    budget = need + 5  # a tight budget: the union layout is placed by the entries
    assert layout.union_dx_supported(m, d, f, budget, gated)
    _, res, _ = train_binding.train_forward(x, act, w_act, wu if gated else None, wd, max_entries=budget)
    l1 = jnp.float32(L1 / m)
    kw = dict(tile=256, workspace=True, tensor_cores=True, dx_tensor_cores=True)
    tc = train_binding.train_backward(x, dy, wg, wu, wd, res, l1, **kw)
    un = train_binding.train_backward(x, dy, wg, wu, wd, res, l1, dx_union=True, **kw)
    for i in range(1, len(tc) - 2):  # the weight gradients
        np.testing.assert_array_equal(_bits(un[i]), _bits(tc[i]), f"result {i}")
    np.testing.assert_array_equal(_bits(un[-1][:, :need]), _bits(tc[-1][:, :need]), "coefficients")
    # f32 sums of the same products in another order: far below one bf16 ulp of the row's
    # largest term; a lost or doubled entry moves dx by a whole term.
    assert_close(un[0], tc[0], 2.0**-7, f"dx {case} gated={gated}")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", UNION_CASES, ids=lambda c: f"m{c[0]}_d{c[1]}_f{c[2]}_{c[4]}")
def test_down_union_matches_down_step(case, dtype):
    """The gated forward's down step as a union product (``train_forward(down_union=True)``):
    the residuals and h words equal the tensor-core forward's bit for bit; y equals its y to
    the f32 summation order. Entries past ``seg_start[-1]`` are unwritten and not compared."""
    m, d, f, density, pattern, full, empty = case
    x, wg, wu, wd, dy = make_case(m, d, f, density, pattern, True, full=full, empty=empty, key=m + d + 11, dtype=dtype)
    act = pack_twell_reference(relu_matmul(x, wg), tile=256, capacity=32)
    budget = bemu.needed_entries(np.asarray(act.counts), 32, 256, act.f) + 5
    if not layout.union_down_supported(m, d, f, budget):
        pytest.skip("the layout does not fit the up step's workspace at this budget (d / 64 words per entry)")
    y0, res0, h0 = train_binding.train_forward(x, act, wg, wu, wd, max_entries=budget, tensor_cores=True)
    y1, res1, h1 = train_binding.train_forward(x, act, wg, wu, wd, max_entries=budget, tensor_cores=True, down_union=True)
    need = int(res0.seg_start[-1])  # entries past it are unwritten in both
    for name in ("seg_start", "tok_off", "col_off"):
        np.testing.assert_array_equal(_bits(getattr(res1, name)), _bits(getattr(res0, name)), name)
    for name, a, b in [("entries", res1.entries, res0.entries), ("up", res1.up, res0.up), ("h words", h1, h0)]:
        np.testing.assert_array_equal(_bits(a)[:need], _bits(b)[:need], name)
    defined = emu.by_col_defined(jax.tree.map(np.asarray, res0))
    np.testing.assert_array_equal(_bits(res1.by_col)[defined], _bits(res0.by_col)[defined], "by_col")
    assert_close(y1, y0, 2.0**-7, f"y {case}")


DX_STATIONARY_CASES = UNION_CASES + [
    (300, 256, 3700, 0.01, "heavy", 2, 3),
    (300, 256, 7300, 0.01, "heavy", 2, 3),  # f past 7,264: eight columns a CTA in each walk
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("case", DX_STATIONARY_CASES, ids=lambda c: f"m{c[0]}_d{c[1]}_f{c[2]}_{c[4]}")
def test_dx_stationary_matches_emulation(case, gated, dtype):
    """dx by the stationary walks (``train_backward(dx_stationary=True)``; gated, two walks,
    the second adding the first's f32 sums): the weight gradients and coefficients equal the
    union dx backward's bit for bit; dx equals the NumPy model of the walks
    (stationary_emulation.dx) bit for bit and the union product's dx to the f32 summation
    order."""
    m, d, f = case[:3]
    x, wg, wu, wd, dy, w_act, act, need = _packed_case(case, gated, dtype, key=m + d + 19)
    budget = need + 5
    while not layout.walk_supported(m, d, f, budget, 2 if gated else 1):  # the walk's workspace in the partials
        budget *= 2
    _, res, _ = train_binding.train_forward(x, act, w_act, wu if gated else None, wd, max_entries=budget)
    l1 = jnp.float32(L1 / m)
    kw = dict(tile=256, workspace=True, tensor_cores=True, dx_tensor_cores=True, dx_union=True)
    un = train_binding.train_backward(x, dy, wg, wu, wd, res, l1, **kw)
    st = train_binding.train_backward(x, dy, wg, wu, wd, res, l1, dx_stationary=True, **kw)
    for i in range(1, len(un) - 2):  # the weight gradients
        np.testing.assert_array_equal(_bits(st[i]), _bits(un[i]), f"result {i}")
    coef = np.asarray(st[-1])
    np.testing.assert_array_equal(_bits(st[-1][:, :need]), _bits(un[-1][:, :need]), "coefficients")
    want = stat.dx(res.entries, coef, res.seg_start, res.tok_off, act.counts, w_act.T, wu.T if gated else None,
                   capacity=32, tile=256, f=f, dtype=dtype)
    np.testing.assert_array_equal(_bits(st[0]), want.view(np.uint16), f"dx {case} gated={gated}")
    assert_close(st[0], un[0], 2.0**-7, f"dx {case} gated={gated}")
    if gated and layout.stationary_down_supported(m, d, f, budget):
        # The forward's stationary down walk keeps its token order, and the dx walk takes it
        # instead of computing it again: every result the same, bit for bit.
        _, res_kept, _ = train_binding.train_forward(x, act, w_act, wu, wd, max_entries=budget, down_stationary=True)
        assert res_kept.stat_order is not None and res.stat_order is None
        kept = train_binding.train_backward(x, dy, wg, wu, wd, res_kept, l1, dx_stationary=True, **kw)
        for i in range(len(st) - 2):  # dx and the weight gradients (the partials hold the sort's histograms)
            np.testing.assert_array_equal(_bits(kept[i]), _bits(st[i]), f"result {i} with the forward's token order")
        np.testing.assert_array_equal(_bits(kept[-1][:, :need]), _bits(st[-1][:, :need]), "coefficients")


STATIONARY_CASES = UNION_CASES + [
    (300, 256, 7300, 0.01, "heavy", 2, 3),  # f past 7,264: eight columns of Wd a CTA
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", STATIONARY_CASES, ids=lambda c: f"m{c[0]}_d{c[1]}_f{c[2]}_{c[4]}")
def test_down_stationary_matches_emulation(case, dtype):
    """The gated forward's down step with the weight stationary
    (``train_forward(down_stationary=True)``, with the union up step): the residuals and h
    words equal the union-down forward's bit for bit, y equals the NumPy model of the walk
    (stationary_emulation.down over the h words) bit for bit and the union product's y to
    the f32 summation order."""
    m, d, f, density, pattern, full, empty = case
    x, wg, wu, wd, dy = make_case(m, d, f, density, pattern, True, full=full, empty=empty, key=m + d + 17, dtype=dtype)
    act = pack_twell_reference(relu_matmul(x, wg), tile=256, capacity=32)
    budget = bemu.needed_entries(np.asarray(act.counts), 32, 256, act.f) + 5
    while not layout.stationary_down_supported(m, d, f, budget):  # the walk's workspace in the partials
        budget *= 2
    kw = dict(max_entries=budget, tensor_cores=True, up_union=True)
    y0, res0, h0 = train_binding.train_forward(x, act, wg, wu, wd, down_union=True, **kw)
    y1, res1, h1 = train_binding.train_forward(x, act, wg, wu, wd, down_union=True, down_stationary=True, **kw)
    need = int(res0.seg_start[-1])  # entries past it are unwritten in both
    for name in ("seg_start", "tok_off", "col_off"):
        np.testing.assert_array_equal(_bits(getattr(res1, name)), _bits(getattr(res0, name)), name)
    for name, a, b in [("entries", res1.entries, res0.entries), ("up", res1.up, res0.up), ("h words", h1, h0)]:
        np.testing.assert_array_equal(_bits(a)[:need], _bits(b)[:need], name)
    want = stat.down(h1, res1.seg_start, res1.tok_off, act.counts, wd, capacity=32, tile=256, f=f, dtype=dtype)
    np.testing.assert_array_equal(_bits(y1), want.view(np.uint16), f"y {case}")
    assert_close(y1, y0, 2.0**-7, f"y {case}")


def test_down_stationary_refused_where_unsupported():
    """Asked for where it cannot run (the non-gated FFN, f past 14,524), the stationary step
    is not requested from the handler: the call runs the other down step, exactly."""
    x, wg, wu, wd, dy = make_case(200, 256, 300, 0.05, "heavy", False, key=5)
    act = pack_twell_reference(relu_matmul(x, wu), tile=256, capacity=32)
    budget = bemu.needed_entries(np.asarray(act.counts), 32, 256, act.f) + 5
    y0 = train_binding.train_forward(x, act, wu, None, wd, max_entries=budget, tensor_cores=True)[0]
    y1 = train_binding.train_forward(x, act, wu, None, wd, max_entries=budget, tensor_cores=True, down_stationary=True)[0]
    np.testing.assert_array_equal(_bits(y1), _bits(y0))
    assert not layout.stationary_down_supported(64, 2048, 14528, 10**6)


UP_UNION_CASES = [
    (1, 512, 260, 0.05, "uniform", 0, 0),
    (77, 384, 300, 0.05, "heavy", 3, 5),
    (1100, 512, 700, 0.02, "heavy", 4, 10),
    (2500, 2048, 1300, 0.01, "heavy", 3, 7),
    (130, 1024, 2600, 0.1, "uniform", 0, 0),  # unions past one 256-neuron tile
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", UP_UNION_CASES, ids=lambda c: f"m{c[0]}_d{c[1]}_f{c[2]}_{c[4]}")
def test_up_union_matches_up_step(case, dtype):
    """The gated forward's up step as a union product (``train_forward(up_union=True)``,
    with and without the union down step): the layout residuals, entries and by-column order
    equal the tensor-core forward's bit for bit; u (the up residual) within one unit in the
    last place and h within two (u rounded once more), y to the f32 summation order."""
    m, d, f, density, pattern, full, empty = case
    x, wg, wu, wd, dy = make_case(m, d, f, density, pattern, True, full=full, empty=empty, key=m + d + 13, dtype=dtype)
    act = pack_twell_reference(relu_matmul(x, wg), tile=256, capacity=32)
    budget = bemu.needed_entries(np.asarray(act.counts), 32, 256, act.f) + 5
    assert layout.union_up_supported(m, d, f, budget), case
    y0, res0, h0 = train_binding.train_forward(x, act, wg, wu, wd, max_entries=budget, tensor_cores=True)
    need = int(res0.seg_start[-1])  # entries past it are unwritten
    value = lambda bits: np.asarray(bits).astype(np.uint16).view(np.dtype(dtype)).astype(np.float32)
    for down in (False, True):
        y1, res1, h1 = train_binding.train_forward(x, act, wg, wu, wd, max_entries=budget, tensor_cores=True, up_union=True,
                                                down_union=down)
        what = f"{case} down_union={down}"
        for name in ("seg_start", "tok_off", "col_off"):
            np.testing.assert_array_equal(_bits(getattr(res1, name)), _bits(getattr(res0, name)), f"{what} {name}")
        np.testing.assert_array_equal(_bits(res1.entries)[:need], _bits(res0.entries)[:need], f"{what} entries")
        defined = emu.by_col_defined(jax.tree.map(np.asarray, res0))
        np.testing.assert_array_equal(_bits(res1.by_col)[defined], _bits(res0.by_col)[defined], f"{what} by_col")
        u1, u0 = value(_bits(res1.up)[:need]), value(_bits(res0.up)[:need])
        np.testing.assert_allclose(u1, u0, rtol=2.0**-7, atol=1e-6, err_msg=f"{what} u")
        assert np.mean(u1 == u0) > 0.9, what  # most u round the same
        w1, w0 = _bits(h1)[:need], _bits(h0)[:need]
        np.testing.assert_array_equal(w1 & 0xFFFF, w0 & 0xFFFF, f"{what} h word low halves")
        np.testing.assert_allclose(value(w1 >> 16), value(w0 >> 16), rtol=2.0**-6, atol=1e-6, err_msg=f"{what} h")
        assert_close(y1, y0, 2.0**-7, what)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("case", UP_UNION_CASES, ids=lambda c: f"m{c[0]}_d{c[1]}_f{c[2]}_{c[4]}")
def test_dh_union_matches_dh_step(case, gated, dtype):
    """The backward's dh step as a union product (``train_backward(dh_union=True)``): dh
    (row 0 of the partials) equals the per-entry step's sum of partials at every entry with
    g != 0 to the f32 summation order (flagged entries of overflowed tiles included); h
    bit for bit; the other coefficients, dx and the weight gradients to that order."""
    m, d, f, density, pattern, full, empty = case
    x, wg, wu, wd, dy = make_case(m, d, f, density, pattern, gated, full=full, empty=empty, key=m + d + 17,
                                  dtype=dtype)
    w_act = wg if gated else wu
    act = pack_twell_reference(relu_matmul(x, w_act), tile=256, capacity=32)
    budget = bemu.needed_entries(np.asarray(act.counts), 32, 256, act.f) + 5
    assert layout.union_up_supported(m, d, f, budget), case
    _, res, _ = train_binding.train_forward(x, act, w_act, wu if gated else None, wd, max_entries=budget, tensor_cores=True)
    need = int(res.seg_start[-1])
    l1 = jnp.float32(L1 / m)
    kw = dict(tile=256, workspace=True, tensor_cores=True, dx_tensor_cores=True, dx_union=d % 256 == 0)
    step = train_binding.train_backward(x, dy, wg, wu, wd, res, l1, **kw)
    union = train_binding.train_backward(x, dy, wg, wu, wd, res, l1, dh_union=True, **kw)
    words = np.asarray(res.entries)[:need]
    fired = ((words >> 16) & 0x7FFF) != 0
    if full:
        assert (fired & ((words & bemu.RECOMPUTE_FLAG) != 0)).any(), "flagged entries with g != 0"
    # f32 sums of d products in two orders (~2^-21 of the largest dh apart in a NumPy model of
    # both orders at d=2048); a lost, doubled or misplaced entry is off by a whole dh.
    dh_step = np.asarray(step[-2], np.float64)[:, :need].sum(axis=0)[fired]
    assert_close(np.asarray(union[-2])[0, :need][fired], dh_step, 2.0**-14, f"{case} dh")
    coef, coef_step = np.asarray(union[-1])[:, :need], np.asarray(step[-1])[:, :need]
    np.testing.assert_array_equal(_bits(coef[0]), _bits(coef_step[0]), "h")
    for i in range(1, coef.shape[0]):
        assert_close(coef[i], coef_step[i], 2.0**-14, f"{case} coefficient {i}")
    # dx and the weight gradients: an element-type rounding apart at most. In f16 the largest
    # weight gradients of the M=2500, d=2048 case overflow to inf on both paths (the NumPy
    # model's too), so both are clipped to the largest finite value first.
    top = float(jnp.finfo(dtype).max)
    for i in range(len(step) - 2):
        clip = lambda a: np.clip(np.asarray(a, np.float64), -top, top)
        assert_close(clip(union[i]), clip(step[i]), 2.0**-7, f"{case} result {i}")


@pytest.mark.parametrize("stationary", [False, True], ids=["union_steps", "stationary_steps"])
def test_train_gradients_with_union_dx_match_dense(stationary):
    """ffn_with_aux(dx_union=True, down_union=True, up_union=True, dh_union=True, and the
    forward's down step and dx stationary or not) through jit and grad: the dense formula's
    gradients."""
    x, wg, wu, wd, dy = make_case(3000, 512, 1408, 0.01, "heavy", True, full=2, empty=3, key=23)
    fn = jax.jit(lambda *a: cuda_ffn_train(*a, width=128, dx_union=True, down_union=True, up_union=True, dh_union=True, down_stationary=stationary, dx_stationary=stationary, side=Side.SPARSE)[:2])
    step = jax.jit(lambda *a: grads_of(fn, *a))
    bits = [int(b) for b in re.findall(r"mma = (\d+) : i32", step.lower(x, wg, wu, wd, dy).as_text())]
    # the sparse side is traced once per backup size, each with a forward and a backward call
    branches = len(layout.train_backup_buckets(x.shape[0]))
    assert len(bits) == 2 * branches and all(((b & 16) != 0) == stationary for b in bits), bits  # bit 4
    (y, l1), grads = grads_of(fn, x, wg, wu, wd, dy)
    with jax.default_matmul_precision("highest"):
        (y_d, l1_d), g_d = grads_of(dense_ffn, x, wg, wu, wd, dy)
    for name, g, w in zip(["dx", "dw_gate", "dw_up", "dw_down"], grads, g_d):
        assert_close(g, w, GRAD_TOL, f"union dx: {name}")


@pytest.mark.parametrize("mma", [False, True], ids=["cudacore", "mma"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("spec", GPU_SPECS, ids=str)
def test_train_gradients_match_dense(spec, gated, mma):
    if spec.d % 64:
        pytest.skip("d not a multiple of 64 (a documented constraint of the training kernels)")
    x, wg, wu, wd, dy = make_case(spec.m, spec.d, spec.f, spec.density, spec.pattern, gated, key=spec.m + 3)
    fn = jax.jit(lambda *a: cuda_ffn_train(*a, width=128, side=Side.SPARSE, tensor_cores=mma)[:2])
    (y, l1), grads = grads_of(fn, x, wg, wu, wd, dy)
    with jax.default_matmul_precision("highest"):
        (y_d, l1_d), g_d = grads_of(dense_ffn, x, wg, wu, wd, dy)
    for name, g, w in zip(["dx", "dw_gate", "dw_up", "dw_down"], grads, g_d):
        if w is not None:
            assert g.dtype == jnp.bfloat16
            assert_close(g, w, GRAD_TOL, f"{spec} {name}")
    assert_close(y, y_d, GRAD_TOL, f"{spec} y")
    np.testing.assert_allclose(l1, l1_d, rtol=2e-2)


def test_train_deterministic_and_sparse_path_taken():
    x, wg, wu, wd, dy = make_case(3000, 512, 1408, 0.01, "heavy", True, full=2, empty=3, key=21)
    fn = jax.jit(lambda *a: cuda_ffn_train(*a, width=128, side=Side.SPARSE)[:2])
    hlo = jax.jit(jax.grad(lambda *a: fn(*a)[1], (0, 1, 2, 3))).lower(x, wg, wu, wd).as_text()
    assert "jax_twell_train_fwd_gated" in hlo and "jax_twell_train_bwd_gated" in hlo
    grad = jax.jit(lambda *a: grads_of(fn, *a)[1])
    first, second = grad(x, wg, wu, wd, dy), grad(x, wg, wu, wd, dy)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(_bits(a), _bits(b))


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_public_op_branches_and_leading_dims(gated):
    """sparse_ffn_train(implementation="cuda"): forced sparse, default rule, over budget
    (width 1 -> dense), leading dimensions: gradients as the reference's."""
    x, wg, wu, wd, dy = make_case(1500, 256, 1000, 0.02, "heavy", gated, full=2, empty=2, key=5)
    x3, dy3 = x.reshape(3, 500, 256), dy.reshape(3, 500, 256)

    def op(width, layer, *a):
        y, aux = sparse_ffn_train_for_layer(*a, implementation="cuda", layer=layer, options=TrainOptions(width=width))
        return y, aux.l1

    (y_r, l1_r), g_r = grads_of(lambda *a: train_reference.ffn_with_aux(*a, width=16, backup_capacity=None)[:2], x, wg, wu, wd, dy)
    forced = LayerInfo(side=Side.SPARSE)
    runs = {"forced": grads_of(functools.partial(op, 128, forced), x3, wg, wu, wd, dy3)}
    runs["over_budget"] = grads_of(functools.partial(op, 1, forced), x3, wg, wu, wd, dy3)
    runs["default_rule"] = grads_of(functools.partial(op, 128, LayerInfo()), x3, wg, wu, wd, dy3)
    for name, ((y, l1), grads) in runs.items():
        assert y.shape == x3.shape
        assert_close(y.reshape(x.shape), y_r, GRAD_TOL, f"{name} y")
        np.testing.assert_allclose(l1, l1_r, rtol=2e-2)
        assert grads[0].shape == x3.shape
        for g, r, n in zip(grads, g_r, ["dx", "dw_gate", "dw_up", "dw_down"]):
            if r is not None:
                assert_close(g.reshape(r.shape), r, GRAD_TOL, f"{name} {n}")


def test_small_for_sanitizer():
    """Small forward + backward (gated and not) for compute-sanitizer runs."""
    for gated in (True, False):
        x, wg, wu, wd, dy = make_case(1100, 128, 700, 0.02, "heavy", gated, full=2, empty=3, key=8)
        need, (y, res, h_source, bwd), (y_e, *_rest) = _raw(x, wg, wu, wd, dy, 128, 8)
        np.testing.assert_array_equal(_bits(y), _bits(y_e))
        assert all(np.isfinite(np.asarray(a, np.float32)).all() for a in bwd[:3])


def test_clear_errors():
    x = jnp.ones((4, 96), jnp.bfloat16)
    w = jnp.ones((96, 300), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 64"):
        jt.sparse_ffn_train(x, w, w, w.T, implementation="cuda")
