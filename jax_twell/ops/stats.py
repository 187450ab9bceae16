"""Sparsity statistics: the training op's side outputs, and the counts a plan's
device-side choice reads from the gate activation (never what is computed, only how fast).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_twell.ops import layout

__all__ = [
    "FFNAux",
    "hidden_stats",
    "make_aux",
    "tile_widths",
    "tile_counts",
    "gate_counts",
    "sampled_gate_counts",
    "sampled_block_union",
    "block_union_fraction",
    "warp_rows_over",
    "warp_layout_fit",
]


class FFNAux(NamedTuple):
    """Side outputs of the training FFN.

    Attributes:
      l1: ``[]`` f32, the L1 term: mean over tokens of ``sum_f |h|`` (the per-token sum,
        as in the public training code; the paper's text writes a per-element mean,
        which is ``f`` times weaker). Differentiable; multiply by the coefficient.
      nnz_mean: ``[]`` f32, mean active neurons per token (``relu`` gate > 0).
      nnz_max: ``[]`` int32, max active neurons of any token.
      rows_over_capacity: ``[]`` int32, tokens with more active neurons than the sparse
        format's row width (they take the dense-backup path).
      neuron_fired: ``[f]`` bool, neuron active for at least one token.
    """

    l1: jax.Array
    nnz_mean: jax.Array
    nnz_max: jax.Array
    rows_over_capacity: jax.Array
    neuron_fired: jax.Array


def hidden_stats(h: jax.Array, active: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Local statistics of ``h [M, f]`` with pattern ``active [M, f]`` bool.

    Returns ``(l1 [] f32, counts [M] int32, fired [f] bool)``: the L1 term (mean over
    tokens of sum_f |h|), active neurons per token, neurons active for any token.
    """
    l1 = jnp.abs(h.astype(jnp.float32)).sum() / max(h.shape[0], 1)
    return l1, active.sum(axis=-1, dtype=jnp.int32), active.any(axis=0)


def make_aux(l1: jax.Array, counts: jax.Array, fired: jax.Array, width: int) -> FFNAux:
    """FFNAux from the L1 term, per-token active counts ``[M]`` and fired neurons ``[f]``."""
    return FFNAux(
        l1=l1,
        nnz_mean=counts.astype(jnp.float32).mean() if counts.shape[0] else jnp.float32(0),
        nnz_max=counts.max(initial=0),
        rows_over_capacity=(counts > width).sum(dtype=jnp.int32),
        neuron_fired=fired,
    )


def tile_widths(f: int, tile: int) -> jax.Array:
    """``[n_tiles]`` int32: columns of each tile (the last one may be narrower)."""
    n_tiles = -(-f // tile)
    return jnp.minimum(tile, f - tile * jnp.arange(n_tiles, dtype=jnp.int32))


def tile_counts(g: jax.Array, *, tile: int) -> jax.Array:
    """``[M, n_tiles]`` int32: the non-zeros of ``g [M, f]`` in each ``tile``-column tile
    (the last one may be narrower): the pack's per-tile counts before the capacity."""
    m, f = g.shape
    n_tiles = -(-f // tile)
    active = g != 0
    if n_tiles * tile != f:
        active = jnp.pad(active, ((0, 0), (0, n_tiles * tile - f)))
    return active.reshape(m, n_tiles, tile).sum(axis=-1, dtype=jnp.int32)


def gate_counts(g: jax.Array, *, tile: int, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What the dispatch needs from ``g [M, f]``, without packing it (one XLA reduction).

    Returns ``[]`` int32 each: active pairs (the pack's ``counts.sum()``), overflowed tiles
    (``overflowed.sum()``) and the entries the blocked kernel needs (stored entries, plus
    the whole width of each overflowed tile).
    """
    per_tile = tile_counts(g, tile=tile)
    over = per_tile > capacity
    return (
        per_tile.sum(dtype=jnp.int32),
        over.sum(dtype=jnp.int32),
        jnp.where(over, tile_widths(g.shape[1], tile), per_tile).sum(dtype=jnp.int32),
    )


def _gate_sample(g: jax.Array, rows: int, block: int = layout.UNION_TOKENS) -> jax.Array:
    """The rows of ``g [M, f]`` a per-call choice reads: all of them below ``2 * rows``,
    else ``max(1, rows // block)`` whole ``block``-row blocks evenly spaced, as
    ``[n_blocks, block, f]`` (``[1, M, f]`` for all rows)."""
    if rows <= 0 or block <= 0:
        raise ValueError(f"rows and block must be positive, got {rows} and {block}")
    m, f = g.shape
    if m < 2 * rows:
        return g[None]
    n_full = m // block
    n = max(1, min(n_full, rows // block))
    return g[: n_full * block].reshape(n_full, block, f)[:: n_full // n][:n]


def sampled_gate_counts(g: jax.Array, *, tile: int, capacity: int, rows: int) -> tuple[jax.Array, jax.Array]:
    """Estimates of :func:`gate_counts`' first two values (active pairs, overflowed tiles)
    from about ``rows`` rows of ``g [M, f]`` (whole 64-row blocks evenly spaced), scaled to
    M (``[]`` float32 each). Exact when ``M < 2 * rows``."""
    m, f = g.shape
    sample = _gate_sample(g, rows).reshape(-1, f)
    nnz, n_over, _ = gate_counts(sample, tile=tile, capacity=capacity)
    scale = m / max(sample.shape[0], 1)  # M = 0: nothing counted
    return nnz.astype(jnp.float32) * scale, n_over.astype(jnp.float32) * scale


def sampled_block_union(g: jax.Array, *, rows: int) -> jax.Array:
    """``[]`` float32: the mean fraction of the f neurons active for some token of a
    64-token block (what the union products read), from the same rows as
    :func:`sampled_gate_counts` (every block below ``2 * rows`` rows)."""
    block = layout.UNION_TOKENS
    m, f = g.shape
    if m == 0 or f == 0:
        return jnp.float32(0.0)
    sample = _gate_sample(g, rows, block)
    if m < 2 * rows and m >= block:  # all rows sampled: their whole blocks
        sample = g[: m // block * block].reshape(m // block, block, f)
    return (sample > 0).any(axis=1).mean(dtype=jnp.float32)


def block_union_fraction(g: jax.Array) -> jax.Array:
    """``[]`` float32: the mean over the full 64-token blocks of ``g [M, f]`` (the one
    partial block where M < 64) of the fraction of neurons active for some token of the
    block: a layer's ``LayerInfo.union_fraction``, measured on its gate activations."""
    return sampled_block_union(g, rows=max(g.shape[0], 1))


def warp_rows_over(g: jax.Array, *, tile: int = 256, capacity: int = 32,
                   row_budget: int = layout.WARP_ROW_BUDGET) -> tuple[jax.Array, jax.Array]:
    """The rows of ``g [M, f]`` the warp kernel leaves to its dense backup, and each row's
    active neurons: ``(over [M] bool, entries [M] int32)``. A row is over where it has more
    than ``row_budget`` active neurons or a ``tile``-neuron tile with more than
    ``capacity`` (the TwELL layout's)."""
    per_tile = tile_counts(g, tile=tile)
    entries = per_tile.sum(axis=-1)
    return jnp.any(per_tile > capacity, axis=-1) | (entries > row_budget), entries


def warp_layout_fit(g: jax.Array, *, tile: int = 256, capacity: int = 32,
                    row_budget: int = layout.WARP_ROW_BUDGET) -> jax.Array:
    """``[2]`` float32 of a layer's gate activation ``g [M, f]``: the fraction of its rows
    past the warp kernel's layout (:func:`warp_rows_over`) and the fraction of its
    (token, neuron) pairs in the rows that fit it: ``LayerInfo.overflow_fraction`` and
    ``LayerInfo.kept_fraction``."""
    m, f = g.shape
    if m == 0 or f == 0:
        return jnp.zeros((2,), jnp.float32)
    over, entries = warp_rows_over(g, tile=tile, capacity=capacity, row_budget=row_budget)
    kept = jnp.sum(jnp.where(over, 0, entries), dtype=jnp.float32) / (float(m) * f)
    return jnp.stack([over.mean(dtype=jnp.float32), kept])
