"""The warp-per-token inference path: the gate packed as TwELL, then one warp per token
row reads only its active neurons' rows of ``w_up.T`` and ``w_down`` (ffi/twell_ffn_warp.cu),
and the rows that do not fit (a tile past capacity, or more entries than the row budget)
are gathered and computed by a dense tensor-core product over their rows (the backup).

Every row is exact either way: the kernel writes zeros over the rows it leaves and the
backup overwrites them. Two forms of the backup: :func:`backup_rows`, a kernel that reads
how many rows it has on the device (no conditional, no host round trip; any number of
rows), and the older ``lax.switch`` over static sizes (:func:`ffn_from_gate`), which runs
XLA's dense FFN for the whole call past its largest size.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_twell._kernels import dense_if_available, kernel_call  # noqa: F401  (dense_if_available re-exported)
from jax_twell.formats import TwELL, relu_matmul
from jax_twell.ops import stats, xla
from jax_twell.ops.common import as_dense_nonfinite
from jax_twell.ops.costs import DenseCrossover
from jax_twell.ops.layout import WARP_MAX_D as MAX_D  # noqa: F401  (the names the tests use)
from jax_twell.ops.layout import WARP_ROW_BUDGET as ROW_BUDGET
from jax_twell.ops.layout import GEMM_BACKUP_MIN_TOKENS, device_backup_supported  # noqa: F401  (re-exported)
from jax_twell.ops.layout import warp_backup_size as backup_size
from jax_twell.ops.layout import warp_supported as supported  # noqa: F401
from jax_twell.ops.pack.binding import pack_twell


def backed_up(act: TwELL, row_budget: int, row_entries: jax.Array | None = None) -> jax.Array:
    """``[M]`` bool: the rows the warp kernel leaves to the backup (the kernel's own rule:
    a tile past capacity, or more than ``row_budget`` entries). ``row_entries``: the rows'
    entry counts where the caller has them already."""
    counts = act.counts
    entries = jnp.sum(counts, axis=-1) if row_entries is None else row_entries
    return jnp.any(counts > act.capacity, axis=-1) | (entries > row_budget)


def backup_buckets(backup: int) -> tuple[int, ...]:
    """The sizes the backup runs at, smallest first: none, 1/64, 1/16, 1/4, 1/2 and all of
    its ``backup`` rows (deduplicated). A call runs the smallest that holds its rows, so a
    call with none pays nothing for the backup and one with a few rows a few rows' FFN."""
    return tuple(sorted({0, *(max(1, backup // k) for k in (64, 16, 4, 2)), backup}))


def _rows_or_dense(m: int, rows, backup: int, finite, kernel, dense_rows, dense):
    """One ``lax.switch`` over what the call runs: ``kernel()`` (y with zeros on ``rows``)
    and the smallest of :func:`backup_buckets` that holds ``rows`` (``[M]`` bool) filled by
    ``dense_rows(idx)`` (the dense FFN of rows ``idx``; M where unused), or ``dense()`` for
    the whole call where more than ``backup`` rows are left or ``finite`` (``[]`` bool) is
    false. y is made inside each branch (nothing is copied in or out of the switch)."""
    sizes = backup_buckets(backup)
    n_rows = jnp.sum(rows, dtype=jnp.int32)
    which = jnp.searchsorted(jnp.asarray(sizes, jnp.int32), n_rows).astype(jnp.int32)
    which = jnp.where(finite, which, len(sizes))

    def kernel_with(size: int):
        def branch(_):
            y = kernel()
            if size == 0:
                return y
            (idx,) = jnp.nonzero(rows, size=size, fill_value=m)
            return y.at[idx].set(dense_rows(idx).astype(y.dtype), mode="drop")
        return branch

    return jax.lax.switch(which, [kernel_with(size) for size in sizes] + [lambda _: dense()], None)


def _up_t(w_up, w_up_t):
    """``w_up.T`` as the kernel reads it: the kept copy, else transposed where the kernel
    runs (inside its branch, so a call on the dense side does not pay for it)."""
    return w_up.T if w_up_t is None else w_up_t


def _rows_of(a, idx):
    return a.at[idx].get(mode="fill", fill_value=0)


def _columns_mask(columns, d: int, op: str) -> jax.Array:
    """The warp kernels' ``columns`` operand: the weights' ``[d]`` finite columns as u8, or
    an empty array (no NaN rule in the kernel)."""
    if columns is None:
        return jnp.zeros((0,), jnp.uint8)
    if tuple(columns.shape) != (d,):
        raise ValueError(f"{op}: columns must have shape [d] = [{d}], got {tuple(columns.shape)}")
    return columns.astype(jnp.uint8)


def ffn_rows(x, act: TwELL, w_up_t, w_down, *, row_budget: int = ROW_BUDGET, skip=None, columns=None):
    """``jax_twell_ffn_warp[_gated]``: y for the rows that fit, zeros for the others.

    x: ``[M, d]`` bf16/f16; act: TwELL ``[M, n_tiles, capacity]`` of the activation;
    w_up_t: ``[f, d]`` (``w_up.T``; None for the non-gated FFN, where the activation is
    the hidden); w_down: ``[f, d]``. ``skip``: a device bool (the ``_unless`` handlers);
    where set the kernel's CTAs return at once and y holds anything (the per-call
    choice's dense side, where the backup writes every row). ``columns``: the weights'
    ``[d]`` bool :func:`~jax_twell.ops.common.finite_columns`; given, the rows the kernel
    computes carry the dense formula's NaN as
    :func:`~jax_twell.ops.common.as_dense_nonfinite` puts it (a row of non-finite x, the
    columns not finite), inside the kernel instead of a pass over y. Returns y ``[M, d]``
    (:func:`ffn_rows_reference` is the contract).
    """
    m, d = x.shape
    out = jax.ShapeDtypeStruct((m, d), x.dtype)
    attrs = dict(tile=np.int32(act.tile), max_entries=np.int32(row_budget))
    name = "jax_twell_ffn_warp" if w_up_t is None else "jax_twell_ffn_warp_gated"
    weights = (w_down,) if w_up_t is None else (w_up_t, w_down)
    mask = _columns_mask(columns, d, "ffn_rows")
    flag = () if skip is None else (jnp.asarray(skip).astype(jnp.int32),)
    return kernel_call(name if skip is None else name + "_unless", out, vmap_method="sequential")(
        x, act.values, act.cols, act.counts, *weights, mask, *flag, **attrs)


def ffn_rows_reference(x, act: TwELL, w_up_t, w_down, *, row_budget: int = ROW_BUDGET, skip=None, columns=None):
    """:func:`ffn_rows`' contract in XLA operations (its stand-in on the CPU): the TwELL
    FFN of the rows that fit, zeros on the rows left to the backup, the dense formula's
    NaN on the computed rows where ``columns`` is given. ``skip`` set: zeros everywhere
    (the kernel leaves y undefined; the backup writes every row). The sums run over the
    stored entries only, as the kernel's do: without ``columns`` a row with no entry is
    zero whatever its x (the dense reference's ``0 * NaN`` would make it NaN)."""
    a = act.to_dense(x, None)
    if w_up_t is not None:
        u = jnp.matmul(x, w_up_t.T, preferred_element_type=jnp.float32).astype(x.dtype)
        a = a * jnp.where(a != 0, u, jnp.zeros((), x.dtype))
    y = jnp.matmul(a, w_down, preferred_element_type=jnp.float32).astype(x.dtype)
    left = backed_up(act, row_budget)[:, None]
    if columns is not None:
        y = as_dense_nonfinite(y, x, columns)
    y = jnp.where(left, jnp.zeros((), x.dtype), y)
    if skip is not None:
        y = jnp.where(jnp.asarray(skip, bool), jnp.zeros((), x.dtype), y)
    return y


@functools.partial(jax.tree_util.register_dataclass, data_fields=["counts"], meta_fields=["capacity"])
@dataclasses.dataclass(frozen=True)
class RowCounts:
    """The rows' entry counts as the backup reads them, where no TwELL layout was made
    (:func:`ffn_rows_from_g`): ``counts`` ``[M, 1]`` int32, one "tile" a row with no
    capacity of its own, so a row is backed up by the row budget alone
    (:func:`backed_up` and the backup kernels apply the same rule to it)."""

    counts: jax.Array
    capacity: int = 2**31 - 1


def ffn_rows_from_g(x, g, w_up_t, w_down, *, row_budget: int = ROW_BUDGET, columns=None):
    """``jax_twell_ffn_warp_from_g[_gated]``: :func:`ffn_rows` listing each row's entries
    from the dense activation ``g`` itself (no pack kernel, no TwELL, no tile capacity).

    x: ``[M, d]`` bf16/f16; g: ``[M, f]`` the activation (``relu(x @ w_gate)`` rounded to
    x's dtype; f a multiple of 8); w_up_t: ``[f, d]`` (None: non-gated, g is the hidden);
    w_down: ``[f, d]``; ``columns``: as in :func:`ffn_rows`. A row with more than
    ``row_budget`` non-zeros is left to the backup (zeros here). Returns ``(y [M, d],
    RowCounts)``, the counts being each row's non-zeros of g, what the backup lists its
    rows from (:func:`ffn_rows_from_g_reference` is the contract)."""
    m, d = x.shape
    f = g.shape[-1]
    if g.shape != (m, f) or w_down.shape != (f, d):
        raise ValueError(f"ffn_rows_from_g: g must be [M, f] and w_down [f, d], got {g.shape} and {w_down.shape}")
    if f % 8 != 0:
        raise ValueError(f"ffn_rows_from_g: f must be a multiple of 8, got {f}")
    out = (jax.ShapeDtypeStruct((m, d), x.dtype), jax.ShapeDtypeStruct((m, 1), jnp.int32))
    name = "jax_twell_ffn_warp_from_g" if w_up_t is None else "jax_twell_ffn_warp_from_g_gated"
    weights = (w_down,) if w_up_t is None else (w_up_t, w_down)
    mask = _columns_mask(columns, d, "ffn_rows_from_g")
    y, counts = kernel_call(name, out, vmap_method="sequential")(
        x, g, *weights, mask, max_entries=np.int32(row_budget))
    return y, RowCounts(counts)


def _entries(g):
    """``g``'s entries by their bits, as the kernels test them: any bit but the sign set (so
    -0 is none, NaN and subnormals are entries, whatever the platform's flushing of
    subnormals in comparisons)."""
    bits = jax.lax.bitcast_convert_type(g, jnp.dtype(f"uint{8 * g.dtype.itemsize}"))
    return (bits & ~(np.array(1, bits.dtype) << (8 * g.dtype.itemsize - 1))) != 0


def ffn_rows_from_g_reference(x, g, w_up_t, w_down, *, row_budget: int = ROW_BUDGET, columns=None):
    """:func:`ffn_rows_from_g`'s contract in XLA operations (its stand-in on the CPU): the
    FFN of g's entries (any bit but the sign set: NaN and subnormals count, -0 does not) on
    the rows holding at most ``row_budget`` of them, zeros on the others, the dense
    formula's NaN on the computed rows where ``columns`` is given; each row's count of
    entries."""
    entry = _entries(g)
    counts = jnp.sum(entry, axis=-1, dtype=jnp.int32)[:, None]
    a = jnp.where(entry, g, jnp.zeros((), g.dtype))
    if w_up_t is not None:
        u = jnp.matmul(x, w_up_t.T, preferred_element_type=jnp.float32).astype(x.dtype)
        a = a * jnp.where(entry, u, jnp.zeros((), x.dtype))
    y = jnp.matmul(a, w_down, preferred_element_type=jnp.float32).astype(x.dtype)
    if columns is not None:
        y = as_dense_nonfinite(y, x, columns)
    y = jnp.where(counts > row_budget, jnp.zeros((), x.dtype), y)
    return y, RowCounts(counts)


# The device backup's split products keep their f32 partial tiles in a scratch of this many
# elements (kPartialTiles 64 x 64 tiles in ffi/twell_backup.cu: 8 MB).
BACKUP_PARTIALS = 512 * 64 * 64
# Scratch rows the device backup may take whatever M: 16 MB of bf16 at f = 5,632 (1,472 rows).
BACKUP_SCRATCH_ELEMENTS = 1 << 23


def backup_chunk_rows(m: int, f: int | None = None) -> int:
    """Rows of the device backup's scratch (``[rows, f]``) for an M-token call: an eighth of
    M rounded up to its 64-row tiles, or as many 64-row tiles as ``BACKUP_SCRATCH_ELEMENTS``
    holds at ``f`` neurons where that is more, at most M. More backed-up rows than this run
    in further chunks of the same launch: exact, at a bounded memory cost (fewer, larger
    chunks keep more tiles in flight a product: at M=2,048 an eighth of M gave the down
    product 128 tiles for 132 SMs)."""
    rows = -(-max(m // 8, 1) // 64) * 64
    if f:
        rows = max(rows, BACKUP_SCRATCH_ELEMENTS // max(f, 1) // 64 * 64)
    return max(1, min(m, rows))


def backup_rows(x, g, act: TwELL, w_up, w_down, y, *, row_budget: int = ROW_BUDGET, w_act=None,
                chunk_rows: int | None = None):
    """``jax_twell_ffn_backup*`` (ffi/twell_backup.cu): ``y`` with the rows the warp kernel
    leaves (:func:`backed_up`) computed densely, ``(g * (x @ w_up)) @ w_down`` (or
    ``g @ w_down`` with ``w_up`` None), rounded as the reference rounds g, u and h.

    The kernel lists those rows and runs its tensor-core products over them with their
    count read on the device: no conditional, any number of rows, a few microseconds when
    there are none. x: ``[M, d]`` (None for the non-gated FFN with g given); g: ``[M, f]``
    the activation ``act`` was packed from, or None where no g was written (the gate packed
    in its matmul's epilogue): then the listed rows' activation is recomputed from x and
    ``w_act`` (``[d, f]``, the activation's weight). y: ``[M, d]`` the warp kernel's result
    (updated in place). ``chunk_rows``: rows of the scratch the products go through at a
    time (default :func:`backup_chunk_rows`). Returns y ``[M, d]``."""
    m, d = y.shape
    f = w_down.shape[0]
    attrs = dict(capacity=np.int32(act.capacity), max_entries=np.int32(row_budget))
    rows = jax.ShapeDtypeStruct((m + 2,), jnp.int32)
    out = jax.ShapeDtypeStruct((m, d), y.dtype)
    chunk = backup_chunk_rows(m, f) if chunk_rows is None else max(1, min(int(chunk_rows), m))
    h = jax.ShapeDtypeStruct((chunk, f), y.dtype)
    parts = jax.ShapeDtypeStruct((BACKUP_PARTIALS,), jnp.float32)
    if g is None:
        if w_act is None or x is None:
            raise ValueError("backup_rows: without g, x and w_act are needed to recompute the rows' activation")
        if w_up is None:
            y, *_ = kernel_call("jax_twell_ffn_backup_from_x", (out, h, rows, parts), vmap_method="sequential",
                                  aliases={4: 0})(x, act.counts, w_act, w_down, y, **attrs)
        else:
            y, *_ = kernel_call("jax_twell_ffn_backup_gated_from_x", (out, h, rows, parts), vmap_method="sequential",
                                  aliases={5: 0})(x, act.counts, w_act, w_up, w_down, y, **attrs)
        return y
    if w_up is None:
        y, *_ = kernel_call("jax_twell_ffn_backup", (out, rows, parts), vmap_method="sequential", aliases={3: 0})(
            g, act.counts, w_down, y, **attrs)
        return y
    y, *_ = kernel_call("jax_twell_ffn_backup_gated", (out, h, rows, parts), vmap_method="sequential", aliases={5: 0})(
        x, g, act.counts, w_up, w_down, y, **attrs)
    return y


# The wgmma backup's scratch (ffi/twell_backup_gemm.cu, LayoutOf): a parameter block, two
# GEMM workspaces, then the compact rows and the f32 partials of the down product.
_GEMM_PARAM_BYTES = 4096
_GEMM_WORKSPACE_BYTES = 512 * 1024
_GEMM_SPLIT_ROWS_CAP = 1024
_GEMM_ALIGN = 256


def backup_work_bytes(m: int, d: int, f: int, itemsize: int, *, gated: bool, recompute: bool) -> int:
    """Bytes of :func:`backup_rows_gemm`'s scratch for an M-token call (the kernel checks
    the same layout): the listed rows' x ``[M, d]`` (forms that read x), the activation
    ``[M, f]`` (recomputed, or the listed rows of g for the non-gated FFN with g given),
    ``u``/``h`` ``[M, f]`` (gated) and f32 partials ``[max(M, 1024), d]``, plus ~1 MB of
    parameters and GEMM descriptors. At most what XLA's dense FFN keeps of its own
    intermediates ([M, f] g, u and h)."""
    off = 0

    def take(nbytes: int) -> None:
        nonlocal off
        off = -(-(off + nbytes) // _GEMM_ALIGN) * _GEMM_ALIGN

    take(_GEMM_PARAM_BYTES)
    take(_GEMM_WORKSPACE_BYTES)
    take(_GEMM_WORKSPACE_BYTES)
    take(_GEMM_WORKSPACE_BYTES)
    if gated or recompute:
        take(m * d * itemsize)
    if recompute or not gated:
        take(m * f * itemsize)
    if gated:
        take(m * f * itemsize)
    take(max(m, _GEMM_SPLIT_ROWS_CAP) * d * 4)
    return off + _GEMM_ALIGN  # slack: the kernel aligns the buffer's start


def backup_rows_gemm(x, g, act: TwELL, w_up, w_down, y, *, row_budget: int = ROW_BUDGET, w_act=None,
                     chunk_rows: int | None = None, dense=None):
    """:func:`backup_rows`'s contract on Hopper's wgmma (``jax_twell_ffn_backup_gemm*``,
    ffi/twell_backup_gemm.cu): the listed rows gathered to a compact scratch, CUTLASS grouped
    GEMMs whose row count lives in device memory, an elementwise pass for h and a scatter of
    the rows into y. No conditional; every launch reads the count on the device.
    ``chunk_rows`` is accepted for the contract's sake and unused: the scratch holds every
    row (:func:`backup_work_bytes`). ``dense``: with g given, a device bool (the per-call
    choice made on the device); where true every row of y is computed densely from x and
    g, whatever the counts, the down product writing y directly: the per-call form's dense
    side with no conditional."""
    del chunk_rows
    m, d = y.shape
    f = w_down.shape[0]
    attrs = dict(capacity=np.int32(act.capacity), max_entries=np.int32(row_budget))
    rows = jax.ShapeDtypeStruct((m + 4,), jnp.int32)
    out = jax.ShapeDtypeStruct((m, d), y.dtype)
    itemsize = jnp.dtype(y.dtype).itemsize

    def work(gated: bool, recompute: bool):
        return jax.ShapeDtypeStruct((backup_work_bytes(m, d, f, itemsize, gated=gated, recompute=recompute),),
                                    jnp.uint8)

    if dense is not None and g is None:
        raise ValueError("backup_rows_gemm: the dense flag needs g (the per-call form's gate)")
    flag = jnp.asarray(False if dense is None else dense).astype(jnp.int32)
    if g is None:
        if w_act is None or x is None:
            raise ValueError("backup_rows_gemm: without g, x and w_act are needed to recompute the rows' activation")
        if w_up is None:
            y, *_ = kernel_call("jax_twell_ffn_backup_gemm_from_x", (out, rows, work(False, True)),
                                vmap_method="sequential", aliases={4: 0})(x, act.counts, w_act, w_down, y, **attrs)
        else:
            y, *_ = kernel_call("jax_twell_ffn_backup_gemm_gated_from_x", (out, rows, work(True, True)),
                                vmap_method="sequential", aliases={5: 0})(
                x, act.counts, w_act, w_up, w_down, y, **attrs)
        return y
    if w_up is None:
        y, *_ = kernel_call("jax_twell_ffn_backup_gemm", (out, rows, work(False, False)), vmap_method="sequential",
                            aliases={3: 0})(g, act.counts, w_down, y, flag, **attrs)
        return y
    y, *_ = kernel_call("jax_twell_ffn_backup_gemm_gated", (out, rows, work(True, False)), vmap_method="sequential",
                        aliases={5: 0})(x, g, act.counts, w_up, w_down, y, flag, **attrs)
    return y


def backup_rows_by_size(x, g, act: TwELL, w_up, w_down, y, *, row_budget: int = ROW_BUDGET, w_act=None,
                        chunk_rows: int | None = None):
    """:func:`backup_rows`'s contract on the backup that measured faster for this call's
    size (the default device backup): :func:`backup_rows_gemm` from
    :data:`~jax_twell.ops.layout.GEMM_BACKUP_MIN_TOKENS` tokens (its grouped GEMMs run
    backed-up rows at several times the mma.sync kernel's rate, and a call of that size
    hides their launches), :func:`backup_rows` below (fewer launches: an empty backup a
    few microseconds). The choice is static (the token count of y)."""
    kernel = backup_rows_gemm if y.shape[0] >= GEMM_BACKUP_MIN_TOKENS else backup_rows
    return kernel(x, g, act, w_up, w_down, y, row_budget=row_budget, w_act=w_act, chunk_rows=chunk_rows)


def backup_rows_reference(x, g, act: TwELL, w_up, w_down, y, *, row_budget: int = ROW_BUDGET, w_act=None,
                          chunk_rows: int | None = None, dense=None):
    """:func:`backup_rows`'s contract in XLA operations (the stand-in tests run on the CPU),
    with :func:`backup_rows_gemm`'s ``dense`` flag (every row)."""
    if g is None:
        g = relu_matmul(x, w_act)
    full = xla.up_down(x, g, w_up, w_down).astype(y.dtype)
    rows = backed_up(act, row_budget)
    if dense is not None:
        rows = rows | jnp.asarray(dense, bool)
    return jnp.where(rows[:, None], full, y)


def backup_rows_gemm_reference(x, g, act: TwELL, w_up, w_down, y, *, row_budget: int = ROW_BUDGET, w_act=None,
                               chunk_rows: int | None = None, dense=None):
    """:func:`backup_rows_gemm`'s contract in XLA operations (its stand-in on the CPU)."""
    return backup_rows_reference(x, g, act, w_up, w_down, y, row_budget=row_budget, w_act=w_act, dense=dense)


_DENSE_IF_WORKSPACE_BYTES = 32 << 20  # cuBLASLt's scratch (ffi/twell_dense_if.cu)


def dense_if_work_bytes(m: int, f: int, itemsize: int, *, gated: bool) -> int:
    """Bytes of :func:`dense_ffn_if`'s scratch (the kernel checks the same layout): u
    ``[M, f]`` (gated), cuBLASLt's 32 MiB workspace, and slack for aligning the base."""
    u = -(-(m * f * itemsize) // _GEMM_ALIGN) * _GEMM_ALIGN if gated else 0
    return u + _DENSE_IF_WORKSPACE_BYTES + _GEMM_ALIGN


def dense_ffn_if(x, g, w_up, w_down, y, dense):
    """y, or where the device bool ``dense`` is set the dense formula's
    ``(g * (x @ w_up)) @ w_down`` (``g @ w_down`` with ``w_up`` None), on cuBLAS's GEMMs
    (``jax_twell_dense_ffn_if*``, ffi/twell_dense_if.cu): a CUDA graph whose conditional
    node reads the flag on the device, so the choice costs no host round trip. Not inside
    XLA's command buffers (its graph cannot be captured). Needs
    :func:`jax_twell._kernels.dense_if_available`."""
    m, d = y.shape
    f = w_down.shape[0]
    gated = w_up is not None
    flag = jnp.asarray(dense).astype(jnp.int32)
    out = jax.ShapeDtypeStruct((m, d), y.dtype)
    work = jax.ShapeDtypeStruct((dense_if_work_bytes(m, f, jnp.dtype(y.dtype).itemsize, gated=gated),), jnp.uint8)
    if not gated:
        y, _ = kernel_call("jax_twell_dense_ffn_if", (out, work), vmap_method="sequential", aliases={2: 0})(
            g, w_down, y, flag)
        return y
    y, _ = kernel_call("jax_twell_dense_ffn_if_gated", (out, work), vmap_method="sequential", aliases={4: 0})(
        x, g, w_up, w_down, y, flag)
    return y


def dense_ffn_if_reference(x, g, w_up, w_down, y, dense):
    """:func:`dense_ffn_if`'s contract in XLA operations (its stand-in on the CPU)."""
    full = xla.up_down(x, g, w_up, w_down).astype(y.dtype)
    return jnp.where(jnp.asarray(dense, bool), full, y)


# Backups that take the per-call choice as a device flag (``dense=``): with them the
# per-call form holds no conditional (sparse_ffn's device_choice).
_TAKES_DENSE_FLAG = (backup_rows_gemm, backup_rows_gemm_reference)


def takes_dense_flag(backup_kernel) -> bool:
    """Whether ``backup_kernel`` takes the per-call choice as a device flag (``dense=``)."""
    return any(backup_kernel is k for k in _TAKES_DENSE_FLAG)


def ffn_with_backup(x, g, act: TwELL, w_up, w_down, columns, *, w_up_t=None, row_budget: int = ROW_BUDGET,
                    rows_kernel=ffn_rows, backup_kernel=backup_rows, w_act=None):
    """The FFN from the gate's TwELL ``act`` with no conditional: the warp kernel, then
    :func:`backup_rows` over the rows it leaves. g: ``[M, f]`` the activation act was
    packed from, or None (then ``w_act``, the activation's weight, recomputes the backed-up
    rows' activation). ``columns``: the ``[d]`` bool
    :func:`jax_twell.ops.common.finite_columns` of the weights; y gets the dense formula's
    NaN where x or those columns are not finite (``rows_kernel`` puts it on its rows, the
    backup computes the dense formula on the others). ``w_up`` None: the non-gated FFN (g
    is its activation)."""
    gated = w_up is not None
    # The rows kernel puts the dense formula's NaN on its rows (no pass over y); the
    # backed-up rows are the dense formula itself.
    y = rows_kernel(x, act, _up_t(w_up, w_up_t) if gated else None, w_down, row_budget=row_budget, columns=columns)
    return backup_kernel(x if gated or g is None else None, g, act, w_up, w_down, y, row_budget=row_budget, w_act=w_act)


def ffn_from_g_with_backup(x, g, w_up, w_down, columns, *, w_up_t=None, row_budget: int = ROW_BUDGET,
                           rows_kernel=ffn_rows_from_g, backup_kernel=backup_rows):
    """:func:`ffn_with_backup` with the rows listed from g by the warp kernel itself
    (:func:`ffn_rows_from_g`): no pack, and a row is backed up by the row budget alone.
    g: ``[M, f]`` the activation; the rest as in :func:`ffn_with_backup`."""
    gated = w_up is not None
    y, counts = rows_kernel(x, g, _up_t(w_up, w_up_t) if gated else None, w_down, row_budget=row_budget,
                            columns=columns)
    return backup_kernel(x if gated else None, g, counts, w_up, w_down, y, row_budget=row_budget)


def ffn_from_gate(x, act: TwELL, w_gate, w_up, w_down, *, w_up_t=None, row_budget: int = ROW_BUDGET,
                  backup: int | None = None, rows_kernel=ffn_rows, finite=True):
    """The FFN from the packed gate ``act``: the warp kernel for the rows that fit, the
    dense backup for the rest (at most ``backup`` rows, default :func:`backup_size`); past
    that many, XLA's dense FFN for the whole call. ``rows_kernel``: the row step,
    ``(x, act, w_up_t, w_down, *, row_budget) -> y`` (default :func:`ffn_rows`; tests pass
    stand-ins). ``finite``: a ``[]`` bool, false where an operand holds NaN or Inf (then
    dense: the dense formula's NaN; see :func:`jax_twell.ops.common.all_finite`). x:
    ``[M, d]``; weights as in :func:`jax_twell.sparse_ffn`. Returns y ``[M, d]``."""
    m, _ = x.shape
    gated = w_gate is not None
    backup = backup_size(m) if backup is None else min(backup, m)
    return _rows_or_dense(
        m, backed_up(act, row_budget), backup, finite,
        lambda: rows_kernel(x, act, _up_t(w_up, w_up_t) if gated else None, w_down, row_budget=row_budget),
        lambda idx: xla.ffn(_rows_of(x, idx), w_gate, w_up, w_down),
        lambda: xla.ffn(x, w_gate, w_up, w_down))


# The per-call choice: sparse where the call's entries cost less on the warp kernel, with
# its backed-up rows' dense up and down products, than the dense up and down products of
# the whole call (the gate is computed either way). Per entry the kernel moves a d-row of
# Wu^T and one of Wd (4 d bytes in bf16) at ~ENTRY_BYTES_PER_S; the dense products do
# 4 M d f flops at ~DENSE_FLOPS; a backup in use costs ~BACKUP_FIXED_S more (its gather,
# small products and scatter in a branch of their own). Rates measured on one H200.
ENTRY_BYTES_PER_S = 6.0e12
DENSE_FLOPS = 6.5e14
BACKUP_FIXED_S = 60e-6


def sparse_cheaper(entries: jax.Array, m: int, d: int, f: int, itemsize: int,
                   backed_rows: jax.Array | int = 0) -> jax.Array:
    """Device bool: the warp kernel's ``entries`` (kept entries of an M-token call) and the
    backup's ``backed_rows`` cost less than the dense up and down products."""
    backed = jnp.asarray(backed_rows, jnp.float32)
    sparse_s = (entries.astype(jnp.float32) * (2 * d * itemsize) / ENTRY_BYTES_PER_S
                + backed * (4.0 * d * f) / DENSE_FLOPS + jnp.where(backed > 0, BACKUP_FIXED_S, 0.0))
    dense_s = 4.0 * m * d * f / DENSE_FLOPS
    return sparse_s < dense_s


SAMPLE_ROWS = 256  # rows of g the per-call form counts to choose its side


def sample_row_indices(m: int, rows: int = SAMPLE_ROWS) -> np.ndarray:
    """The rows the per-call choice reads of an M-row call: all of them where M <= rows,
    else one row in each of ``rows`` equal blocks, at an offset in the block that a fixed
    hash of the block's index sets. So a periodic pattern (dense rows every k tokens, as
    at sequence starts or every other row) is neither always hit nor always missed, as it
    could be with one fixed offset."""
    if m <= rows:
        return np.arange(m)
    stride = m // rows
    k = np.arange(rows, dtype=np.uint64)
    offset = ((k * np.uint64(0x9E3779B1)) % np.uint64(2**32)) >> np.uint64(8)
    return (k * np.uint64(stride) + offset % np.uint64(stride)).astype(np.int64)


def likely_sparse(g, *, d: int, itemsize: int, tile: int, capacity: int, row_budget: int, backup: int,
                  rows: int = SAMPLE_ROWS, rule: DenseCrossover | None = None, transposed: bool = True,
                  gated: bool = True) -> jax.Array:
    """Device bool: the per-call choice, from ``rows`` rows of ``g [M, f]`` spread over it
    (:func:`sample_row_indices`; all of them where M <= rows): their kept entries and
    backed-up rows (:func:`jax_twell.ops.stats.warp_layout_fit`), scaled to M, price the
    warp path below the dense products. With a ``rule`` (the device backup's form: it
    takes any number of rows) the price is the rule's
    (:meth:`~jax_twell.ops.costs.DenseCrossover.warp_seconds`: backed-up rows at the
    backup's tensor-core rate, w_up's transpose where not ``transposed``, the non-gated
    FFN's half where not ``gated``) below its ``margin`` of dense; without one (the
    ``lax.switch`` form) :func:`sparse_cheaper`, and the backed-up rows fill at most half
    the ``backup`` (room for the sample's error; the exact counts still send a call whose
    rows overflow it to the dense side). Only how fast: either side is exact."""
    m, f = g.shape
    sample = g if m <= rows else jnp.take(g, jnp.asarray(sample_row_indices(m, rows)), axis=0)
    over, kept = stats.warp_layout_fit(sample, tile=tile, capacity=capacity, row_budget=row_budget)
    est_rows, kept = over * m, kept * (float(m) * f)
    if rule is not None:
        return rule.warp_seconds(kept, est_rows, m, d, f, itemsize, transposed, gated) < (
            rule.margin * rule.dense_side_cost(m, d, f, itemsize, gated))
    return (est_rows <= backup / 2) & sparse_cheaper(kept, m, d, f, itemsize, est_rows)


def sparse_ffn(x, w_gate, w_up, w_down, *, tile: int = 256, capacity: int = 32, w_up_t=None,
               row_budget: int = ROW_BUDGET, pack=pack_twell, rows_kernel=ffn_rows, finite=True,
               backup_kernel=None, columns=None, rule: DenseCrossover | None = None, device_choice: bool = False,
               dense_kernel=None, rows_from_g=None):
    """Inference FFN with the choice made per call on the device: XLA's gate matmul writes
    g; a sample of its rows (:func:`likely_sparse`) chooses: dense, the dense up and down
    products from the same g (no gate recompute, no pack, no count of all of g); sparse,
    the pack kernel gives g's TwELL and exact counts, and the warp kernel runs with the
    backup at its size (:func:`backup_buckets`), or the dense products where the rows
    overflow the backup or an operand is not finite. x:
    ``[M, d]``; weights as in :func:`jax_twell.sparse_ffn`; :func:`supported` must hold.
    ``pack``, ``rows_kernel``: the pack and row steps (defaults: the kernels; tests pass
    stand-ins); ``finite``: as in :func:`ffn_from_gate`, or a function returning it (then
    computed only on the sparse side). ``backup_kernel`` (:func:`backup_rows` or a stand-in):
    the sparse side runs :func:`ffn_with_backup`, with no conditional of its own, and
    ``columns`` (a function returning the weights' ``[d]`` finite columns, run on the
    sparse side) replaces ``finite``; None: the ``lax.switch`` over static backup sizes.
    ``rule``: the cost model the device backup's form prices its side with (default
    ``DenseCrossover()``; see :func:`likely_sparse`). ``device_choice`` (with a
    ``backup_kernel`` that takes a ``dense`` flag, :func:`backup_rows_gemm`): no
    conditional at all; the sample's choice reaches the backup as a device flag, and a
    dense call is the backup over every row from x and g. ``dense_kernel``
    (:func:`dense_ffn_if` or its reference; with ``backup_kernel``): no conditional
    either, the dense side on cuBLAS: the pack (writing empty tiles), the warp kernel and
    the backup (listing no row) on the dense side find nothing to do, then
    ``dense_kernel`` computes y there from x and g. ``rows_from_g`` (:func:`ffn_rows_from_g`
    or its reference; with ``backup_kernel``, in the form with a conditional): the sparse
    side lists the rows' entries from g in the warp kernel (:func:`ffn_from_g_with_backup`)
    instead of the pack and ``rows_kernel``."""
    m, d = x.shape
    gated = w_gate is not None
    w_act = w_gate if gated else w_up
    backup = backup_size(m)
    g = relu_matmul(x, w_act)
    # The form with a conditional lists the rows from g where given such a kernel; the forms
    # with none keep the pack (their kernels take the dense side's skip flag).
    from_g = backup_kernel is not None and rows_from_g is not None and dense_kernel is None and not device_choice

    def dense(_):
        return xla.up_down(x, g, w_up if gated else None, w_down)

    def sparse(_):
        if from_g:
            return ffn_from_g_with_backup(x, g, w_up if gated else None, w_down, columns(), w_up_t=w_up_t,
                                          row_budget=row_budget, rows_kernel=rows_from_g, backup_kernel=backup_kernel)
        act = pack(g, tile=tile, capacity=capacity)
        if backup_kernel is not None:
            return ffn_with_backup(x, g, act, w_up if gated else None, w_down, columns(), w_up_t=w_up_t,
                                   row_budget=row_budget, rows_kernel=rows_kernel, backup_kernel=backup_kernel)
        rows = backed_up(act, row_budget)
        ok = finite() if callable(finite) else finite
        return _rows_or_dense(
            m, rows, backup, ok,
            lambda: rows_kernel(x, act, _up_t(w_up, w_up_t) if gated else None, w_down, row_budget=row_budget),
            lambda idx: xla.up_down(_rows_of(x, idx), _rows_of(g, idx), w_up if gated else None, w_down),
            lambda: dense(None))

    # The sample priced by the sparse side's own rule: with the rows listed from g, a row
    # is backed up by the row budget alone (a tile's capacity of the budget cannot bind).
    likely = likely_sparse(g, d=d, itemsize=x.dtype.itemsize, tile=tile,
                           capacity=row_budget if from_g else capacity, row_budget=row_budget,
                           backup=backup, rule=None if backup_kernel is None else rule or DenseCrossover(),
                           transposed=w_up_t is not None or not gated, gated=gated)
    if dense_kernel is not None or device_choice:  # no conditional: the choice a device flag
        if backup_kernel is None:
            raise ValueError("sparse_ffn: dense_kernel and device_choice need a backup_kernel "
                             "(the rows past the warp kernel's layout)")
        dense_side = jnp.logical_not(likely)
        cols = columns()
        if pack is pack_twell and rows_kernel is ffn_rows:  # the kernels: skip their work on the dense side
            act = pack_twell(g, tile=tile, capacity=capacity, skip=dense_side)
            y = ffn_rows(x, act, _up_t(w_up, w_up_t) if gated else None, w_down, row_budget=row_budget,
                         skip=dense_side, columns=cols)
        else:  # stand-ins: the dense side's empty tiles as the pack's skip leaves them
            act = pack(g, tile=tile, capacity=capacity)
            act = dataclasses.replace(act, counts=jnp.where(dense_side, 0, act.counts))
            y = rows_kernel(x, act, _up_t(w_up, w_up_t) if gated else None, w_down, row_budget=row_budget,
                            columns=cols)
        w_up_k = w_up if gated else None
        if dense_kernel is not None:  # the backup lists no row on the dense side; the dense kernel writes y there
            y = backup_kernel(x if gated else None, g, act, w_up_k, w_down, y, row_budget=row_budget)
            y = dense_kernel(x, g, w_up_k, w_down, y, dense_side)
        else:  # the backup's own flag: every row from x and g on the dense side
            y = backup_kernel(x if gated else None, g, act, w_up_k, w_down, y, row_budget=row_budget,
                              dense=dense_side)
        return y  # the rows kernel's rows carry the dense formula's NaN; the others are that formula
    return jax.lax.cond(likely, sparse, dense, None)
