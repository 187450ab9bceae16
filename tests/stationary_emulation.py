"""NumPy model of the down step with the weight stationary in shared memory
(ffi/twell_stationary.cuh, mma bit 4 of the gated blocked handler and of the training
forward; ffi/notes/limits.md, "A fourth family"), and of the same walk giving the training
backward's dx (:func:`dx`: a walk over Wact^T's rows, then, gated, one over Wu^T's rows
that adds the first walk's f32 sums once at the end).

The step reads the blocked layout's h entries (after the up step and Finish) and computes
``y[t] = sum_j h[t, j] Wd[j]`` with each CTA owning 16 output columns of every token (8
where f > 7,264: :func:`cols`). Its walk order is what this module models, so that a GPU
test can require the kernel's y bit for bit:

- per token ``c``, its reserved entries (the stored count per tile, or the tile's width
  where the tile overflowed), and ``key = ceil(c / 4)``;
- the tokens' ranks: a stable sort by key, descending (ties in token order); rank ``r``
  puts the token at place ``i = r % 16`` of group ``r // 16`` (a warp walks a group);
- the token's entries in the layout's order (tiles ascending, then as stored), each with
  its neuron ``n = tile_index * tile + column``; the ``q``-th entry of residue ``n % 4 = r``
  becomes step ``sum over r' of min(c_r', q + [(r' - i) % R < (r - i) % R])``, with ``c_r'``
  the token's entries of residue ``r'`` (rounds over the ``R`` residues, starting at
  ``i % R``; ``R`` = :func:`classes`, the neurons' residue is taken mod ``R``);
- per output column, f32 ``acc = fma(h, w, acc)`` over the steps in order, from 0, then one
  rounding to the element type. A product of two bf16 (or two f16) values is exact in f32,
  so the model's ``acc + h * w`` in float32 is the kernel's FMA.
"""

from __future__ import annotations

import numpy as np

import blocked_emulation as _blocked

from jax_twell.ops import layout

GROUP = layout.WALK_GROUP  # tokens walked together
CHUNK = layout.WALK_CHUNK  # tokens a CTA of the sort's passes
SMEM_LIMIT = layout.SMEM_LIMIT  # bytes of shared memory a CTA may have (H100/H200)
MAX_F16 = layout.WALK_MAX_F16  # the 16-column slice of Wd within shared memory: 7,264
MAX_F = layout.WALK_MAX_F  # the sort's per-warp key counts within shared memory: 14,524
UP_COLS = _blocked.UP_COLS
# The walk's sizes and the handlers' tests are production code: jax_twell.ops.layout.


def classes(f: int) -> int:
    """Residue classes of the walk's step order: a shared-memory phase reads four tokens'
    32-byte rows (16 columns: n mod 4 picks the slot) or eight tokens' 16-byte rows (n mod 8)."""
    return 4 if layout.walk_cols(f) == 16 else 8


def ranks(reserved_per_token: np.ndarray) -> np.ndarray:
    """``[M]`` each token's rank: stable sort by ``ceil(c / 4)``, descending."""
    key = (np.asarray(reserved_per_token, np.int64) + 3) // 4
    order = np.argsort(-key, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return rank


def steps(neurons: np.ndarray, place: int, classes: int = 4) -> np.ndarray:
    """Step of each of a token's entries (given in the layout's order) for the token at
    ``place`` of its group: rounds over the residues mod ``classes``, starting at
    ``place % classes``."""
    r = np.asarray(neurons, np.int64) % classes
    c = np.bincount(r, minlength=classes)
    q = np.zeros(r.size, np.int64)
    seen = np.zeros(classes, np.int64)
    for e, re in enumerate(r):
        q[e] = seen[re]
        seen[re] += 1
    delta = (np.arange(classes) - place) % classes
    out = np.zeros(r.size, np.int64)
    for r2 in range(classes):
        cap = q + (delta[r2] < delta[r]).astype(np.int64)
        out += np.minimum(c[r2], cap)
    return out


def token_entries(seg_start, tok_off, counts, *, capacity: int, tile: int, f: int):
    """Per token, the indices of its entries in the layout's order (tiles ascending, then
    as stored) and their neurons: ``(index [E], token [E], neuron [E])`` sorted by token,
    then walk order."""
    index, tok, tk, slot, over = _blocked._entry_table(
        np.asarray(seg_start), np.asarray(tok_off), np.asarray(counts), capacity, tile, f
    )
    del slot, over
    walk = np.lexsort((index, tok))
    return index[walk], tok[walk], tk[walk]


def _walk(tok: np.ndarray, neuron: np.ndarray, value: np.ndarray, table: np.ndarray, m: int, dt) -> np.ndarray:
    """The walk of S1-S6 over words ``(token, neuron, value)`` given per token in its
    layout order: ``[m, d]`` f32 sums, each row summed over the token's steps (``dt`` None),
    or rounded to ``dt``."""
    fv = table.shape[0]
    per_token = np.bincount(tok, minlength=m)
    rank = ranks(per_token)
    first = np.concatenate([[0], np.cumsum(per_token)])
    step = np.zeros(tok.size, np.int64)
    for t in range(m):
        a, b = first[t], first[t + 1]
        if b > a:
            step[a:b] = steps(neuron[a:b], int(rank[t] % GROUP), classes(fv))
    acc = np.zeros((m, table.shape[1]), np.float32)
    for s in range(int(step.max(initial=-1)) + 1):
        at = step == s
        # products of two element-type values are exact in f32: this add is the FMA
        acc[tok[at]] = (acc[tok[at]] + value[at, None] * table[neuron[at]]).astype(np.float32)
    return acc if dt is None else acc.astype(dt)


def down(entries, seg_start, tok_off, counts, w_down, *, capacity: int, tile: int, f: int, dtype) -> np.ndarray:
    """``y [M, d]`` (in ``dtype``) of the stationary down step from the blocked workspace's
    h entries (``entries``: uint32 words, h bits << 16 | flags, token bits and column)."""
    dt = _blocked._np_dtype(dtype)
    counts = np.asarray(counts)
    words = np.asarray(entries).astype(np.uint32)
    index, tok, tk = token_entries(seg_start, tok_off, counts, capacity=capacity, tile=tile, f=f)
    w = words[index]
    neuron = tk * tile + (w & _blocked.COLUMN_MASK).astype(np.int64)
    h = _blocked._from_bits((w >> 16).astype(np.uint16), dt)
    return _walk(tok, neuron, h, np.asarray(w_down).astype(np.float32), counts.shape[0], dt)


def dx(entries, coef, seg_start, tok_off, counts, w_act_t, w_up_t=None, *, capacity: int, tile: int, f: int,
       dtype) -> np.ndarray:
    """``dx [M, d]`` (in ``dtype``) of the training backward's stationary walk
    (``train_backward(dx_stationary=True)``): a walk over Wact^T's rows, one word an entry
    with the value ``coef[1]`` rounded to the element type; gated (``w_up_t`` given), a
    second walk over Wu^T's rows with ``coef[2]``, whose f32 sums get the first walk's added
    once, after their own steps: ``dx = round(sum_act + sum_up)``."""
    dt = _blocked._np_dtype(dtype)
    counts = np.asarray(counts)
    words = np.asarray(entries).astype(np.uint32)
    coef = np.asarray(coef, np.float32)
    index, tok, tk = token_entries(seg_start, tok_off, counts, capacity=capacity, tile=tile, f=f)
    neuron = tk * tile + (words[index] & _blocked.COLUMN_MASK).astype(np.int64)
    m = counts.shape[0]
    tables = [np.asarray(w_act_t)] + ([] if w_up_t is None else [np.asarray(w_up_t)])
    acc = None
    for r, table in enumerate(tables):
        value = coef[1 + r, index].astype(dt).astype(np.float32)
        sums = _walk(tok, neuron, value, table.astype(np.float32), m, None)
        acc = sums if acc is None else (acc + sums).astype(np.float32)
    return acc.astype(dt)
