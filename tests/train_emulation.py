"""NumPy model of the training FFN kernels (ffi/twell_train.cu).

It follows the kernels' layout, indexing and f32 operation order step by step, so that the
algorithm is checked against :func:`jax_twell.ops.ffn_train.reference.ffn_with_aux` on any machine,
and on a GPU the kernels' results and residuals can be compared with it bit for bit.

The forward builds on the inference model (``blocked_emulation``, whose
docstring describes the layout): y is the blocked kernel's y bit for bit (same h). What
training adds:

- entries keep the gate value g (recomputed exactly for overflowed tiles) and ``up`` keeps
  u at every entry (gated); ``h = round(g * u)`` is recomputed wherever needed.
- by column: per (block, tile) segment, the entries with g != 0 sorted stably by (column,
  token): ``col_off[b, k, c]`` is the exclusive prefix of the per-column counts and
  ``by_col[seg_start[s] + p] = token_in_block << 18 | entry_within_segment``.
- backward: dh partial dot products with the up step's lane structure (dy for x, Wd rows
  for Wu^T rows, every entry); ``dh = sum of partials + c sign(h)`` with ``c = dl1 / M``;
  coefficients ``(h, dh * u, dh * g)`` (non-gated: ``(h, dh)``); dx accumulated per token in
  entry order (tiles, then columns); weight gradients per neuron in token order, summed
  whole, or in a tile with a neuron over 3x the tile's mean strided over a warp's
  ``WARP_GROUPS`` groups (entry p to part p mod ``WARP_GROUPS``), and for a neuron holding
  over 1/16 of its tile's entries cut into ``GRAD_GROUPS`` equal consecutive parts; each
  part summed in token order, the parts added in a fixed tree.

Products of two 2-byte floats are exact in f32 (``fma == add``); products of an f32
coefficient with a 2-byte weight are not, and :func:`fma` evaluates them in float64 with a
single final rounding (equal to the hardware fma except for double-rounding ties, about
2^-29 per operation).
"""

from __future__ import annotations

import dataclasses

import numpy as np

import blocked_emulation as _b

from jax_twell.ops import layout

TOKEN_SHIFT = layout.TOKEN_SHIFT
GRAD_LANES = 8  # lanes of a weight-gradient group, 8 model columns each (kGradLanes)
GRAD_GROUPS = 256 // GRAD_LANES  # the weight-gradient kernel's groups per CTA (kGradGroups)
WARP_GROUPS = 32 // GRAD_LANES  # groups per warp (kWarpGroups)
HOT_SHARE = 16  # a neuron over 1/HOT_SHARE of its tile's entries is shared by all groups (kHotShare)
SPREAD_TILE = 3  # a non-hot neuron over SPREAD_TILE x its tile's mean makes the tile strided (kSpreadTile)
_F32 = np.float32
_F64 = np.float64

__all__ = ["TrainResiduals", "train_forward", "train_backward", "by_col_defined", "fma", "TOKEN_SHIFT"]


@dataclasses.dataclass
class TrainResiduals:
    seg_start: np.ndarray  # [n_blocks * n_tiles + 1] int32
    tok_off: np.ndarray  # [n_blocks, n_tiles, BLOCK_TOKENS + 1] int32
    entries: np.ndarray  # [max_entries] uint32: g bits << 16 | flag | column
    up: np.ndarray | None  # [max_entries] uint16: u bits (gated)
    col_off: np.ndarray  # [n_blocks, n_tiles, tile + 1] int32
    by_col: np.ndarray  # [max_entries] uint32


def fma(a, b, c) -> np.ndarray:
    """``fmaf(a, b, c)``: exact product and sum in float64, one rounding to f32."""
    return (np.asarray(a, _F64) * np.asarray(b, _F64) + np.asarray(c, _F64)).astype(_F32)


def _f32(a) -> np.ndarray:
    return np.asarray(a).astype(_F32)


def _up_partials(rows: np.ndarray, w_t: np.ndarray, tok: np.ndarray, neuron: np.ndarray) -> np.ndarray:
    """``[d / UP_COLS, n]`` f32: the up step's per-range dots of rows[tok] and w_t[neuron]."""
    d = rows.shape[1]
    per_lane = _b.UP_COLS // _b.UP_LANES
    out = np.zeros((d // _b.UP_COLS, tok.size), _F32)
    for r in range(d // _b.UP_COLS):
        lane_sums = np.zeros((_b.UP_LANES, tok.size), _F32)
        for lane in range(_b.UP_LANES):
            for v in range(per_lane):
                col = r * _b.UP_COLS + lane * per_lane + v
                lane_sums[lane] = (lane_sums[lane] + rows[tok, col] * w_t[neuron, col]).astype(_F32)
        for o in (4, 2, 1):
            lane_sums = (lane_sums + lane_sums[np.arange(_b.UP_LANES) ^ o]).astype(_F32)
        out[r] = lane_sums[0]
    return out


def _range_sum(partial: np.ndarray) -> np.ndarray:
    acc = np.zeros(partial.shape[1], _F32)
    for r in range(partial.shape[0]):
        acc = (acc + partial[r]).astype(_F32)
    return acc


def _entries_in_order(seg_start: np.ndarray, tok_off: np.ndarray, m: int):
    """Per entry position ``[0, total)``: (token, tile, slot within its (token, tile))."""
    n_blocks, n_tiles, _ = tok_off.shape
    b, k, i = np.meshgrid(np.arange(n_blocks), np.arange(n_tiles), np.arange(_b.BLOCK_TOKENS), indexing="ij")
    length = (tok_off[..., 1:] - tok_off[..., :-1]).astype(np.int64)
    start = seg_start[:-1].reshape(n_blocks, n_tiles, 1).astype(np.int64) + tok_off[..., :-1]
    rep = length.reshape(-1)
    first = np.repeat(start.reshape(-1), rep)
    slot = np.arange(rep.sum()) - np.repeat(np.cumsum(rep) - rep, rep)
    tok = np.repeat((b * _b.BLOCK_TOKENS + i).reshape(-1), rep)
    tile = np.repeat(k.reshape(-1), rep)
    pos = first + slot
    order = np.argsort(pos, kind="stable")
    assert np.array_equal(pos[order], np.arange(pos.size)) and (tok < m).all()
    return tok[order], tile[order], slot[order]


def _by_column(entries, seg_start, tok_off, tile: int, m: int):
    n_blocks, n_tiles, _ = tok_off.shape
    total = int(seg_start[-1])
    tok, tk, _slot = _entries_in_order(seg_start, tok_off, m)
    word = entries[:total]
    fired = ((word >> 16) & 0x7FFF) != 0
    col = (word & _b.COLUMN_MASK).astype(np.int64)
    seg = (tok // _b.BLOCK_TOKENS) * n_tiles + tk
    a = np.nonzero(fired)[0]
    hist = np.zeros((n_blocks * n_tiles, tile), np.int64)
    np.add.at(hist, (seg[a], col[a]), 1)
    col_off = np.zeros((n_blocks * n_tiles, tile + 1), np.int64)
    col_off[:, 1:] = np.cumsum(hist, axis=1)
    order = a[np.lexsort((a, col[a], seg[a]))]
    seg_o = seg[order]
    rank = np.arange(order.size) - np.searchsorted(seg_o, seg_o, side="left")
    by_col = np.zeros(entries.shape[0], np.uint32)
    local = order - seg_start[seg_o]
    by_col[seg_start[seg_o] + rank] = ((tok[order] % _b.BLOCK_TOKENS) << TOKEN_SHIFT | local).astype(np.uint32)
    return col_off.reshape(n_blocks, n_tiles, tile + 1).astype(np.int32), by_col


def by_col_defined(res: TrainResiduals) -> np.ndarray:
    """``[max_entries]`` bool: by_col slots the kernel writes (the rest is unwritten)."""
    n_seg = res.seg_start.size - 1
    used = res.col_off.reshape(n_seg, -1)[:, -1].astype(np.int64)
    mask = np.zeros(res.by_col.shape[0], bool)
    for s in np.nonzero(used)[0]:
        mask[res.seg_start[s] : res.seg_start[s] + used[s]] = True
    return mask


def train_forward(x, values, cols, counts, w_act, w_up, w_up_t, w_down, *, tile: int, max_entries: int):
    """``(y, TrainResiduals, h_source, l1, fired)`` as the forward handler and the XLA
    reductions around it compute them (w_up, w_up_t None: non-gated). The entries must
    fit ``max_entries`` (the op checks before calling)."""
    dt = _b._np_dtype(x.dtype)
    y, ws = _b.blocked_ffn(x, values, cols, counts, w_act, w_up, w_up_t, w_down, tile=tile, max_entries=max_entries)
    xf = _f32(x)
    m, d = xf.shape
    f = w_act.shape[1]
    gated = w_up is not None
    values_bits = np.asarray(values).view(np.uint16).astype(np.uint32)
    cols = np.asarray(cols).astype(np.int64)
    counts = np.asarray(counts).astype(np.int64)
    capacity = values_bits.shape[2]
    total = int(ws.seg_start[-1])
    if total > max_entries:
        raise ValueError(f"{total} entries do not fit max_entries={max_entries}")
    index, tok, tk, slot, over = _b._entry_table(ws.seg_start, ws.tok_off, counts, capacity, tile, f)
    normal = ~over
    s_norm = np.minimum(slot, capacity - 1)
    col = np.where(normal, cols[tok, tk, s_norm], slot)
    g_bits = values_bits[tok, tk, s_norm].copy()
    u = np.zeros(index.size, _F32)
    rec = np.nonzero(over)[0]
    if rec.size:  # recompute: one thread per column, sequential f32 dots over d
        neuron = tk[rec] * tile + slot[rec]
        wa = _f32(w_act)
        wu = _f32(w_up) if gated else None
        pre = np.zeros(rec.size, _F32)
        up = np.zeros(rec.size, _F32)
        for i in range(d):
            pre = (pre + xf[tok[rec], i] * wa[i, neuron]).astype(_F32)
            if gated:
                up = (up + xf[tok[rec], i] * wu[i, neuron]).astype(_F32)
        g_bits[rec] = _b._bits(np.where(pre > 0, pre, 0), dt)
        u[rec] = _b._round(up, dt)
    entries = np.zeros(max_entries, np.uint32)
    entries[index] = (g_bits << 16) | np.where(over, _b.RECOMPUTE_FLAG, 0).astype(np.uint32) | _b.token_bits(tok) | col.astype(np.uint32)
    g = _b._from_bits(g_bits, dt)
    up_bits = None
    if gated:
        u[normal] = _b._round(_range_sum(ws.partial[:, index[normal]]), dt)
        up_bits = np.zeros(max_entries, np.uint16)
        up_bits[index] = _b._bits(u, dt).astype(np.uint16)
        h = _b._round(g * u, dt)
        h_source = np.zeros(max_entries, np.uint32)
        h_source[index] = (_b._bits(h, dt) << 16) | (entries[index] & 0xFFFF)
    else:
        h, h_source = g, entries
    col_off, by_col = _by_column(entries, ws.seg_start, ws.tok_off, tile, m)
    res = TrainResiduals(ws.seg_start, ws.tok_off, entries, up_bits, col_off, by_col)
    l1 = _F32(np.abs(h.astype(_F64)).sum() / max(m, 1))
    fired = (np.diff(col_off, axis=-1) > 0).any(axis=0).reshape(-1)[:f]
    return y, res, h_source, l1, fired


def train_backward(x, dy, w_act_t, w_up_t, w_down, res: TrainResiduals, l1_grad: float, *, tile: int):
    """``(dx, dw_down, dw_act_t, dw_up_t, partial, coef)`` as the backward handler computes
    them; weight gradients in the [f, d] layout (w_up_t None: non-gated, dw_up_t None).
    ``l1_grad`` is the L1 cotangent divided by M."""
    dt = _b._np_dtype(x.dtype)
    xf, dyf, wdf = _f32(x), _f32(dy), _f32(w_down)
    wat = _f32(w_act_t)
    gated = w_up_t is not None
    wut = _f32(w_up_t) if gated else None
    m, d = xf.shape
    f = wdf.shape[0]
    e_max = res.entries.shape[0]
    total = int(res.seg_start[-1])
    tok, tk, slot = _entries_in_order(res.seg_start, res.tok_off, m)
    word = res.entries[:total]
    col = (word & _b.COLUMN_MASK).astype(np.int64)
    neuron = tk * tile + col
    fired = ((word >> 16) & 0x7FFF) != 0
    g = _b._from_bits(word >> 16, dt)

    # K1 Up on (dy, Wd): every entry.
    partial = np.zeros((d // _b.UP_COLS, e_max), _F32)
    partial[:, :total] = _up_partials(dyf, wdf, tok, neuron)

    # BwdFinish.
    c = _F32(l1_grad)
    dh = _range_sum(partial[:, :total])
    u = _b._from_bits(res.up[:total], dt) if gated else np.ones(total, _F32)
    h = _b._round(g * u, dt) if gated else g
    sign = np.sign(h).astype(_F32)
    dh = (dh + c * sign).astype(_F32)
    d_gate = (dh * u).astype(_F32) if gated else dh
    d_up = (dh * g).astype(_F32)
    coef = np.zeros((3 if gated else 2, e_max), _F32)
    coef[0, :total] = np.where(fired, h, 0)
    coef[1, :total] = np.where(fired, d_gate, 0)
    if gated:
        coef[2, :total] = np.where(fired, d_up, 0)

    # Dx: per token, its entries in order (tiles ascending, then slots).
    acc = np.zeros((m, d), _F32)
    for k in range(int(tk.max(initial=-1)) + 1):
        in_tile = np.nonzero((tk == k) & fired)[0]
        for s in np.unique(slot[in_tile]):
            sel = in_tile[slot[in_tile] == s]
            t = tok[sel]
            acc[t] = fma(coef[1, sel][:, None], wat[neuron[sel]], acc[t])
            if gated:
                acc[t] = fma(coef[2, sel][:, None], wut[neuron[sel]], acc[t])
    dx = acc.astype(dt)

    # WeightGrad: per neuron, its tokens in increasing order. A "hot" neuron (over
    # 1/HOT_SHARE of its tile's fired entries) is cut into GRAD_GROUPS equal consecutive
    # parts, each summed from zero; per warp of WARP_GROUPS parts a butterfly ((0+1)+(2+3)
    # for four), then the warps' sums in order. In a strided tile (a non-hot neuron over
    # SPREAD_TILE times the tile's mean) any other neuron is strided over one warp's
    # WARP_GROUPS groups (entry p to part p mod WARP_GROUPS), each part summed from zero, the
    # parts added in the same butterfly; in an even tile it is summed whole from zero.
    a = np.nonzero(fired)[0]
    a = a[np.lexsort((tok[a], neuron[a]))]
    nrn = neuron[a]
    n_tiles_all = -(-f // tile)
    per_neuron = np.bincount(nrn, minlength=n_tiles_all * tile)
    w_tile = per_neuron.reshape(n_tiles_all, tile).sum(axis=1)
    hot_neuron = HOT_SHARE * per_neuron > np.repeat(w_tile, tile)
    max_cold = np.where(hot_neuron, 0, per_neuron).reshape(n_tiles_all, tile).max(axis=1)
    width = np.minimum(tile, f - tile * np.arange(n_tiles_all))
    strided_neuron = np.repeat(max_cold * width > SPREAD_TILE * w_tile, tile)
    pos = np.arange(a.size) - np.searchsorted(nrn, nrn, side="left")
    cnt = per_neuron[nrn]
    hot_entry = hot_neuron[nrn]
    # hot: part = the last g with floor(cnt g / G) <= pos, rank = pos - floor(cnt part / G)
    hot_part = np.minimum((GRAD_GROUPS * (pos + 1) + cnt - 1) // np.maximum(cnt, 1) - 1, GRAD_GROUPS - 1)
    strided_entry = strided_neuron[nrn] & ~hot_entry
    part = np.where(hot_entry, hot_part, np.where(strided_entry, pos % WARP_GROUPS, 0))
    rank = np.where(hot_entry, pos - cnt * part // GRAD_GROUPS, np.where(strided_entry, pos // WARP_GROUPS, pos))
    key = nrn.astype(np.int64) * GRAD_GROUPS + part
    chunk_key, chunk = np.unique(key, return_inverse=True)
    chunk = chunk.reshape(-1)
    sums = [np.zeros((chunk_key.size, d), _F32) for _ in range(3)]
    for r in range(int(rank.max(initial=-1)) + 1):
        sel = a[rank == r]
        c = chunk[rank == r]
        t = tok[sel]
        sums[0][c] = fma(coef[0, sel][:, None], dyf[t], sums[0][c])
        sums[1][c] = fma(coef[1, sel][:, None], xf[t], sums[1][c])
        if gated:
            sums[2][c] = fma(coef[2, sel][:, None], xf[t], sums[2][c])
    chunk_neuron, chunk_part = chunk_key // GRAD_GROUPS, chunk_key % GRAD_GROUPS
    grads = [np.zeros((f, d), _F32) for _ in range(3)]
    kind = np.where(hot_neuron, 2, np.where(strided_neuron, 1, 0))[chunk_neuron]
    for side, n_parts in enumerate((1, WARP_GROUPS, GRAD_GROUPS)):  # whole, strided, hot
        mine = kind == side
        ids = np.unique(chunk_neuron[mine])
        slot = np.searchsorted(ids, chunk_neuron[mine])
        if n_parts == 1:
            for out, src in zip(grads, sums):  # one chunk per neuron, in neuron order
                out[ids] = src[mine]
            continue
        for out, src in zip(grads, sums):
            parts = np.zeros((ids.size, n_parts, d), _F32)
            parts[slot, chunk_part[mine]] = src[mine]
            warps = parts.reshape(ids.size, n_parts // WARP_GROUPS, WARP_GROUPS, d)
            o = 1
            while o < WARP_GROUPS:  # the butterfly within each warp's groups (group 0's view)
                warps = warps + warps[:, :, np.arange(WARP_GROUPS) ^ o]
                o *= 2
            total_h = warps[:, 0, 0]
            for w in range(1, n_parts // WARP_GROUPS):
                total_h = total_h + warps[:, w, 0]
            out[ids] = total_h
    a_down, a_act, a_up = grads
    # Rounded to the element type as the kernels store them: a sum past f16's range becomes
    # inf there too (the heavy-tailed f16 cases), which NumPy would otherwise warn about.
    with np.errstate(over="ignore"):
        dw_up_t = a_up.astype(dt) if gated else None
        return dx, a_down.astype(dt), a_act.astype(dt), dw_up_t, partial, coef
