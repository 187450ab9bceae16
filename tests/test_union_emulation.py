"""The union products' layouts and products (NumPy model, jax_twell/ops/union_emulation.py) on the
training model's blocked entries: every sub-block's words, rows and chunk offsets inside the
workspace the handler allocates and disjoint from every other's, tight entry budgets and
overflowed tiles included; dx from the layout equals the model's dx to the rounding of the
coefficients to the element type."""

import jax.numpy as jnp
import numpy as np
import pytest

from jax_twell.formats import pack_twell_reference, relu_matmul
from jax_twell.ops import blocked_emulation as bemu
from jax_twell.ops import cuda_train
from jax_twell.ops import train_emulation as emu
from jax_twell.ops import union_emulation as uemu
from specs import assert_close
from test_train_emulation import L1, make_case

pytestmark = pytest.mark.slow  # the NumPy model of the union kernels: CI runs it (-m slow)

# m, d, f, density, pattern, full rows, empty rows, tile, capacity
CASES = [
    (1, 64, 260, 0.05, "uniform", 0, 0, 256, 32),
    (77, 64, 300, 0.05, "heavy", 3, 5, 256, 32),
    (77, 64, 300, 0.05, "heavy", 3, 5, 64, 4),  # many overflowed tiles
    (130, 32, 520, 0.5, "dense", 0, 0, 256, 32),  # unions of every neuron, M not a multiple of 64
    (1100, 64, 700, 0.02, "heavy", 4, 10, 256, 32),  # two blocks of 1024 tokens
    (200, 64, 70, 0.1, "uniform", 1, 1, 32, 1),  # f not a multiple of 32, one-slot tiles
]


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"m{c[0]}_f{c[2]}_{c[4]}_t{c[7]}")
def test_union_layout_fits_and_gives_dx(case, gated):
    m, d, f, density, pattern, full, empty, tile, capacity = case
    x, wg, wu, wd, dy = make_case(m, d, f, density, pattern, gated, full=full, empty=empty, key=m + f)
    w_act = wg if gated else wu
    act = pack_twell_reference(relu_matmul(x, w_act), tile=tile, capacity=capacity)
    e = bemu.needed_entries(np.asarray(act.counts), capacity, tile, act.f) + 5  # a tight budget
    _, res, _, _, _ = emu.train_forward(x, act.values, act.cols, act.counts, w_act, wu if gated else None,
                                        wu.T if gated else None, wd, tile=tile, max_entries=e)
    dx, *_, coef = emu.train_backward(x, dy, w_act.T, wu.T if gated else None, wd, res, L1 / m, tile=tile)
    lay = uemu.union_layout(res.seg_start, res.tok_off, res.entries, coef, m=m, f=f, tile=tile, max_entries=e,
                            gated=gated, dtype=jnp.bfloat16)  # asserts: in bounds, no word written twice
    assert lay["ws"].size == cuda_train.union_workspace_ints(m, e, gated)
    r = 2 if gated else 1
    nonzero = sum(int((np.asarray(coef[1 + i], np.float32).astype(jnp.bfloat16) != 0).sum()) for i in range(r))
    written = (lay["owner"][lay["ent0"]: lay["rows0"]] >= 0).sum()
    assert written == nonzero, "one word per non-zero coefficient"
    got = uemu.union_dx(lay, w_act.T, wu.T if gated else None, m, jnp.bfloat16)
    # Each coefficient rounded to bf16 (2^-9 relative) before a sum that may cancel (as the
    # tensor-core dx's test); a lost or doubled entry moves dx by a whole term.
    assert_close(got, dx, 2.0**-5, f"{case} gated={gated}")


def test_union_layout_over_budget_is_empty():
    """Past the entry budget (the call then runs dense) every sub-block has no chunks and
    its outputs are NaN."""
    m, f = 77, 300
    x, wg, wu, wd, dy = make_case(m, 64, f, 0.05, "heavy", True, full=3, key=5)
    act = pack_twell_reference(relu_matmul(x, wg), tile=256, capacity=32)
    need = bemu.needed_entries(np.asarray(act.counts), 32, 256, act.f)
    _, res, _, _, _ = emu.train_forward(x, act.values, act.cols, act.counts, wg, wu, wu.T, wd, tile=256,
                                        max_entries=need)
    coef = np.ones((3, need), np.float32)
    lay = uemu.union_layout(res.seg_start, res.tok_off, res.entries, coef, m=m, f=f, tile=256, max_entries=need - 1,
                            gated=True, dtype=jnp.bfloat16)
    assert (lay["ws"][0: 4 * lay["n_sub"]: 4] == 0).all() and (lay["ws"][3: 4 * lay["n_sub"]: 4] == 1).all()
    assert (lay["owner"][lay["ent0"]: lay["rows0"]] == -1).all()
    assert np.isnan(np.asarray(uemu.union_dx(lay, wg.T, wu.T, m, jnp.bfloat16), np.float32)).all()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"m{c[0]}_f{c[2]}_{c[4]}_t{c[7]}")
def test_union_layout_of_the_forward_down_step(case):
    """The forward's down step as a union product (one Wd row per neuron, the h words'
    values): y from the layout equals the model's y to the f32 summation order."""
    m, d, f, density, pattern, full, empty, tile, capacity = case
    x, wg, wu, wd, dy = make_case(m, d, f, density, pattern, True, full=full, empty=empty, key=m + f + 1)
    act = pack_twell_reference(relu_matmul(x, wg), tile=tile, capacity=capacity)
    e = bemu.needed_entries(np.asarray(act.counts), capacity, tile, act.f) + 5
    y, res, h_words, _, _ = emu.train_forward(x, act.values, act.cols, act.counts, wg, wu, wu.T, wd, tile=tile,
                                              max_entries=e)
    h = (np.asarray(h_words, np.uint32) >> 16).astype(np.uint16).view(jnp.bfloat16).astype(np.float32)
    lay = uemu.union_layout(res.seg_start, res.tok_off, h_words, np.stack([np.zeros_like(h), h]), m=m, f=f,
                            tile=tile, max_entries=e, gated=False, dtype=jnp.bfloat16)
    assert lay["ws"].size <= (d // bemu.UP_COLS) * e or not cuda_train.union_down_supported(m, d, f, e)
    got = uemu.union_dx(lay, wd, None, m, jnp.bfloat16)
    assert_close(got, y, 2.0**-7, f"{case}")


# d a multiple of 64 (the model's up sums go by 64 columns); the last: unions of ~700
# neurons outside overflowed tiles, three 256-neuron tiles per sub-block.
UP_CASES = [c for c in CASES if c[1] % bemu.UP_COLS == 0] + [(130, 64, 700, 0.1, "uniform", 0, 0, 256, 32)]


def _gated_up_layout(case, *, key: int, fired: bool):
    """The gated model's forward on ``case`` with a tight budget, and the word-pair layout of
    the up step (``fired=False``) or of the backward's dh step (``fired=True``), which
    asserts that every word lands inside the workspace and none twice."""
    m, d, f, density, pattern, full, empty, tile, capacity = case
    x, wg, wu, wd, dy = make_case(m, d, f, density, pattern, True, full=full, empty=empty, key=key)
    act = pack_twell_reference(relu_matmul(x, wg), tile=tile, capacity=capacity)
    need = bemu.needed_entries(np.asarray(act.counts), capacity, tile, act.f)
    e = need + 5
    _, res, _, _, _ = emu.train_forward(x, act.values, act.cols, act.counts, wg, wu, wu.T, wd, tile=tile,
                                        max_entries=e)
    lay = uemu.union_layout(res.seg_start, res.tok_off, res.entries, None, m=m, f=f, tile=tile, max_entries=e,
                            gated=True, dtype=jnp.bfloat16, up=True, fired=fired)
    assert lay["ws"].size == uemu.up_workspace_ints(m, e)
    return x, wg, wu, wd, dy, res, need, e, lay


@pytest.mark.parametrize("case", UP_CASES, ids=lambda c: f"m{c[0]}_f{c[2]}_{c[4]}_t{c[7]}")
def test_union_layout_of_the_up_step(case):
    """The up step as a union product (``kEntryIndex``): one word pair per entry outside an
    overflowed tile and none for the others, every sub-block's pairs, rows and chunk offsets
    disjoint inside the workspace; u from the layout equals the model's up residual to its
    rounding, for every such entry exactly once."""
    m, d, f, density, pattern, full, empty, tile, capacity = case
    x, wg, wu, wd, dy, res, need, e, lay = _gated_up_layout(case, key=m + f + 2, fired=False)
    assert uemu.up_supported(m, 64 * 8, f, e) == (e + e % 2 + lay["ws"].size <= 8 * e)
    normal = (np.asarray(res.entries)[:need] & bemu.RECOMPUTE_FLAG) == 0
    assert (lay["owner"][lay["ent0"]: lay["rows0"]] >= 0).sum() == 2 * normal.sum(), "one pair per entry"
    u = uemu.union_up(lay, x, wu.T, e)
    assert not np.isnan(u[:need][normal]).any() and np.isnan(u[:need][~normal]).all() and np.isnan(u[need:]).all()
    want = np.asarray(res.up)[:need][normal].astype(np.uint16).view(jnp.bfloat16).astype(np.float32)
    got = u[:need][normal].astype(jnp.bfloat16).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=2.0**-7, atol=1e-6)  # one rounding to bf16 apart at most


@pytest.mark.parametrize("case", UP_CASES, ids=lambda c: f"m{c[0]}_f{c[2]}_{c[4]}_t{c[7]}")
def test_union_layout_of_the_dh_step(case):
    """The backward's dh step as a union product (``kFiredIndex``): one word pair per entry
    with g != 0, flagged entries of overflowed tiles included, none for the others; every
    sub-block's pairs inside the workspace and disjoint; dh from the layout (dy against Wd's
    rows) equals the model's per-entry dh to the f32 summation order, for every such entry
    exactly once."""
    m, d, f, density, pattern, full, empty, tile, capacity = case
    x, wg, wu, wd, dy, res, need, e, lay = _gated_up_layout(case, key=m + f + 3, fired=True)
    *_, partial, _ = emu.train_backward(x, dy, wg.T, wu.T, wd, res, L1 / m, tile=tile)
    words = np.asarray(res.entries)[:need]
    fired = ((words >> 16) & 0x7FFF) != 0
    flagged = (words & bemu.RECOMPUTE_FLAG) != 0
    if full:
        assert (fired & flagged).any(), "the case has flagged entries with g != 0"
    assert (lay["owner"][lay["ent0"]: lay["rows0"]] >= 0).sum() == 2 * fired.sum(), "one pair per fired entry"
    dh = uemu.union_up(lay, dy, wd, e)
    assert not np.isnan(dh[:need][fired]).any() and np.isnan(dh[:need][~fired]).all()
    want = np.asarray(partial, np.float64)[:, :need].sum(axis=0)[fired]
    # f32 sums of exact products in two orders: apart by a few f32 roundings of the row's terms
    assert_close(dh[:need][fired], want, 2.0**-18, f"dh {case}")
