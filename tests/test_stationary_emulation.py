"""The NumPy model of the down step with the weight stationary (stationary_emulation,
ffi/twell_stationary.cuh): its walk order and its y, on CPU."""

import ml_dtypes
import numpy as np

from jax_twell.ops import layout
import pytest

import blocked_emulation as emu
import stationary_emulation as stat


def _workspace(rng, m, f, tile, capacity, density, full=0, empty=0):
    """Counts, the blocked layout, and entry words with random h (bf16) and columns."""
    n_tiles = -(-f // tile)
    width = np.minimum(tile, f - tile * np.arange(n_tiles))
    counts = rng.binomial(width[None, :].repeat(m, 0), density).astype(np.int32)
    counts[:full] = width  # rows past capacity in every tile
    counts[full:full + empty] = 0
    seg_start, tok_off = emu.layout(counts, capacity, tile, f)
    index, tok, tk, slot, over = emu._entry_table(seg_start, tok_off, counts, capacity, tile, f)
    words = np.zeros(int(seg_start[-1]) + 3, np.uint32)
    # stored entries: distinct columns per (token, tile); overflowed tiles: every column
    cols = np.where(over, slot, 0)
    for t, k in {(int(a), int(b)) for a, b, o in zip(tok, tk, over) if not o}:
        sel = (tok == t) & (tk == k)
        cols[sel] = np.sort(rng.choice(width[k], sel.sum(), replace=False))
    h = rng.uniform(-2, 2, index.size).astype(ml_dtypes.bfloat16)
    words[index] = (h.view(np.uint16).astype(np.uint32) << 16) | np.where(over, emu.RECOMPUTE_FLAG, 0).astype(
        np.uint32) | emu.token_bits(tok % emu.BLOCK_TOKENS) | cols.astype(np.uint32)
    return counts, seg_start, tok_off, words


@pytest.mark.parametrize("m,f,tile,capacity,density,full,empty", [
    (1, 260, 256, 32, 0.05, 0, 0),
    (37, 300, 64, 4, 0.05, 2, 3),
    (1100, 700, 256, 8, 0.01, 3, 10),
    (50, 7300, 256, 8, 0.01, 1, 2),  # 8 columns a CTA, eight residue classes
])
def test_down_matches_the_exact_sum(m, f, tile, capacity, density, full, empty):
    rng = np.random.default_rng(m + f)
    d = 48
    counts, seg_start, tok_off, words = _workspace(rng, m, f, tile, capacity, density, full, empty)
    wd = rng.uniform(-1, 1, (f, d)).astype(ml_dtypes.bfloat16)
    y = stat.down(words, seg_start, tok_off, counts, wd, capacity=capacity, tile=tile, f=f, dtype=ml_dtypes.bfloat16)
    index, tok, tk = stat.token_entries(seg_start, tok_off, counts, capacity=capacity, tile=tile, f=f)
    hdense = np.zeros((m, f))
    w = words[index]
    hdense[tok, tk * tile + (w & emu.COLUMN_MASK)] = (w >> 16).astype(np.uint16).view(ml_dtypes.bfloat16).astype(
        np.float64)
    want = hdense @ wd.astype(np.float64)
    mag = np.abs(hdense) @ np.abs(wd.astype(np.float64))
    err = np.abs(y.astype(np.float64) - want)
    assert (err <= np.abs(want) * 2.0**-8 + mag * 2.0**-20 + 1e-30).all()
    assert (y[full:full + empty] == 0).all()  # empty rows
    assert not full or np.abs(y[:full].astype(np.float64)).sum() > 0  # the overflowed rows contribute


def test_steps_are_a_permutation_in_rounds_over_residues():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = np.sort(rng.choice(5632, rng.integers(0, 60), replace=False))
        place = int(rng.integers(0, 16))
        s = stat.steps(n, place)
        assert sorted(s.tolist()) == list(range(n.size))
        order = n[np.argsort(s)]
        # walking the steps: each residue's entries keep their order, and while every residue
        # has entries left, step j reads residue (place + j) % 4
        for r in range(4):
            np.testing.assert_array_equal(order[order % 4 == r], n[n % 4 == r])
        full_rounds = np.bincount(n % 4, minlength=4).min()
        j = np.arange(4 * full_rounds)
        np.testing.assert_array_equal(order[: 4 * full_rounds] % 4, (place + j) % 4)


def test_steps_spread_a_phase_over_slots():
    """The reason for the order: four tokens at places 0-3 of a group, at the same step, read
    rows of four different residues more often than in neuron order."""
    rng = np.random.default_rng(1)
    spread, plain = [], []
    for _ in range(300):
        rows = [np.sort(rng.choice(5632, 28, replace=False)) for _ in range(4)]
        ordered = [n[np.argsort(stat.steps(n, i))] for i, n in enumerate(rows)]
        spread.append(np.mean([len({int(o[j] % 4) for o in ordered}) == 4 for j in range(28)]))
        plain.append(np.mean([len({int(n[j] % 4) for n in rows}) == 4 for j in range(28)]))
    assert np.mean(spread) > 2 * np.mean(plain)


def test_ranks_sort_by_length_descending_and_stably():
    rng = np.random.default_rng(2)
    c = rng.integers(0, 400, 5000)
    rank = stat.ranks(c)
    order = np.empty_like(rank)
    order[rank] = np.arange(c.size)
    key = (c[order] + 3) // 4
    assert (np.diff(key) <= 0).all()
    same = np.diff(key) == 0
    assert (np.diff(order)[same] > 0).all()  # ties in token order


@pytest.mark.parametrize("m,f,tile,capacity,density,full,empty,gated", [
    (37, 300, 64, 4, 0.05, 2, 3, True),
    (1100, 700, 256, 8, 0.01, 3, 10, False),
    (50, 3700, 256, 8, 0.01, 1, 2, True),
    (50, 7300, 256, 8, 0.01, 1, 2, True),  # f past 7,264: 8 columns a CTA, eight residue classes
])
def test_dx_matches_the_exact_sum(m, f, tile, capacity, density, full, empty, gated):
    """The training backward's walks over Wact^T's rows and (gated) Wu^T's, the second adding
    the first's f32 sums, with the coefficients rounded to bf16: the exact sum to f32
    rounding."""
    rng = np.random.default_rng(m + f + 1)
    d = 40
    counts, seg_start, tok_off, words = _workspace(rng, m, f, tile, capacity, density, full, empty)
    coef = rng.uniform(-3, 3, (3 if gated else 2, words.size)).astype(np.float32)
    wa = rng.uniform(-1, 1, (f, d)).astype(ml_dtypes.bfloat16)
    wu = rng.uniform(-1, 1, (f, d)).astype(ml_dtypes.bfloat16) if gated else None
    got = stat.dx(words, coef, seg_start, tok_off, counts, wa, wu, capacity=capacity, tile=tile, f=f,
                  dtype=ml_dtypes.bfloat16)
    index, tok, tk = stat.token_entries(seg_start, tok_off, counts, capacity=capacity, tile=tile, f=f)
    n = tk * tile + (words[index] & emu.COLUMN_MASK)
    want, mag = np.zeros((m, d)), np.zeros((m, d))
    for r, table in enumerate([wa] + ([wu] if gated else [])):
        c = coef[1 + r, index].astype(ml_dtypes.bfloat16).astype(np.float64)
        terms = c[:, None] * table.astype(np.float64)[n]
        np.add.at(want, tok, terms)
        np.add.at(mag, tok, np.abs(terms))
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= np.abs(want) * 2.0**-8 + mag * 2.0**-20 + 1e-30).all()
    assert (got[full:full + empty] == 0).all()
    # two walks of f rows each: the columns a CTA owns follow f, up to 14,524 rows
    assert not layout.walk_supported(16384, 2040, 7264, 10**7, 2)  # 16 columns: 2040 is not a multiple
    assert layout.walk_supported(16384, 2040, 7265, 10**7, 2)  # 8 columns
    assert not layout.walk_supported(64, 2048, 14525, 10**6, 2) and layout.walk_supported(64, 2048, 14524, 10**6, 2)
    # gated, the first walk's f32 sums [m, d] need room in the partials [d / 64, max_entries]:
    # there at 128 entries a token (the default), not at 64
    assert layout.walk_supported(16384, 2048, 5632, 16384 * 128, 2)
    assert not layout.walk_supported(16384, 2048, 5632, 16384 * 64, 2)
    assert layout.walk_supported(16384, 2048, 5632, 16384 * 64, 1)


def test_layout_bound_holds():
    """The walk layout (64 words x the first key of each group of 16 ranks) fits the
    workspace's bound, max_entries + 3 M + 16 (f + 3), on lopsided rows."""
    rng = np.random.default_rng(3)
    for m, f in [(1, 7264), (17, 300), (5000, 5632)]:
        c = np.minimum(rng.pareto(0.8, m).astype(np.int64) * 7, f)
        key = np.sort((c + 3) // 4)[::-1]
        words = 64 * key[::stat.GROUP].sum()
        assert words <= c.sum() + 3 * m + 16 * (f + 3)


def test_supported():
    assert layout.stationary_down_supported(16384, 2048, 5632, 600_000)
    assert layout.stationary_down_supported(16384, 4096, 11008, 1_200_000)  # 8 columns a CTA past 7,264
    assert not layout.stationary_down_supported(16384, 2048, layout.WALK_MAX_F + 1, 600_000)  # slice or sort counts past shared memory
    assert not layout.stationary_down_supported(16384, 2056, 5632, 600_000)  # d not a multiple of 16
    assert layout.stationary_down_supported(4096, 2056, 8000, 600_000)  # ... of 8 where the CTA owns 8 columns
    assert not layout.stationary_down_supported(16384, 64, 5632, 600_000)  # one row of partials cannot hold it
    assert layout.WALK_MAX_F16 == 7264 and layout.WALK_MAX_F == 14524
    assert (layout.walk_cols(7264), layout.walk_cols(7265), stat.classes(7264), stat.classes(7265)) == (16, 8, 4, 8)
    # the sort's per-warp counts at the largest f fill shared memory exactly
    assert layout.walk_keys(layout.WALK_MAX_F) * 2 * stat.CHUNK // 32 == stat.SMEM_LIMIT


def test_steps_with_eight_classes_rotate_over_residues_mod_8():
    rng = np.random.default_rng(4)
    for _ in range(100):
        n = np.sort(rng.choice(11008, rng.integers(0, 90), replace=False))
        place = int(rng.integers(0, 16))
        s = stat.steps(n, place, 8)
        assert sorted(s.tolist()) == list(range(n.size))
        order = n[np.argsort(s)]
        full_rounds = np.bincount(n % 8, minlength=8).min()
        j = np.arange(8 * full_rounds)
        np.testing.assert_array_equal(order[: 8 * full_rounds] % 8, (place + j) % 8)
