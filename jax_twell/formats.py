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

Building a format by hand checks it: the constructors reject inconsistent static fields
and array shapes always, and, when every array is concrete (not traced under ``jit`` or
``vmap``), inconsistent contents too (``validate()`` runs the checks on demand). JAX
rebuilding a format from its leaves (tree maps, ``jit`` outputs) checks nothing, so the
checks cost nothing on a hot path.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "TwELL",
    "Hybrid",
    "pack_twell_reference",
    "pack_hybrid_reference",
    "hybrid_from_row_twell",
    "relu_matmul",
    "TILE_LIMIT",
]

TILE_LIMIT = 32768  # column offsets within a tile are int16


def _register(cls):
    """Registers the frozen dataclass `cls` as a pytree (static fields as metadata) whose
    unflattening bypasses the constructor's checks: JAX rebuilds formats with tracers,
    shape structs or arbitrary leaves, which are not user input."""
    data = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("static")]
    meta = [f.name for f in dataclasses.fields(cls) if f.metadata.get("static")]

    def flatten_with_keys(obj):
        return [(jax.tree_util.GetAttrKey(n), getattr(obj, n)) for n in data], tuple(getattr(obj, n) for n in meta)

    def flatten(obj):
        return [getattr(obj, n) for n in data], tuple(getattr(obj, n) for n in meta)

    def unflatten(static, leaves):
        obj = object.__new__(cls)
        for name, value in (*zip(data, leaves), *zip(meta, static)):
            object.__setattr__(obj, name, value)
        return obj

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    return cls


def _array_like(*xs) -> bool:
    return all(hasattr(x, "shape") and hasattr(x, "dtype") for x in xs)


def _concrete(*xs) -> bool:
    return all(isinstance(x, (np.ndarray, jax.Array)) and not isinstance(x, jax.core.Tracer) for x in xs)


def _require(ok, what: str, message: str) -> None:
    if not ok:
        raise ValueError(f"inconsistent {what}: {message}")


def _require_int_dtype(what: str, **arrays) -> None:
    for name, x in arrays.items():
        _require(jnp.issubdtype(x.dtype, jnp.integer), what, f"{name} must be integers, got {x.dtype}")


class _Checked:
    """The formats' construction-time checks: `_check(contents)` of the subclass runs on
    every direct construction, with `contents` only when all arrays are concrete."""

    def __post_init__(self):
        self._check(contents=_concrete(*(getattr(self, f.name) for f in dataclasses.fields(self)
                                         if not f.metadata.get("static"))))

    def validate(self):
        """Checks every field (contents included, so the arrays must be concrete); returns
        self. Raises ValueError naming the first inconsistency."""
        self._check(contents=True)
        return self

    def _check(self, contents: bool) -> None:
        raise NotImplementedError


def _ascending(cols: np.ndarray, used: np.ndarray) -> bool:
    """Whether the used slots (a prefix of each row) hold strictly ascending columns."""
    both = used[..., 1:] & used[..., :-1]
    return bool(np.all(np.where(both, np.diff(cols, axis=-1) > 0, True)))


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


@_register
@dataclasses.dataclass(frozen=True)
class TwELL(_Checked):
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

    def _check(self, contents: bool) -> None:
        what = "TwELL"
        _require(isinstance(self.f, int) and self.f >= 1, what, f"f must be a positive int, got {self.f!r}")
        _require(
            isinstance(self.tile, int) and self.tile >= 32 and self.tile % 32 == 0 and self.tile <= TILE_LIMIT,
            what, f"tile must be a positive multiple of 32 and at most {TILE_LIMIT}, got {self.tile!r}",
        )
        if not _array_like(self.values, self.cols, self.counts):
            return  # pytree stand-ins (specs, shardings): nothing to check
        shape = tuple(self.values.shape)
        _require(len(shape) >= 2, what, f"values must be [..., n_tiles, capacity], got shape {shape}")
        _require(tuple(self.cols.shape) == shape, what, f"cols shape {tuple(self.cols.shape)} != values shape {shape}")
        _require(
            tuple(self.counts.shape) == shape[:-1], what,
            f"counts shape {tuple(self.counts.shape)} != values shape without capacity {shape[:-1]}",
        )
        n_tiles = -(-self.f // self.tile)
        _require(
            shape[-2] == n_tiles, what,
            f"f={self.f} with tile={self.tile} needs {n_tiles} tiles, values hold {shape[-2]}",
        )
        _require(shape[-1] >= 1, what, "capacity must be at least 1")
        _require_int_dtype(what, cols=self.cols, counts=self.counts)
        if not contents:
            return
        cols, counts = np.asarray(self.cols).astype(np.int64), np.asarray(self.counts).astype(np.int64)
        widths = np.minimum(self.tile, self.f - np.arange(n_tiles) * self.tile)  # the last tile may be partial
        _require(counts.min(initial=0) >= 0, what, "counts must be >= 0")
        _require(np.all(counts <= widths), what, f"counts exceed the columns of their tile (tile={self.tile}, f={self.f})")
        used = np.arange(shape[-1]) < counts[..., None]
        _require(
            np.all(np.where(used, (cols >= 0) & (cols < widths[:, None]), True)), what,
            f"cols of stored entries must be in [0, tile) (and < f in the last tile), tile={self.tile}, f={self.f}",
        )
        _require(_ascending(cols, used), what, "stored entries must be in strictly ascending column order")

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


@_register
@dataclasses.dataclass(frozen=True)
class Hybrid(_Checked):
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

    def _check(self, contents: bool) -> None:
        what = "Hybrid"
        _require(isinstance(self.f, int) and self.f >= 1, what, f"f must be a positive int, got {self.f!r}")
        if not _array_like(self.values, self.cols, self.counts, self.backup_values, self.backup_rows):
            return
        shape = tuple(self.values.shape)
        _require(len(shape) >= 2 and shape[-1] >= 1, what, f"values must be [..., M, width >= 1], got shape {shape}")
        _require(tuple(self.cols.shape) == shape, what, f"cols shape {tuple(self.cols.shape)} != values shape {shape}")
        _require(tuple(self.counts.shape) == shape[:-1], what, f"counts shape {tuple(self.counts.shape)} != {shape[:-1]}")
        backup = tuple(self.backup_values.shape)
        _require(
            len(backup) == len(shape) and backup[:-2] == shape[:-2] and backup[-1] == self.f, what,
            f"backup_values must be [..., B, f={self.f}] with the leading axes of values {shape[:-2]}, got {backup}",
        )
        _require(
            tuple(self.backup_rows.shape) == backup[:-1], what,
            f"backup_rows shape {tuple(self.backup_rows.shape)} != {backup[:-1]}",
        )
        _require_int_dtype(what, cols=self.cols, counts=self.counts, backup_rows=self.backup_rows)
        if not contents:
            return
        m, width = shape[-2], shape[-1]
        cols, counts = np.asarray(self.cols).astype(np.int64), np.asarray(self.counts).astype(np.int64)
        rows = np.asarray(self.backup_rows).astype(np.int64)
        _require(counts.min(initial=0) >= 0 and counts.max(initial=0) <= self.f, what, f"counts must be in [0, f={self.f}]")
        used = (np.arange(width) < counts[..., None]) & (counts <= width)[..., None]
        _require(
            np.all(np.where(used, (cols >= 0) & (cols < self.f), True)), what,
            f"cols of stored entries must be in [0, f={self.f})",
        )
        _require(_ascending(cols, used), what, "stored entries must be in strictly ascending column order")
        _require(rows.min(initial=0) >= 0 and rows.max(initial=0) <= m, what, f"backup_rows must be in [0, M={m}] (M: unused)")
        slot_used = rows < m
        _require(
            _ascending(rows, slot_used) and np.all(slot_used[..., 1:] <= slot_used[..., :-1]), what,
            f"backup_rows must list rows in ascending order, then M={m} for unused slots",
        )
        over = np.take_along_axis(counts > width, np.clip(rows, 0, max(m - 1, 0)), axis=-1) if m else slot_used
        _require(np.all(over | ~slot_used), what, f"backup_rows may only hold rows whose count exceeds width={width}")

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
