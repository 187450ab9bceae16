"""CPU checks of the warp path's row split (jax_twell/ops/warp.py): which rows the kernel
leaves to the dense backup, the backup's sizes, and the one switch that runs the kernel
with the backup or the dense FFN, with the kernel replaced by the reference (the CUDA kernels are checked against it in tests/test_cuda_ffn_warp.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_twell.formats import pack_twell_reference, relu_matmul
from jax_twell.ops import common, xla
from jax_twell.ops.ffn import warp
from jax_twell.testing import synthetic_ffn_inputs, with_extreme_rows


def test_backed_up_rows_are_those_past_capacity_or_budget():
    m, f = 6, 512
    a = np.zeros((m, f), np.float32)
    a[1, :40] = 1.0            # 40 in tile 0: past capacity 32
    a[2, ::8] = 1.0            # 64 entries, 32 a tile: fits capacity, at the budget
    a[3, ::7] = 1.0            # 74 entries: past a 64-entry budget
    a[4, 300:310] = 1.0        # 10 entries
    act = pack_twell_reference(jnp.asarray(a, jnp.bfloat16), tile=256, capacity=32)
    got = np.asarray(warp.backed_up(act, 64))
    assert got.tolist() == [False, True, False, True, False, False]
    assert np.asarray(warp.backed_up(act, 9)).tolist() == [False, True, True, True, True, False]


@pytest.mark.parametrize("m", [1, 7, 8, 100, 2048, 16384, 65536])
def test_backup_size(m):
    b = warp.backup_size(m)
    assert 1 <= b <= m and (b == m or b % 8 == 0)
    assert b >= min(m, -(-m // 8))


def test_supported():
    assert warp.supported(2048, jnp.bfloat16) and warp.supported(8, jnp.float16)
    assert not warp.supported(2056, jnp.bfloat16)
    assert not warp.supported(2044, jnp.bfloat16)
    assert not warp.supported(2048, jnp.float32)


_ref_rows = warp.ffn_rows_reference  # the warp kernel's contract: y, zeros on the rows it leaves


def _ref_gate(x, w, *, tile, capacity):
    return pack_twell_reference(relu_matmul(x, w), tile=tile, capacity=capacity)


def test_backup_buckets():
    assert warp.backup_buckets(2048) == (0, 32, 128, 512, 1024, 2048)
    assert warp.backup_buckets(8) == (0, 1, 2, 4, 8)
    for b in (1, 8, 64, 136, 4096):
        sizes = warp.backup_buckets(b)
        assert sizes[0] == 0 and sizes[-1] == b and list(sizes) == sorted(set(sizes))


@pytest.mark.parametrize("full", [0, 1, 2, 9, 33, 40, 41])
def test_ffn_from_gate_every_bucket_exact(full):
    """0 to 40 fully active rows of 300 (backup 40: the buckets 0, 1, 2, 10, 20, 40,
    then dense for the whole call): every row as the dense formula has it."""
    m, d, f = 300, 64, 512
    inp = with_extreme_rows(synthetic_ffn_inputs(jax.random.key(full), m, d, f, density=0.02,
                                                 dtype=jnp.float32), full=full)
    act = _ref_gate(inp.x, inp.w_gate, tile=256, capacity=32)
    assert warp.backup_size(m) == 40 and int(warp.backed_up(act, warp.ROW_BUDGET).sum()) == full
    want = np.asarray(xla.ffn(inp.x, inp.w_gate, inp.w_up, inp.w_down))
    y = jax.jit(lambda *a: warp.ffn_from_gate(*a, rows_kernel=_ref_rows))(inp.x, act, inp.w_gate, inp.w_up, inp.w_down)
    np.testing.assert_allclose(np.asarray(y), want, rtol=2e-5, atol=2e-5)



def test_likely_sparse_follows_the_sample():
    m, d, f = 4096, 128, 1024
    kw = dict(d=d, itemsize=2, tile=256, capacity=32, row_budget=warp.ROW_BUDGET, backup=warp.backup_size(m))
    for density, want in ((0.003, True), (0.3, False)):
        inp = synthetic_ffn_inputs(jax.random.key(1), m, d, f, density=density)
        assert bool(warp.likely_sparse(relu_matmul(inp.x, inp.w_gate), **kw)) == want, density
    past_backup = with_extreme_rows(synthetic_ffn_inputs(jax.random.key(2), m, d, f, density=0.003), full=m // 4)
    assert not bool(warp.likely_sparse(relu_matmul(past_backup.x, past_backup.w_gate), **kw))


def test_likely_sparse_with_the_device_backup_prices_by_the_rule():
    """The device backup's form: the sample's kept entries and backed-up rows priced by the
    rule's warp_seconds against its margin of dense (no cap at half the switch's backup).
    At M <= 256 the sample is every row, so the choice is the formula's on the exact counts."""
    from jax_twell.ops.costs import DenseCrossover
    from jax_twell.ops.stats import warp_rows_over

    m, d, f = 256, 128, 1024
    rule = DenseCrossover(warp_fixed_overhead=0.0, warp_pack_bandwidth=float("inf"))  # small shapes: no fixed costs
    kw = dict(d=d, itemsize=2, tile=256, capacity=32, row_budget=warp.ROW_BUDGET, backup=warp.backup_size(m))
    seen = set()
    for density, full in ((0.003, 0), (0.003, 8), (0.003, 40), (0.003, 120), (0.05, 0), (0.3, 0)):
        inp = with_extreme_rows(synthetic_ffn_inputs(jax.random.key(5), m, d, f, density=density), full=full)
        g = relu_matmul(inp.x, inp.w_gate)
        over, entries = (np.asarray(a) for a in warp_rows_over(g))
        kept, backed = float(np.where(over, 0, entries).sum()), float(over.sum())
        for transposed in (True, False):
            want = rule.warp_seconds(kept, backed, m, d, f, 2, transposed) < rule.margin * rule.dense_cost(m, d, f, 2)
            got = bool(warp.likely_sparse(g, rule=rule, transposed=transposed, **kw))
            assert got == want, (density, full, transposed)
            seen.add(got)
    assert seen == {True, False}  # both sides taken over the cases


@pytest.mark.parametrize("m", [1, 255, 256, 257, 4096, 16385, 131072])
def test_sample_rows_spread_over_the_call(m):
    idx = warp.sample_row_indices(m)
    n = min(m, warp.SAMPLE_ROWS)
    assert len(idx) == n and len(set(idx.tolist())) == n and idx.min() >= 0 and idx.max() < m
    if m > warp.SAMPLE_ROWS:
        stride = m // warp.SAMPLE_ROWS
        assert np.all(idx // stride == np.arange(n))  # one row in each block
        if stride > 1:
            assert len(set((idx % stride).tolist())) > 1  # not one fixed offset


@pytest.mark.parametrize("period,phase", [(2, 1), (16, 3), (64, 1)])
def test_likely_sparse_sees_periodic_dense_rows(period, phase):
    """Dense rows every ``period`` tokens (e.g. every other row): a sample at one fixed
    offset per block could miss all of them and send the call to the backup; the spread
    sample sees its share of them."""
    m, d, f = 4096, 128, 1024
    inp = synthetic_ffn_inputs(jax.random.key(9), m, d, f, density=0.003)
    g = relu_matmul(inp.x, inp.w_gate)
    kw = dict(d=d, itemsize=2, tile=256, capacity=32, row_budget=warp.ROW_BUDGET, backup=warp.backup_size(m))
    assert bool(warp.likely_sparse(g, **kw))  # sparse before the dense rows are put in
    dense = np.zeros(m, bool)
    dense[phase::period] = True
    g = jnp.where(jnp.asarray(dense)[:, None], jnp.ones_like(g), g)
    assert not bool(warp.likely_sparse(g, **kw))


@pytest.mark.parametrize("case", ["sparse", "one_full_row", "dense", "nan"])
def test_per_call_form_exact(case):
    """The per-call form with the kernels replaced by the reference, on each side it can
    take: the sample's dense side, the counts' sparse side (with a backed-up row), and a
    NaN of x (its check given as a function, run on the sparse side only)."""
    m, d, f = 1024, 64, 512
    inp = synthetic_ffn_inputs(jax.random.key(4), m, d, f, density=0.3 if case == "dense" else 0.003,
                               dtype=jnp.float32)
    if case == "one_full_row":
        inp = with_extreme_rows(inp, full=1)
    if case == "nan":
        inp = inp._replace(x=inp.x.at[5, 3].set(jnp.nan))
    fn = jax.jit(lambda x, *w: warp.sparse_ffn(x, *w, pack=pack_twell_reference, rows_kernel=_ref_rows,
                                               finite=lambda: jnp.all(jnp.isfinite(x))))
    y = np.asarray(fn(inp.x, inp.w_gate, inp.w_up, inp.w_down))
    want = np.asarray(xla.ffn(inp.x, inp.w_gate, inp.w_up, inp.w_down))
    np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-5)
    if case == "nan":
        assert np.isnan(y[5]).all() and np.isfinite(np.delete(y, 5, axis=0)).all()


@pytest.mark.parametrize("from_g", [False, True], ids=["pack", "from_g"])
@pytest.mark.parametrize("case", ["sparse", "many_full_rows", "dense", "nan_x", "nan_w_down", "ungated"])
def test_per_call_form_with_device_backup_exact(case, from_g):
    """The per-call form whose backup reads its row count on the device (no switch), with
    the kernels replaced by their contracts: any number of backed-up rows (here past the
    switch's largest size, which ran dense there), the sample's dense side, and the dense
    formula's NaN from x and from a weight; with the pack or with the rows listed from g."""
    m, d, f = 1024, 64, 512
    inp = synthetic_ffn_inputs(jax.random.key(6), m, d, f, density=0.3 if case == "dense" else 0.003,
                               dtype=jnp.float32)
    if case == "many_full_rows":
        inp = with_extreme_rows(inp, full=warp.backup_size(m) + 20)
    if case == "nan_x":
        inp = inp._replace(x=inp.x.at[5, 3].set(jnp.nan))
    if case == "nan_w_down":
        inp = inp._replace(w_down=inp.w_down.at[7, 2].set(jnp.nan))
    w_gate = None if case == "ungated" else inp.w_gate
    w_up_k = inp.w_up if w_gate is not None else None

    seen = []

    def rows_from_g(*args, **kwargs):  # the reference, noting that the sparse side took it
        seen.append("from_g")
        return warp.ffn_rows_from_g_reference(*args, **kwargs)

    def rows(*args, **kwargs):
        seen.append("pack")
        return _ref_rows(*args, **kwargs)

    def fn(x, wg, wu, wd):
        return warp.sparse_ffn(x, wg, wu, wd, pack=pack_twell_reference, rows_kernel=rows,
                               backup_kernel=warp.backup_rows_reference,
                               columns=lambda: common.finite_columns(wu if wg is not None else None, wd),
                               rows_from_g=rows_from_g if from_g else None)

    y = np.asarray(jax.jit(fn)(inp.x, w_gate, inp.w_up, inp.w_down))
    assert seen == ["from_g" if from_g else "pack"]  # traced once: the sparse side's rows step
    want = np.asarray(xla.ffn(inp.x, w_gate, inp.w_up, inp.w_down))
    assert np.array_equal(np.isnan(y), np.isnan(want))
    ok = np.isfinite(want)
    np.testing.assert_allclose(np.where(ok, y, 0), np.where(ok, want, 0), rtol=2e-5, atol=2e-5)
    if case == "nan_w_down":
        assert np.isnan(y[:, 2]).all()


def test_backup_rows_reference_fills_only_backed_up_rows():
    m, d, f = 64, 32, 512
    inp = with_extreme_rows(synthetic_ffn_inputs(jax.random.key(2), m, d, f, density=0.01, dtype=jnp.float32), full=3)
    g = relu_matmul(inp.x, inp.w_gate)
    act = pack_twell_reference(g, tile=256, capacity=32)
    left = np.asarray(warp.backed_up(act, warp.ROW_BUDGET))
    assert left.sum() == 3
    y = np.asarray(warp.backup_rows_reference(inp.x, g, act, inp.w_up, inp.w_down, jnp.full((m, d), 7.0)))
    assert np.all(y[~left] == 7.0)
    np.testing.assert_allclose(y[left], np.asarray(xla.ffn(inp.x, inp.w_gate, inp.w_up, inp.w_down))[left], rtol=2e-5,
                               atol=2e-5)


def test_the_default_backup_is_chosen_by_the_token_count(monkeypatch):
    """backup_rows_by_size: the wgmma backup from GEMM_BACKUP_MIN_TOKENS tokens, the
    mma.sync one below, with the arguments passed through."""
    calls = []

    def stand_in(name):
        def kernel(x, g, act, w_up, w_down, y, *, row_budget, w_act, chunk_rows):
            calls.append((name, y.shape[0], row_budget, w_act, chunk_rows))
            return y
        return kernel

    monkeypatch.setattr(warp, "backup_rows", stand_in("mma"))
    monkeypatch.setattr(warp, "backup_rows_gemm", stand_in("wgmma"))
    edge = warp.GEMM_BACKUP_MIN_TOKENS
    for m in (1, edge - 1, edge, 2 * edge):
        warp.backup_rows_by_size(None, None, None, None, None, jnp.zeros((m, 8)), row_budget=17, w_act="w")
    assert calls == [("mma", 1, 17, "w", None), ("mma", edge - 1, 17, "w", None),
                     ("wgmma", edge, 17, "w", None), ("wgmma", 2 * edge, 17, "w", None)]


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_rows_reference_puts_the_dense_formulas_nan_on_its_rows(gated):
    """ffn_rows' contract with ``columns``: the rows it computes carry the NaN of
    as_dense_nonfinite (rows of non-finite x, non-finite columns), the rows it leaves stay
    zero, an Inf already in y is kept, and without columns nothing is added."""
    m, d, f = 48, 64, 512
    inp = with_extreme_rows(synthetic_ffn_inputs(jax.random.key(9), m, d, f, density=0.02, dtype=jnp.float32), full=2)
    x = inp.x.at[3, 5].set(jnp.inf).at[7, 0].set(jnp.nan)
    # the sparse gate's activation in both forms (non-gated, it is the hidden itself)
    act = pack_twell_reference(relu_matmul(inp.x, inp.w_gate), tile=256, capacity=32)
    w_up_t = inp.w_up.T if gated else None
    cols = jnp.ones((d,), bool).at[11].set(False).at[40].set(False)
    plain = np.asarray(warp.ffn_rows_reference(x, act, w_up_t, inp.w_down))
    y = np.asarray(warp.ffn_rows_reference(x, act, w_up_t, inp.w_down, columns=cols))
    left = np.asarray(warp.backed_up(act, warp.ROW_BUDGET))
    assert left.sum() == 2 and not left[3] and not left[7]
    assert np.all(y[left] == 0) and np.all(plain[left] == 0)
    bad = np.zeros((m, d), bool)
    bad[[3, 7], :] = True
    bad[:, [11, 40]] = True
    bad[left] = False
    assert np.all(np.isnan(y[bad & np.isfinite(plain)]))
    assert np.array_equal(y[~bad], plain[~bad])
    # every Inf the sum already holds stays (the dense formula's sum has it too); none is added
    assert np.array_equal(np.isinf(y), np.isinf(plain))
    # a row with no entry sums nothing: its non-finite x shows only through columns
    empty = with_extreme_rows(inp, full=2, empty=1)
    xe = empty.x.at[2, 9].set(jnp.nan)
    act_e = pack_twell_reference(relu_matmul(empty.x, empty.w_gate), tile=256, capacity=32)
    assert int(act_e.counts[2].sum()) == 0
    assert np.all(np.asarray(warp.ffn_rows_reference(xe, act_e, w_up_t, empty.w_down))[2] == 0)
    assert np.all(np.isnan(np.asarray(warp.ffn_rows_reference(xe, act_e, w_up_t, empty.w_down, columns=cols))[2]))
    with pytest.raises(ValueError, match="columns must have shape"):
        warp.ffn_rows(inp.x.astype(jnp.bfloat16), act, None, inp.w_down.astype(jnp.bfloat16), columns=cols[:5])


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_rows_from_g_reference_is_the_packed_rows_reference(gated):
    """ffn_rows_from_g's contract: on rows whose tiles fit, the TwELL rows' contract of the
    same g; its counts are g's non-zeros a row (NaN counts, -0 does not); a row is left by
    the budget alone (a row crowding one tile past capacity stays), with and without the
    NaN rule."""
    m, d, f = 64, 32, 512
    inp = with_extreme_rows(synthetic_ffn_inputs(jax.random.key(4), m, d, f, density=0.02, dtype=jnp.float32), full=2)
    g = relu_matmul(inp.x, inp.w_gate)
    g = g.at[5, :40].set(1.0)  # 40 entries in the first tile (capacity 8 below), within the budget
    g = g.at[6].set(0.0).at[6, 3].set(-0.0).at[6, 9].set(jnp.nan)
    x = inp.x.at[9, 1].set(jnp.nan)
    act = pack_twell_reference(g, tile=256, capacity=8)
    w_up_t = inp.w_up.T if gated else None
    cols = jnp.ones((d,), bool).at[4].set(False)
    for columns in (None, cols):
        y, counts = warp.ffn_rows_from_g_reference(x, g, w_up_t, inp.w_down, columns=columns)
        counts = np.asarray(counts.counts)[:, 0]
        np.testing.assert_array_equal(counts, np.asarray(jnp.sum(act.counts, axis=-1)))
        assert counts[6] == 1 and counts[5] >= 40
        y = np.asarray(y)
        packed = np.asarray(warp.ffn_rows_reference(x, act, w_up_t, inp.w_down, row_budget=warp.ROW_BUDGET,
                                                    columns=columns))
        fits = ~np.asarray(warp.backed_up(act, warp.ROW_BUDGET))
        assert not fits[5] and counts[5] <= warp.ROW_BUDGET  # the packed rows leave it, g's keep it
        np.testing.assert_array_equal(np.isnan(y[fits]), np.isnan(packed[fits]))
        ok = np.isfinite(packed[fits])
        np.testing.assert_allclose(np.where(ok, y[fits], 0), np.where(ok, packed[fits], 0), rtol=1e-6, atol=1e-6)
        assert np.isnan(y[6]).all()  # the NaN entry's row
        assert np.all(y[counts > warp.ROW_BUDGET] == 0) and (counts > warp.ROW_BUDGET).sum() == 2
        assert np.abs(np.nan_to_num(y[5])).max() > 0
