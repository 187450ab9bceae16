"""The CUDA implementation of the inference ops: it runs a plan's kernels.

:func:`sparse_ffn` plans the call (:func:`jax_twell.ops.plan.plan_ffn`) and runs it with
the bindings of :mod:`jax_twell.ops.ffn.binding` (or the stand-ins a test passes as
``kernels``). The one choice a plan may leave to the device, sparse or dense per call, is
made here from counts of the gate activation (:mod:`jax_twell.ops.stats`) priced by the
plan's rule: a ``lax.cond``, so a call pays only its side.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_twell._kernels import dense_if_available
from jax_twell.formats import TwELL, relu_matmul
from jax_twell.ops import stats, xla
from jax_twell.ops.common import all_finite, as_dense_nonfinite, finite_columns
from jax_twell.ops.ffn import binding, warp
from jax_twell.ops.pack import binding as pack_binding
from jax_twell.ops.plan import FFNOptions, FFNPlan, Kernel, LayerInfo, Path, fused_gate_preferred, plan_ffn

__all__ = ["FFNKernels", "BINDINGS", "sparse_ffn", "run", "twell_ffn", "gate_twell"]


@dataclasses.dataclass(frozen=True)
class FFNKernels:
    """The device steps a plan runs, by name (the bindings by default; tests pass stand-ins).

    pack(a, *, tile, capacity) -> TwELL; gate_pack(x, w, *, tile, capacity, variant) -> TwELL;
    row(x, act, w_act, w_up, w_down, w_up_t) -> y; blocked(x, act, w_act, w_up, w_down,
    w_up_t, *, max_entries, tensor_cores, down_union, up_union, down_stationary, fallback)
    -> (y, ...); decode(x, g, w_up, w_down, *, w_up_t) -> y; decode_gate(x, w_act, w_up,
    w_down, *, w_up_t) -> y; decode_rows(x, w_act_t, w_down, *, w_up_t) -> y;
    warp_rows(x, act, w_up_t, w_down, *, row_budget) -> y (zeros on the rows left to the backup);
    warp_rows_g(x, g, w_up_t, w_down, *, row_budget, columns) -> (y, RowCounts): the same
    rows listed from g by the kernel itself (:func:`warp.ffn_rows_from_g`, no pack), used
    wherever g is written and the device backup runs; None (the bindings' default): the
    pack and ``warp_rows``, measured 1-2% faster at M=2,048-16,384 on an H100
    (``ffi/notes/twell_ffn_warp.md``, "The rows listed from g, measured").
    warp_backup(x, g, act, w_up, w_down, y, *, row_budget) -> y with those rows computed
    densely, their count read on the device (:func:`warp.backup_rows_by_size`, the default:
    the wgmma backup from ``GEMM_BACKUP_MIN_TOKENS`` tokens, the mma.sync one below; measured
    in ffi/notes/twell_backup.md); None: the ``lax.switch`` over static sizes.
    warp_dense(x, g, w_up, w_down, y, dense) -> y, the dense formula where the device flag
    is set (:func:`warp.dense_ffn_if`, cuBLAS in a CUDA graph's conditional node): with it
    the per-call form holds no conditional and its dense side runs on cuBLAS; None (the
    default: measured slower than the ``lax.cond`` form, as it splits XLA's command
    buffers; ffi/notes/twell_backup.md): the per-call choice is a ``lax.cond``.
    """

    pack: Callable = pack_binding.pack_twell
    gate_pack: Callable = binding.gate_pack
    row: Callable = binding.twell_ffn
    blocked: Callable = binding.blocked_call
    decode: Callable = binding.decode_ffn
    decode_gate: Callable = binding.decode_ffn_gate
    decode_rows: Callable = binding.decode_ffn_rows
    warp_rows: Callable = warp.ffn_rows
    warp_backup: Callable | None = warp.backup_rows_by_size
    warp_dense: Callable | None = None
    warp_rows_g: Callable | None = None


BINDINGS = FFNKernels()


def sparse_ffn(x, w_gate, w_up, w_down, *, layer: LayerInfo = LayerInfo(), options: FFNOptions = FFNOptions(),
               w_up_t=None, w_act_t=None, weights_finite=None, kernels: FFNKernels = BINDINGS):
    """Inference FFN ``y [M, d]`` for ``x [M, d]`` (bf16, f16 or f32) on the CUDA kernels,
    as planned by :func:`jax_twell.ops.plan.plan_ffn` for this shape, ``layer`` and
    ``options``. Weights as in :func:`jax_twell.sparse_ffn`; ``w_up_t``, ``w_act_t``:
    optional ``[f, d]`` copies of ``w_up.T`` and of the activation's weight transposed
    (the layouts the decode kernels read); ``weights_finite``: the ``[d]`` bool
    :func:`~jax_twell.ops.common.finite_columns` of the weights where the caller keeps it
    (a serving layer's cache), else computed in the call."""
    w_act = w_gate if w_gate is not None else w_up
    m, d = x.shape
    options = dataclasses.replace(options, choice_on_device=_choice_on_device(kernels, options.rule))
    plan = plan_ffn(m, d, w_act.shape[1], x.dtype, gated=w_gate is not None, layer=layer, options=options,
                    w_up_t=w_up_t is not None, w_act_t=w_act_t is not None)
    return run(plan, x, w_gate, w_up, w_down, w_up_t=w_up_t, w_act_t=w_act_t, weights_finite=weights_finite,
               kernels=kernels)


def _dense_kernel(kernels: FFNKernels):
    """The bound dense side behind a device flag, where it can run (None: none)."""
    if kernels.warp_dense is warp.dense_ffn_if and not dense_if_available():  # built without cuBLASLt's header
        return None
    return kernels.warp_dense


def _choice_on_device(kernels: FFNKernels, rule) -> bool:
    """Whether the per-call choice holds no conditional with these kernels: a dense side
    behind a device flag, or the wgmma backup's own flag where the rule sets the floor of
    that form (:class:`jax_twell.ops.plan.FFNOptions`' ``choice_on_device``)."""
    if kernels.warp_backup is None:
        return False
    return _dense_kernel(kernels) is not None or (warp.takes_dense_flag(kernels.warp_backup)
                                                  and rule.per_call_min_tokens_no_conditional is not None)


def run(plan: FFNPlan, x, w_gate, w_up, w_down, *, w_up_t=None, w_act_t=None, weights_finite=None,
        kernels: FFNKernels = BINDINGS):
    """Runs ``plan`` on ``x [M, d]``: ``y [M, d]`` x's dtype.

    NaN and Inf are the dense formula's: where the plan chooses its side on the device,
    a non-finite x or weight (:func:`~jax_twell.ops.common.all_finite`) joins that choice
    and the dense side runs; elsewhere y gets NaN by
    :func:`~jax_twell.ops.common.as_dense_nonfinite` (no extra conditional).
    ``weights_finite``: as in :func:`sparse_ffn`."""
    gated = w_gate is not None
    w_act = w_gate if gated else w_up
    w_up_k = w_up if gated else None  # the up weight the kernels take (None: non-gated)
    m, d = x.shape
    f = w_act.shape[1]
    rule = plan.options.rule
    if plan.path == Path.EMPTY:
        return jnp.zeros((0, d), x.dtype)
    if plan.path == Path.DENSE:  # small M: the gate and up products apart (no concatenation of their weights)
        return xla.dense_side(x, w_gate, w_up, w_down)
    device_backup = plan.options.device_backup and kernels.warp_backup is not None and warp.device_backup_supported(f)
    if plan.path == Path.WARP and plan.device_choice and device_backup:
        # The backup reads its row count on the device, and y gets the dense formula's NaN
        # by one pass (on the sparse side only). The sample's choice stays a lax.cond (the
        # dense side on cuBLAS) unless the rule sets the floor of the form with none: there
        # the choice is the backup's device flag, its dense side the backup's grouped GEMMs
        # over every row (1.7x of cuBLAS's time measured, ffi/notes/twell_backup.md).
        def weight_columns():
            return finite_columns(w_up_k, w_down) if weights_finite is None else weights_finite

        dense_kernel = _dense_kernel(kernels)
        return warp.sparse_ffn(x, w_gate, w_up, w_down, tile=plan.options.tile, capacity=plan.options.capacity,
                               w_up_t=w_up_t, pack=kernels.pack, rows_kernel=kernels.warp_rows,
                               backup_kernel=kernels.warp_backup, columns=weight_columns, rule=rule,
                               device_choice=dense_kernel is None and _choice_on_device(kernels, rule),
                               dense_kernel=dense_kernel, rows_from_g=kernels.warp_rows_g)
    if plan.path == Path.WARP and plan.device_choice:  # the checks run on the sparse side only
        def operands_finite():
            columns = finite_columns(w_up_k, w_down) if weights_finite is None else weights_finite
            return all_finite(x) & columns.all()

        return warp.sparse_ffn(x, w_gate, w_up, w_down, tile=plan.options.tile, capacity=plan.options.capacity,
                               w_up_t=w_up_t, pack=kernels.pack, rows_kernel=kernels.warp_rows,
                               finite=operands_finite)
    if plan.path == Path.TILES and plan.device_choice:  # the checks on the sparse side only
        def tiles_operands_finite():  # traced where it is called (inside that side)
            cols = finite_columns(w_up_k, w_down) if weights_finite is None else weights_finite
            if weights_finite is None:  # those kernels may recompute a gate tile: its NaN too
                cols = cols & ~jnp.isnan(w_act).any()
            return all_finite(x) & cols.all()

        return _run_tiles(plan, x, w_gate, w_up, w_down, w_up_t, kernels, tiles_operands_finite, None)
    columns = finite_columns(w_up_k, w_down) if weights_finite is None else weights_finite
    if plan.path == Path.WARP and device_backup:  # a known layer: no conditional at all
        # XLA's gate and the pack, not the fused gate: with no g the backup recomputes its
        # rows' gate, which cost heavy-tailed rows 9% at M=16,384 (1.10x against 1.20x of
        # XLA's dense FFN) for 2% on uniform rows (lab/results/device_backup_ee16371.json).
        tile, capacity = plan.options.tile, plan.options.capacity
        g = relu_matmul(x, w_act)
        if kernels.warp_rows_g is not None:  # the rows listed from g in the kernel: no pack
            return warp.ffn_from_g_with_backup(x, g, w_up_k, w_down, columns, w_up_t=w_up_t,
                                               rows_kernel=kernels.warp_rows_g, backup_kernel=kernels.warp_backup)
        act = kernels.pack(g, tile=tile, capacity=capacity)
        return warp.ffn_with_backup(x, g, act, w_up_k, w_down, columns, w_up_t=w_up_t, rows_kernel=kernels.warp_rows,
                                    backup_kernel=kernels.warp_backup, w_act=w_act)
    ok = all_finite(x) & columns.all()
    if plan.path == Path.WARP:
        tile, capacity = plan.options.tile, plan.options.capacity
        if plan.fused_gate:
            act = kernels.gate_pack(x, w_act, tile=tile, capacity=capacity, variant=plan.gate_variant)
        else:
            act = kernels.pack(relu_matmul(x, w_act), tile=tile, capacity=capacity)
        return warp.ffn_from_gate(x, act, w_gate, w_up, w_down, w_up_t=w_up_t, rows_kernel=kernels.warp_rows,
                                  finite=ok)
    if plan.path == Path.DECODE and plan.decode_check:
        g = relu_matmul(x, w_act)
        few = ok & (jnp.count_nonzero(g) <= rule.decode_dense_above * m * f)
        return jax.lax.cond(few, lambda: kernels.decode(x, g, w_up_k, w_down, w_up_t=w_up_t),
                            lambda: xla.up_down(x, g, w_up_k, w_down))
    # Paths with no device choice of their own (a conditional costs ~10 us a call): their y
    # gets the dense formula's NaN by one elementwise pass instead. Those paths recompute
    # overflowed gate tiles (or may), where a NaN of the gate would not count as active:
    # the activation weight's NaN are checked too.
    if weights_finite is None:
        columns = columns & ~jnp.isnan(w_act).any()
        ok = ok & columns.all()
    if plan.path == Path.GATHER:
        y = xla.gather_ffn(x, w_gate, w_up, w_down, width=plan.gather_width, w_up_t=w_up_t)
    elif plan.path == Path.DECODE_ROWS:
        y = kernels.decode_rows(x, w_act_t, w_down, w_up_t=w_up_t if gated else None)
    elif plan.path == Path.DECODE_GATE:
        y = kernels.decode_gate(x, w_act, w_up_k, w_down, w_up_t=w_up_t)
    elif plan.path == Path.DECODE:
        y = kernels.decode(x, relu_matmul(x, w_act), w_up_k, w_down, w_up_t=w_up_t)
    else:
        return _run_tiles(plan, x, w_gate, w_up, w_down, w_up_t, kernels, ok, columns)
    return as_dense_nonfinite(y, x, columns)


def _run_tiles(plan: FFNPlan, x, w_gate, w_up, w_down, w_up_t, kernels: FFNKernels, finite, columns):
    """The TwELL path: the gate as TwELL, then the row or blocked kernel, with sparse or
    dense (and row or blocked) chosen on the device where the plan leaves it; ``finite``
    (``[]`` bool) joins that choice (dense where false), or, a function returning it, is
    computed on the sparse side only, which then runs the dense products where it is false
    (a conditional inside that side: the dense side reads no operand for the check); with
    no choice on the device, ``columns`` (:func:`~jax_twell.ops.common.finite_columns`)
    marks y's NaN instead."""
    gated = w_gate is not None
    w_act = w_gate if gated else w_up
    w_up_k = w_up if gated else None
    m, d = x.shape
    f = w_act.shape[1]
    rule, tile, capacity = plan.options.rule, plan.options.tile, plan.options.capacity
    itemsize = x.dtype.itemsize
    if plan.fused_gate:  # exact counts from the packed gate; g is never written
        g = None
        gate = kernels.gate_pack(x, w_act, tile=tile, capacity=capacity, variant=plan.gate_variant)
        nnz = gate.counts.sum(dtype=jnp.int32).astype(jnp.float32)
        n_over = gate.overflowed.sum(dtype=jnp.int32).astype(jnp.float32)
    else:
        g = relu_matmul(x, w_act)
        nnz, n_over = stats.sampled_gate_counts(g, tile=tile, capacity=capacity, rows=plan.sample_rows)
    use_row = rule.use_sparse(nnz, n_over, m, d, f, itemsize, plan.transposed)

    def packed():
        return gate if g is None else kernels.pack(g, tile=tile, capacity=capacity)

    def row_kernel(act):
        return kernels.row(x, act, w_act, w_up_k, w_down, w_up_t)

    def dense(_):
        if g is None:
            return xla.dense_side(x, w_gate, w_up, w_down)
        return xla.up_down(x, g, w_up_k, w_down)

    lazy = callable(finite)

    def checked(kernel_side):  # a sparse side that runs the dense products on non-finite operands
        if not lazy:
            return kernel_side
        return lambda _: jax.lax.cond(finite(), kernel_side, dense, None)

    ok = jnp.ones((), bool) if lazy else finite  # what the choice itself reads of the checks

    if not plan.blocked:
        if not plan.device_choice:
            return as_dense_nonfinite(row_kernel(packed()), x, columns)
        return jax.lax.cond(use_row & ok, checked(lambda _: row_kernel(packed())), dense, None)

    prefer_blocked, any_sparse = plan.prefer_blocked, use_row
    if plan.device_choice:
        row_cost = rule.row_cost(nnz, n_over, d, f, itemsize, plan.transposed, m)
        union = None
        if plan.union_priced:  # the union measured on a sample of g's blocks where g exists
            union = plan.layer.union_fraction if g is None else stats.sampled_block_union(g, rows=plan.sample_rows)
        # Overflowed tiles priced as the blocked kernels pay them (a recompute each): heavy-tailed
        # rows otherwise sent calls 10-20x slower than dense to them.
        blocked_cost = rule.kernel_cost(nnz, m, d, f, itemsize, plan.union_priced, union, plan.transposed,
                                        plan.layer.active_fraction, n_overflow=n_over)
        any_sparse = use_row | (blocked_cost < rule.margin * rule.dense_cost(m, d, f, itemsize))
        if prefer_blocked is None:
            prefer_blocked = blocked_cost < row_cost

    def blocked_kernel(act):
        # The handler falls back to the row kernel by itself where the entries overflow.
        s = plan.steps
        return kernels.blocked(x, act, w_act, w_up_k, w_down, w_up_t, max_entries=plan.max_entries,
                               tensor_cores=s.tensor_cores, down_union=s.down_union, up_union=s.up_union,
                               down_stationary=s.down_stationary, fallback=True)[0]

    def sparse(_):
        act = packed()
        return blocked_kernel(act) if prefer_blocked else row_kernel(act)

    if not plan.device_choice:
        return as_dense_nonfinite(sparse(None), x, columns)
    if isinstance(prefer_blocked, bool):
        return jax.lax.cond(any_sparse & ok, checked(sparse), dense, None)
    # The side and the kernel in one conditional: each conditional holding library calls
    # reads its index on the host, so a second one nested in the sparse side would make the
    # host wait for the GPU twice a call (the checks' own, where ``finite`` is a function,
    # is that second one: a sparse call pays it so that a dense one reads no operand twice).
    side = jnp.where(any_sparse & ok, jnp.where(prefer_blocked, 2, 1), 0).astype(jnp.int32)
    return jax.lax.switch(side, [dense, checked(lambda _: row_kernel(packed())),
                                 checked(lambda _: blocked_kernel(packed()))], None)


def twell_ffn(x, act: TwELL, w_act, w_up, w_down, *, w_up_t=None, kernel: Kernel | str = Kernel.ROW,
              max_entries: int | None = None, options: FFNOptions = FFNOptions()):
    """FFN output from a packed activation by one kernel (no dense side: the caller chose
    the format). ``kernel``: :class:`~jax_twell.ops.plan.Kernel` ROW (default), BLOCKED,
    BLOCKED_MMA (tensor cores) or BLOCKED_UNION (union products; the down step on the
    stationary weight where ``options.rule`` prices it so). x: ``[..., M, d]``; act: TwELL
    of ``relu(x @ w_act)``; weights as in :func:`jax_twell.twell_ffn`. Returns ``y [..., M, d]``.
    """
    names = tuple(k.value for k in (Kernel.ROW, Kernel.BLOCKED, Kernel.BLOCKED_MMA, Kernel.BLOCKED_UNION))
    if getattr(kernel, "value", kernel) not in names:
        raise ValueError(f"kernel must be one of {names}, got {kernel!r}")
    kernel = Kernel(kernel)
    if kernel == Kernel.ROW:
        return binding.twell_ffn(x, act, w_act, w_up, w_down, w_up_t)
    union = kernel == Kernel.BLOCKED_UNION
    m = int(np.prod(x.shape[:-1]))
    stationary = union and options.rule.down_stationary(m, x.shape[-1], act.f, x.dtype.itemsize, None,
                                                        w_up_t is not None)
    return binding.blocked_ffn(x, act, w_act, w_up, w_down, w_up_t=w_up_t, max_entries=max_entries,
                               tensor_cores=kernel != Kernel.BLOCKED, down_union=union, up_union=union,
                               down_stationary=stationary)


def gate_twell(x, w, *, tile: int, capacity: int) -> TwELL:
    """``relu(x @ w)`` as TwELL (x ``[..., M, d]``, w ``[d, f]``): the fused gate kernel
    where :func:`jax_twell.ops.plan.fused_gate_preferred` holds, as in the FFN paths, else
    XLA's matmul then the pack kernel."""
    m = int(np.prod(x.shape[:-1])) if x.ndim > 1 else 1
    if fused_gate_preferred(m, w.shape[0], w.shape[1], tile, capacity, x.dtype):
        return binding.gate_pack(x, w, tile=tile, capacity=capacity)
    return pack_binding.pack_twell(relu_matmul(x, w), tile=tile, capacity=capacity)
