"""Sparse activation formats: TwELL (inference) and Hybrid ELL + dense backup (training).

Both formats hold a ReLU activation ``a = relu(x @ w)`` of shape ``[..., M, f]`` (``M``
tokens, ``f`` hidden neurons) whose entries are mostly exact zeros. Both are registered
pytrees (their arrays are leaves, their sizes static metadata), so they pass through
``jit``, ``vmap`` and ``shard_map`` like arrays.

Nothing is lost. Each format has a fixed capacity, so its arrays have static shapes; a
tile or row that holds more non-zeros than fit keeps its *true count*, which flags it.
A consumer that owns the source ``(x, w)`` recomputes flagged parts exactly (the fused
kernels do), and ``to_dense(x=..., w=...)`` does the same. Called without the source,
``to_dense`` fills flagged parts with NaN, so a missing recomputation can never pass for
a result.

The functions here are the pure-JAX reference implementations: they define what the
CUDA kernels must produce, bit for bit for the packing (entries in ascending column
order, unused slots zero).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = [
    "TwELL",
    "Hybrid",
    "pack_twell_reference",
    "pack_hybrid_reference",
    "hybrid_from_row_twell",
    "relu_matmul",
]


def relu_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``relu(x @ w)`` rounded to ``x.dtype``, the activation every format holds.

    Args:
      x: ``[..., M, d]`` bf16 or f32.
      w: ``[d, f]`` same dtype as ``x``.
    Returns:
      ``[..., M, f]`` of ``x.dtype``; products accumulate in f32.
    """
    # In x.dtype: XLA accumulates in f32 and rounds once, and relu commutes with that
    # rounding; an f32 result would cost a 4-byte write and read of the whole [M, f].
    return jax.nn.relu(jnp.matmul(x, w))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TwELL:
    """Tile-wise ELLPACK: per (row, tile of ``tile`` columns) up to ``capacity`` non-zeros.

    The ``f`` columns are cut into ``n_tiles = ceil(f / tile)`` tiles (the last may be
    partial). Each (row, tile) keeps its first ``capacity`` non-zeros in ascending column
    order, so a matmul epilogue can write its own tile with no cross-block coordination.

    Fields:
      values: ``[..., M, n_tiles, capacity]`` activation dtype (bf16 or f32); unused
        slots are 0.
      cols: ``[..., M, n_tiles, capacity]`` int16, column *within the tile*
        (global column = tile_index * tile + cols); unused slots are 0.
      counts: ``[..., M, n_tiles]`` int32, the true number of non-zeros of the tile.
        ``counts > capacity`` flags a tile whose entries past ``capacity`` are not
        stored: consumers recompute that tile exactly from the source ``(x, w)``.
      f: number of columns (static).
      tile: tile width in columns (static), a multiple of 32.

    Memory per row: ``n_tiles * (capacity * (itemsize + 2) + 4)`` bytes; with the
    defaults (tile 256, capacity 32, bf16) that is 1/8 of the dense row plus counts.
    """

    values: jax.Array
    cols: jax.Array
    counts: jax.Array
    f: int = dataclasses.field(metadata=dict(static=True))
    tile: int = dataclasses.field(metadata=dict(static=True))

    @property
    def capacity(self) -> int:
        return self.values.shape[-1]

    @property
    def n_tiles(self) -> int:
        return self.values.shape[-2]

    @property
    def overflowed(self) -> jax.Array:
        """``[..., M, n_tiles]`` bool: tiles whose non-zeros exceed the capacity."""
        return self.counts > self.capacity

    def nnz_per_row(self) -> jax.Array:
        """``[..., M]`` int32: true non-zeros per row (stored or not)."""
        return self.counts.sum(axis=-1)

    def to_dense(self, x: jax.Array | None = None, w: jax.Array | None = None) -> jax.Array:
        """The dense activation ``[..., M, f]``.

        Args:
          x, w: the source, ``a = relu(x @ w)`` with x ``[..., M, d]`` and w ``[d, f]``.
            When given, overflowed tiles are recomputed exactly; when omitted they come
            out as NaN (never silently wrong).
        """
        valid = jnp.arange(self.capacity) < self.counts[..., None]
        vals = jnp.where(valid, self.values, jnp.zeros((), self.values.dtype))
        lead = self.values.shape[:-1]
        flat_vals = vals.reshape(-1, self.capacity)
        flat_cols = self.cols.reshape(-1, self.capacity).astype(jnp.int32)
        rows = jnp.arange(flat_vals.shape[0])[:, None]
        dense_tiles = (
            jnp.zeros((flat_vals.shape[0], self.tile), self.values.dtype)
            .at[rows, flat_cols]
            .add(flat_vals)
            .reshape(*lead, self.tile)
        )
        over = self.overflowed[..., None]
        if x is not None and w is not None:
            source = _pad_columns(relu_matmul(x, w), self.n_tiles * self.tile)
            source = source.reshape(*lead, self.tile)
            dense_tiles = jnp.where(over, source, dense_tiles)
        else:
            dense_tiles = jnp.where(over, jnp.full((), jnp.nan, dense_tiles.dtype), dense_tiles)
        return dense_tiles.reshape(*lead[:-1], self.n_tiles * self.tile)[..., : self.f]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Hybrid:
    """Row-wise ELL with a dense backup for rows past the ELL width (training format).

    Fields:
      values: ``[..., M, width]`` activation dtype: the row's first ``min(count, width)``
        non-zeros in ascending column order, then zeros.
      cols: ``[..., M, width]`` int32 global column of each entry; unused slots 0.
      counts: ``[..., M]`` int32 true non-zeros of the row. Rows with
        ``counts <= width`` are complete in the ELL part.
      backup_values: ``[..., B, f]`` dense copies of the first ``B`` rows (in row order)
        whose count exceeds ``width``; zero where unused.
      backup_rows: ``[..., B]`` int32 row index of each backup slot, ``M`` where unused.
      f: number of columns (static).

    A row with ``counts > width`` is read from the backup; when more rows overflow than
    the backup holds (``n_overflow > B``), the rows left out are flagged and must be
    recomputed from the source (the training op then runs its dense path, which is
    faster at such densities anyway).
    """

    values: jax.Array
    cols: jax.Array
    counts: jax.Array
    backup_values: jax.Array
    backup_rows: jax.Array
    f: int = dataclasses.field(metadata=dict(static=True))

    @property
    def width(self) -> int:
        return self.values.shape[-1]

    @property
    def backup_capacity(self) -> int:
        return self.backup_values.shape[-2]

    @property
    def rows_over_width(self) -> jax.Array:
        """``[..., M]`` bool: rows not held by the ELL part."""
        return self.counts > self.width

    @property
    def n_overflow(self) -> jax.Array:
        """``[...]`` int32: rows over the ELL width (may exceed the backup capacity)."""
        return self.rows_over_width.sum(axis=-1, dtype=jnp.int32)

    @property
    def complete(self) -> jax.Array:
        """``[...]`` bool: every row is held (ELL or backup); nothing needs recomputing."""
        return self.n_overflow <= self.backup_capacity

    def to_dense(self, x: jax.Array | None = None, w: jax.Array | None = None) -> jax.Array:
        """The dense activation ``[..., M, f]``; see :meth:`TwELL.to_dense` for x, w."""
        fn = _hybrid_to_dense
        for _ in range(self.values.ndim - 2):
            fn = jax.vmap(fn)
        dense, missing = fn(self)
        if x is not None and w is not None:
            return jnp.where(missing[..., None], relu_matmul(x, w), dense)
        return jnp.where(missing[..., None], jnp.full((), jnp.nan, dense.dtype), dense)


def _hybrid_to_dense(h: Hybrid) -> tuple[jax.Array, jax.Array]:
    m = h.values.shape[0]
    fits = ~h.rows_over_width
    valid = (jnp.arange(h.width) < h.counts[:, None]) & fits[:, None]
    vals = jnp.where(valid, h.values, jnp.zeros((), h.values.dtype))
    dense = jnp.zeros((m, h.f), h.values.dtype).at[jnp.arange(m)[:, None], h.cols].add(vals)
    dense = dense.at[h.backup_rows].set(h.backup_values, mode="drop")
    in_backup = jnp.zeros((m,), bool).at[h.backup_rows].set(True, mode="drop")
    missing = h.rows_over_width & ~in_backup
    return dense, missing


def _pad_columns(a: jax.Array, width: int) -> jax.Array:
    pad = width - a.shape[-1]
    if pad == 0:
        return a
    return jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])


def _first_nonzeros(a: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """First ``k`` non-zeros of each row of ``a [..., n]`` in column order.

    Returns (values [..., k] zero-padded, columns [..., k] int32 zero-padded, count [...]).
    """
    nonzero = a != 0
    count = nonzero.sum(axis=-1, dtype=jnp.int32)
    # A stable sort on "is zero" puts the non-zeros first, in column order.
    order = jnp.argsort(~nonzero, axis=-1, stable=True)[..., :k].astype(jnp.int32)
    valid = jnp.arange(k) < count[..., None]
    vals = jnp.where(valid, jnp.take_along_axis(a, order, axis=-1), jnp.zeros((), a.dtype))
    return vals, jnp.where(valid, order, 0), count


def pack_twell_reference(a: jax.Array, *, tile: int = 256, capacity: int = 32) -> TwELL:
    """Reference TwELL packing of a dense activation ``a [..., M, f]`` (see :class:`TwELL`)."""
    f = a.shape[-1]
    n_tiles = -(-f // tile)
    tiles = _pad_columns(a, n_tiles * tile).reshape(*a.shape[:-1], n_tiles, tile)
    k = min(capacity, tile)
    vals, cols, counts = _first_nonzeros(tiles, k)
    if k < capacity:
        pad = [(0, 0)] * (vals.ndim - 1) + [(0, capacity - k)]
        vals, cols = jnp.pad(vals, pad), jnp.pad(cols, pad)
    return TwELL(vals, cols.astype(jnp.int16), counts, f=f, tile=tile)


def pack_hybrid_reference(a: jax.Array, *, width: int = 128, backup_capacity: int | None = None) -> Hybrid:
    """Reference Hybrid packing of a dense activation ``a [..., M, f]`` (see :class:`Hybrid`).

    ``backup_capacity`` defaults to ``M`` (every row can overflow; always complete).
    """
    f = a.shape[-1]
    k = min(width, f)
    vals, cols, counts = _first_nonzeros(a, k)
    if k < width:
        pad = [(0, 0)] * (vals.ndim - 1) + [(0, width - k)]
        vals, cols = jnp.pad(vals, pad), jnp.pad(cols, pad)
    return hybrid_with_backup(vals, cols, counts, a, backup_capacity)


def hybrid_from_row_twell(rows: TwELL, a: jax.Array, *, width: int, backup_capacity: int | None = None) -> Hybrid:
    """The Hybrid of ``a [..., M, f]`` from its TwELL packed with one tile per row.

    ``rows`` must come from packing ``a`` with ``tile >= f`` and ``capacity = min(width,
    tile)`` (one tile holds the row: its entries are the row's first non-zeros in column
    order and its count the row's count), which is how the CUDA pack kernel produces the
    ELL part; the dense backup is then gathered from ``a``.
    """
    if rows.n_tiles != 1 or rows.f != a.shape[-1]:
        raise ValueError(f"rows must hold one tile per row of f={a.shape[-1]} columns, got {rows.n_tiles} tiles of {rows.f}")
    vals, cols, counts = rows.values[..., 0, :], rows.cols[..., 0, :].astype(jnp.int32), rows.counts[..., 0]
    if vals.shape[-1] < width:
        pad = [(0, 0)] * (vals.ndim - 1) + [(0, width - vals.shape[-1])]
        vals, cols = jnp.pad(vals, pad), jnp.pad(cols, pad)
    return hybrid_with_backup(vals, cols, counts, a, backup_capacity)


def hybrid_with_backup(vals, cols, counts, a: jax.Array, backup_capacity: int | None) -> Hybrid:
    """Completes the ELL part ``(vals, cols [..., M, width], counts [..., M])`` of ``a``
    with its dense backup: the first ``backup_capacity`` rows (in row order) whose count
    exceeds the width (default capacity ``M``)."""
    m, f = a.shape[-2], a.shape[-1]
    width = vals.shape[-1]
    b = m if backup_capacity is None else backup_capacity
    over = counts > width
    order = jnp.argsort(~over, axis=-1, stable=True)[..., :b].astype(jnp.int32)
    if order.shape[-1] < b:  # backup larger than M: pad with unused slots
        order = jnp.pad(order, [(0, 0)] * (order.ndim - 1) + [(0, b - order.shape[-1])], constant_values=m)
    n_over = over.sum(axis=-1, dtype=jnp.int32)[..., None]
    slot_used = jnp.arange(b) < n_over
    backup_rows = jnp.where(slot_used, order, m)
    gathered = jnp.take_along_axis(a, jnp.minimum(order, m - 1)[..., None], axis=-2)
    backup_values = jnp.where(slot_used[..., None], gathered, jnp.zeros((), a.dtype))
    return Hybrid(vals, cols, counts, backup_values, backup_rows, f=f)
