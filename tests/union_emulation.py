"""NumPy model of the union products (ffi/twell_union_layout.cuh ``TwellUnionLayoutKernel``,
ffi/twell_union.cuh ``UnionProductKernel`` and ``UnionUpKernel``; ffi/notes/training_kernels.md
and twell_ffn_blocked.md): dx, the down steps, and the up step (``union_layout(up=True)``,
:func:`union_up`).

The layout kernel, per 64-token sub-block ``s`` of the backward's blocked entries:

- the union: neurons with a non-zero coefficient (rounded to the element type) at any of
  the sub-block's entries, in increasing order; a neuron's position ``p`` in it gives its
  ``R`` table rows ``R p + r`` (gated R = 2: row id ``2 j`` is Wact^T[j], ``2 j + 1`` is
  Wu^T[j]; non-gated R = 1: row id ``j``), padded with row id 0 to whole chunks of 32;
- one word per non-zero coefficient, ``bits << 16 | (R p + r) % 32 << 8 | token``, grouped
  by chunk ``(R p + r) // 32`` (inside a chunk the kernel's order is whatever its atomics
  give; the words land in distinct places, so the product does not depend on it; the
  model keeps entry order);
- placed in one int32 workspace by the entries before the sub-block, ``E_s`` (a union has
  at most as many neurons as its sub-block has entries): words from ``R E_s``, rows from
  ``R E_s + 32 s``, chunk offsets (absolute word indices) from ``R E_s // 32 + 2 s``, after
  a meta record per sub-block ``(chunks, row base, chunk base, over budget)``; past the
  entry budget every sub-block has no chunks and the product writes NaN (as the per-entry
  down steps do).

The product: per sub-block, ``A [64, 32 chunks]`` from the words (values in the element
type) times the gathered rows, summed exactly here (float64, one rounding to f32, then to
the element type); the kernel sums in f32 in its own order.
"""

from __future__ import annotations

import numpy as np

import blocked_emulation as _b

from jax_twell.ops import layout

TOKENS = layout.UNION_TOKENS  # tokens per sub-block (ffi/twell_union.h kTok)
CHUNK = layout.UNION_CHUNK  # union rows per chunk (kChunk)
COLS = layout.UNION_COLS  # output columns per consumer warp group (kCols): d must be a multiple
UP_COLS = _b.UP_COLS
UP_NEURONS = layout.UNION_UP_NEURONS  # the up product's union neurons per CTA (kUpNeurons)
# The layout's sizes and the handlers' tests are production code: jax_twell.ops.layout.

__all__ = ["TOKENS", "CHUNK", "COLS", "UP_NEURONS", "union_layout", "union_dx", "union_up"]


def union_layout(seg_start, tok_off, entries, coef, *, m: int, f: int, tile: int, max_entries: int, gated: bool,
                 dtype, up: bool = False, fired: bool = False) -> dict:
    """The layout kernel's workspace and, for checks, which sub-block wrote each word
    (``owner``, -1 where none did). ``coef``: the backward's ``[2 or 3, max_entries]`` f32
    coefficients; ``dtype``: the element type they are rounded to.

    ``up=True`` models the inference FFN's up step (``kEntryIndex``; ``coef`` and ``gated``
    unused, one row per neuron): every entry outside an overflowed tile, whatever its value,
    gives a word pair ``((R p) % 256 << 8 | token, entry index)``; the word range holds two
    words per entry and the chunk offsets count pairs. ``fired=True`` (with ``up``) models the
    training backward's dh step (``kFiredIndex``): the same pairs for every entry whose g is
    non-zero, entries of overflowed tiles included."""
    if up:
        gated = False
    r_per = 2 if gated else 1
    words_per = 2 if up else r_per
    seg_start = np.asarray(seg_start, np.int64)
    tok_off = np.asarray(tok_off, np.int64)
    entries = np.asarray(entries, np.uint32)
    if up and fired:  # non-zero where g (the word's top half, sign aside) is
        bits = [(((entries >> np.uint32(16)) & np.uint32(0x7FFF)) != 0).astype(np.uint32)]
    elif up:  # non-zero where the entry is outside an overflowed tile
        bits = [((entries & np.uint32(_b.RECOMPUTE_FLAG)) == 0).astype(np.uint32)]
    else:
        rounded = [np.asarray(coef[1 + r], np.float32).astype(dtype) for r in range(r_per)]
        bits = [c.view(np.uint16).astype(np.uint32) for c in rounded]
    n_sub = -(-m // TOKENS)
    n_tiles = tok_off.shape[1]
    size = layout.union_up_workspace_ints(m, max_entries) if up else layout.union_workspace_ints(m, max_entries, gated)
    ws = np.zeros(size, np.int64)
    owner = np.full(size, -1, np.int64)
    meta0 = 0
    ent0 = 4 * n_sub
    rows0 = ent0 + words_per * max_entries
    chunk0 = rows0 + r_per * max_entries + CHUNK * n_sub

    def put(index, value, sub):
        assert 0 <= index < size, (index, size)
        assert owner[index] == -1, f"word {index} written twice (sub-blocks {owner[index]} and {sub})"
        ws[index], owner[index] = value, sub

    over = seg_start[-1] > max_entries
    for sub in range(n_sub):
        b, t0 = divmod(sub * TOKENS, _b.BLOCK_TOKENS)
        found = []  # (entry, neuron, token within the sub-block)
        before = 0
        for k in range(n_tiles):
            if over:  # the kernel reads nothing past the budget
                break
            off = tok_off[b, k]
            base = seg_start[b * n_tiles + k]
            before += off[t0]
            for e in range(off[t0], off[t0 + TOKENS]):
                word = int(entries[base + e])
                t = (32 if e >= off[t0 + 32] else 0) + ((word >> _b.WORD_TOKEN_SHIFT) & 31)
                found.append((base + e, k * tile + (word & _b.COLUMN_MASK), t))
        ent_base = r_per * ((0 if over else seg_start[b * n_tiles]) + before)
        row_base = ent_base + CHUNK * sub
        chunk_base = ent_base // CHUNK + 2 * sub
        live = [(e, j, t) for e, j, t in found if any(bits[r][e] != 0 for r in range(r_per))]
        union = sorted({j for _, j, _ in live})
        pos = {j: p for p, j in enumerate(union)}
        n_rows = r_per * len(union)
        chunks = -(-n_rows // CHUNK)
        for p, j in enumerate(union):
            for r in range(r_per):
                put(rows0 + row_base + r_per * p + r, 2 * j + r if gated else j, sub)
        for i in range(n_rows, chunks * CHUNK):
            put(rows0 + row_base + i, 0, sub)
        words = [[] for _ in range(chunks)]
        for e, j, t in live:
            for r in range(r_per):
                if bits[r][e] != 0:
                    u = r_per * pos[j] + r
                    if up:
                        words[u // CHUNK].append(((u % UP_NEURONS) << 8 | t, e))
                    else:
                        words[u // CHUNK].append(int(bits[r][e]) << 16 | (u % CHUNK) << 8 | t)
        slot = ent_base
        for c in range(chunks):
            put(chunk0 + chunk_base + c, slot, sub)
            for w in words[c]:
                if up:
                    put(ent0 + 2 * slot, w[0], sub)
                    put(ent0 + 2 * slot + 1, w[1], sub)
                else:
                    put(ent0 + slot, w, sub)
                slot += 1
        put(chunk0 + chunk_base + chunks, slot, sub)
        for i, v in enumerate((0 if over else chunks, row_base, chunk_base, int(over))):
            put(meta0 + 4 * sub + i, v, sub)
    return dict(ws=ws, owner=owner, n_sub=n_sub, ent0=ent0, rows0=rows0, chunk0=chunk0, gated=gated, up=up)


def union_up(layout: dict, x, w_up_t, max_entries: int) -> np.ndarray:
    """u ``[max_entries]`` f32 from an ``up=True`` layout (the up product's output row; NaN
    where no pair points): per sub-block and 256-neuron tile of its union, x's 64 rows
    times the tile's rows of Wu^T (summed exactly, rounded once to f32), read at each
    pair's (token, column)."""
    ws = layout["ws"]
    x = np.asarray(x, np.float64)
    table = np.asarray(w_up_t, np.float64)
    u = np.full(max_entries, np.nan, np.float32)
    for sub in range(layout["n_sub"]):
        chunks, row_base, chunk_base, _ = ws[4 * sub: 4 * sub + 4]
        offsets = ws[layout["chunk0"] + chunk_base: layout["chunk0"] + chunk_base + chunks + 1]
        per_tile = UP_NEURONS // CHUNK
        for t0 in range(0, chunks, per_tile):  # one CTA per 256-neuron tile
            n = min(UP_NEURONS, (chunks - t0) * CHUNK)
            ids = ws[layout["rows0"] + row_base + t0 * CHUNK: layout["rows0"] + row_base + t0 * CHUNK + n]
            xs = x[sub * TOKENS: (sub + 1) * TOKENS]
            prod = (xs @ table[ids].T).astype(np.float32)  # [tokens, n]
            for p in range(offsets[t0], offsets[min(t0 + per_tile, chunks)]):
                word, e = int(ws[layout["ent0"] + 2 * p]), int(ws[layout["ent0"] + 2 * p + 1])
                assert np.isnan(u[e]), f"entry {e} given u twice"
                u[e] = prod[word & 0xFF, (word >> 8) & 0xFF]
    return u


def union_dx(layout: dict, w_act_t, w_up_t, m: int, dtype) -> np.ndarray:
    """dx ``[m, d]`` in ``dtype`` from the layout: per sub-block, A (the words' values) times
    the union's table rows, summed exactly."""
    ws = layout["ws"]
    tables = [np.asarray(w_act_t, np.float64)] + ([np.asarray(w_up_t, np.float64)] if layout["gated"] else [])
    d = tables[0].shape[1]
    dx = np.zeros((layout["n_sub"] * TOKENS, d), np.float64)
    for sub in range(layout["n_sub"]):
        chunks, row_base, chunk_base, over = ws[4 * sub: 4 * sub + 4]
        if over:
            dx[sub * TOKENS:(sub + 1) * TOKENS] = np.nan
        if chunks == 0:
            continue
        a = np.zeros((TOKENS, chunks * CHUNK), np.float64)
        lo = ws[layout["chunk0"] + chunk_base]
        hi = ws[layout["chunk0"] + chunk_base + chunks]
        for c in range(chunks):
            assert ws[layout["chunk0"] + chunk_base + c] <= ws[layout["chunk0"] + chunk_base + c + 1]
        for e in range(lo, hi):
            c = np.searchsorted(ws[layout["chunk0"] + chunk_base: layout["chunk0"] + chunk_base + chunks + 1], e,
                                side="right") - 1
            w = int(ws[layout["ent0"] + e])
            value = np.array([w >> 16], np.uint16).view(dtype)[0]
            col = c * CHUNK + ((w >> 8) & 0xFF)
            assert a[w & 0xFF, col] == 0, "two words at one place of A"
            a[w & 0xFF, col] = float(value)
        ids = ws[layout["rows0"] + row_base: layout["rows0"] + row_base + chunks * CHUNK]
        if layout["gated"]:
            rows = np.where((ids & 1)[:, None] == 1, tables[-1][ids >> 1], tables[0][ids >> 1])
        else:
            rows = tables[0][ids]
        dx[sub * TOKENS:(sub + 1) * TOKENS] = a @ rows
    return dx[:m].astype(np.float32).astype(dtype)
