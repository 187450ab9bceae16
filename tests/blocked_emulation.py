"""NumPy model of the token-blocked TwELL FFN kernels (ffi/twell_ffn_blocked.cu).

It follows the kernels' layout, indexing and f32 operation order step by step, so that
(1) the algorithm is checked against :func:`jax_twell.ops.ffn.reference.twell_ffn` on any
machine, and (2) on a GPU the kernels' workspace and output can be compared with it bit
for bit. Every product below is of two 2-byte floats, exact in f32, so ``fma(a, b, s)``
equals ``float32(s + a * b)`` and the sums are reproduced exactly.

Layout (constants from jax_twell.ops.layout, checked against the CUDA headers):

- Token blocks of ``BLOCK_TOKENS`` rows; block ``b`` holds tokens ``[b*BT, (b+1)*BT)``.
- Each (token t, tile k) reserves ``r(t, k)`` entries: its stored count when
  ``count <= capacity``, else the tile width (an overflowed tile is recomputed for all of
  its columns; most come out zero).
- Entries are laid out by segment ``s = b * n_tiles + k`` (block-major, tile, then token
  in order, each token's entries in column order): ``seg_start[s]`` is the segment's
  first entry, ``seg_start[-1]`` the total. ``tok_off[b, k, i]`` (``i`` in
  ``[0, BT]``) is the exclusive prefix of ``r`` over the segment's tokens.
- An entry is one uint32: bits 0-7 the column within the tile (tiles hold at most 256
  columns), bits 8-12 the token's index modulo 32 (its row within the 32-token run of the
  block that one warp of the up and down steps owns), bit 15 set for an entry of an
  overflowed tile, bits 16-31 the value bits (g, then h after the up step).
- ``partial[r, e]`` (gated): the up dot product of entry ``e`` over model columns
  ``[r*UP_COLS, (r+1)*UP_COLS)``, summed by ``UP_LANES`` lanes of ``UP_COLS/UP_LANES``
  columns each and combined by a butterfly (xor 4, 2, 1).
- When the total exceeds the workspace (``max_entries``) nothing past it is written and
  y comes out NaN (the op checks the total first and never lets that happen).
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from jax_twell.ops.layout import (  # the kernels' constants, checked against ffi/
    BLOCK_TOKENS,
    COLUMN_MASK,
    DOWN_COLS,
    MAX_TILE,
    RECOMPUTE_FLAG,
    UP_COLS,
    UP_LANES,
    WORD_TOKEN_SHIFT,
)

_F32 = np.float32


@dataclasses.dataclass
class Workspace:
    seg_start: np.ndarray  # [n_blocks * n_tiles + 1] int32
    tok_off: np.ndarray  # [n_blocks, n_tiles, BLOCK_TOKENS + 1] int32
    entries: np.ndarray  # [max_entries] uint32
    partial: np.ndarray | None  # [d // UP_COLS, max_entries] f32 (gated; zero where unused)


def _np_dtype(dtype) -> np.dtype:
    name = np.dtype(dtype).name
    return {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}[name]


def _round(v: np.ndarray, dt: np.dtype) -> np.ndarray:
    return np.asarray(v, _F32).astype(dt).astype(_F32)


def _bits(v: np.ndarray, dt: np.dtype) -> np.ndarray:
    return np.asarray(v, _F32).astype(dt).view(np.uint16).astype(np.uint32)


def _from_bits(b: np.ndarray, dt: np.dtype) -> np.ndarray:
    return np.asarray(b, np.uint16).view(dt).astype(_F32)


def reserved(counts: np.ndarray, capacity: int, tile: int, f: int) -> np.ndarray:
    """``[M, n_tiles]`` entries reserved per (token, tile)."""
    n_tiles = counts.shape[1]
    width = np.minimum(tile, f - tile * np.arange(n_tiles))
    return np.where(counts > capacity, width[None, :], counts).astype(np.int64)


def layout(counts: np.ndarray, capacity: int, tile: int, f: int):
    """K0a + K0b: (seg_start [n_blocks*n_tiles + 1], tok_off [n_blocks, n_tiles, BT + 1])."""
    m, n_tiles = counts.shape
    n_blocks = -(-m // BLOCK_TOKENS)
    r = np.zeros((n_blocks * BLOCK_TOKENS, n_tiles), np.int64)
    r[:m] = reserved(counts, capacity, tile, f)
    r = r.reshape(n_blocks, BLOCK_TOKENS, n_tiles).transpose(0, 2, 1)  # [b, k, i]
    tok_off = np.zeros((n_blocks, n_tiles, BLOCK_TOKENS + 1), np.int64)
    tok_off[..., 1:] = np.cumsum(r, axis=-1)
    seg_len = tok_off[..., -1].reshape(-1)
    seg_start = np.zeros(seg_len.size + 1, np.int64)
    seg_start[1:] = np.cumsum(seg_len)
    return seg_start.astype(np.int32), tok_off.astype(np.int32)


def needed_entries(counts: np.ndarray, capacity: int, tile: int, f: int) -> int:
    """Entries the blocked layout needs for these TwELL ``counts``: each (token, tile) its
    count, an overflowed one (count past ``capacity``) its tile's whole width."""
    return int(reserved(counts, capacity, tile, f).sum())


def token_bits(tok: np.ndarray) -> np.ndarray:
    """The entry word's token field: ``(token % 32) << WORD_TOKEN_SHIFT``."""
    return ((np.asarray(tok, np.int64) % 32) << WORD_TOKEN_SHIFT).astype(np.uint32)


def _entry_table(seg_start, tok_off, counts, capacity: int, tile: int, f: int):
    """Per reserved entry, in entry order: (index, token, tile, slot, overflowed)."""
    m, n_tiles = counts.shape
    r = reserved(counts, capacity, tile, f)
    t, k = np.meshgrid(np.arange(m), np.arange(n_tiles), indexing="ij")
    start = seg_start[(t // BLOCK_TOKENS) * n_tiles + k].astype(np.int64) + tok_off[t // BLOCK_TOKENS, k, t % BLOCK_TOKENS]
    rep = r.reshape(-1)
    first = np.repeat(start.reshape(-1), rep)
    slot = np.arange(rep.sum()) - np.repeat(np.cumsum(rep) - rep, rep)
    tok = np.repeat(t.reshape(-1), rep)
    tk = np.repeat(k.reshape(-1), rep)
    over = np.repeat((counts > capacity).reshape(-1), rep)
    index = first + slot
    order = np.argsort(index, kind="stable")
    return index[order], tok[order], tk[order], slot[order], over[order]


def blocked_ffn(x, values, cols, counts, w_act, w_up, w_up_t, w_down, *, tile: int, max_entries: int):
    """y and the workspace, as the kernels compute them.

    x ``[M, d]``; values/cols ``[M, n_tiles, capacity]``; counts ``[M, n_tiles]``;
    w_act, w_up ``[d, f]``; w_up_t ``[f, d]``; w_down ``[f, d]`` (w_up, w_up_t None:
    non-gated). 2-byte float dtypes (bf16, f16).
    """
    dt = _np_dtype(x.dtype)
    x = np.asarray(x).astype(_F32)
    m, d = x.shape
    f = w_act.shape[1]
    values_bits = np.asarray(values).view(np.uint16).astype(np.uint32)
    cols = np.asarray(cols).astype(np.int64)
    counts = np.asarray(counts).astype(np.int64)
    n_tiles, capacity = values_bits.shape[1], values_bits.shape[2]
    gated = w_up is not None
    w_act = np.asarray(w_act).astype(_F32)
    w_down = np.asarray(w_down).astype(_F32)
    if gated:
        w_up = np.asarray(w_up).astype(_F32)
        w_up_t = np.asarray(w_up_t).astype(_F32)

    seg_start, tok_off = layout(counts, capacity, tile, f)
    total = int(seg_start[-1])
    entries = np.zeros(max_entries, np.uint32)
    index, tok, tk, slot, over = _entry_table(seg_start, tok_off, counts, capacity, tile, f)
    keep = index < max_entries  # nothing is written past the workspace

    # K0c: stored entries (g bits, column) of tiles within capacity; flagged placeholders
    # (column only) for every column of an overflowed tile.
    normal = ~over
    s_norm = np.minimum(slot, capacity - 1)
    word = np.where(normal, (values_bits[tok, tk, s_norm] << 16) | cols[tok, tk, s_norm], RECOMPUTE_FLAG | slot)
    word = word | token_bits(tok)
    entries[index[keep]] = word[keep].astype(np.uint32)

    # Recompute: exact h for every column of an overflowed tile (sequential f32 dots, as
    # one thread per column computes them).
    rec = np.nonzero(over & keep)[0]
    if rec.size:
        neuron = tk[rec] * tile + slot[rec]
        xr = x[tok[rec]]
        pre = np.zeros(rec.size, _F32)
        up = np.zeros(rec.size, _F32)
        for i in range(d):
            pre = (pre + xr[:, i] * w_act[i, neuron]).astype(_F32)
            if gated:
                up = (up + xr[:, i] * w_up[i, neuron]).astype(_F32)
        g = _round(np.where(pre > 0, pre, 0), dt)
        h = _round(g * _round(up, dt), dt) if gated else g
        entries[index[rec]] = (_bits(h, dt) << 16) | RECOMPUTE_FLAG | token_bits(tok[rec]) | slot[rec].astype(np.uint32)

    partial = None
    if gated and total <= max_entries:
        # K1: partial up dots of the stored entries, per UP_COLS-column range.
        n_ranges = d // UP_COLS
        per_lane = UP_COLS // UP_LANES
        partial = np.zeros((n_ranges, max_entries), _F32)
        sel = np.nonzero(normal & keep)[0]
        e, t_sel = index[sel], tok[sel]
        neuron = tk[sel] * tile + (entries[e] & COLUMN_MASK)
        for r in range(n_ranges):
            lane_sums = np.zeros((UP_LANES, sel.size), _F32)
            for lane in range(UP_LANES):
                for v in range(per_lane):
                    col = r * UP_COLS + lane * per_lane + v
                    lane_sums[lane] = (lane_sums[lane] + x[t_sel, col] * w_up_t[neuron, col]).astype(_F32)
            for o in (4, 2, 1):
                lane_sums = (lane_sums + lane_sums[np.arange(UP_LANES) ^ o]).astype(_F32)
            partial[r, e] = lane_sums[0]
        # K1.5: h = round(g * round(sum over ranges in order)).
        u = np.zeros(sel.size, _F32)
        for r in range(n_ranges):
            u = (u + partial[r, e]).astype(_F32)
        g = _from_bits(entries[e] >> 16, dt)
        entries[e] = (_bits(g * _round(u, dt), dt) << 16) | (entries[e] & 0xFFFF)

    # K2: y[t] accumulates its entries tile by tile, in entry order, in f32.
    if total > max_entries:
        return np.full((m, d), np.nan, _F32).astype(dt), Workspace(seg_start, tok_off, entries, partial)
    acc = np.zeros((m, d), _F32)
    # Entry order is token-major within each (block, tile) and tiles ascend per token, so
    # visiting entries by (tile, slot) applies each token's entries in the kernel's order.
    order = np.lexsort((slot, tk))
    for k in range(n_tiles):
        for s in range(int(slot[tk == k].max(initial=-1)) + 1):
            sel = order[(tk[order] == k) & (slot[order] == s)]
            word = entries[index[sel]]
            h = _from_bits(word >> 16, dt)
            acc[tok[sel]] = (acc[tok[sel]] + h[:, None] * w_down[k * tile + (word & COLUMN_MASK)]).astype(_F32)
    return acc.astype(dt), Workspace(seg_start, tok_off, entries, partial)


__all__ = ["blocked_ffn", "layout", "needed_entries", "reserved", "token_bits", "Workspace"]
