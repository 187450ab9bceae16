"""Plans: which kernels an FFN call runs, decided from what is static.

One pure function per op maps the call's shapes and dtype, what is known about the layer
(:class:`LayerInfo`) and the options (:class:`FFNOptions`, :class:`TrainOptions`: the
cost model and the variants to allow) to a frozen plan: :func:`plan_ffn` for inference,
:func:`plan_ffn_train` for training. Plans run anywhere (they are Python), so the CPU tests
check every decision; the CUDA implementations only execute them (a plan may leave one
choice to the device: sparse or dense, per call, by the counts of the gate activation).
Where the choices come from: docs/design.md, section 5 (Kernels).
"""

from __future__ import annotations

import dataclasses
import enum
import numbers

import jax.numpy as jnp

from jax_twell.ops import layout, xla
from jax_twell.ops.layout import (
    check_blocked_supported,
    check_row_supported,
    check_train_supported,
    decode_gate_supported,
    decode_rows_supported,
    decode_supported,
    fused_gate_supported,
    fused_gate_variant,
    row_supported,
    train_supported,
)
from jax_twell.ops.costs import DenseCrossover, TrainCrossover, train_crossover_for

__all__ = [
    "Side",
    "Kernel",
    "Path",
    "LayerInfo",
    "FFNOptions",
    "BlockedSteps",
    "FFNPlan",
    "plan_ffn",
    "TrainOptions",
    "TrainSteps",
    "TrainPlan",
    "plan_ffn_train",
    "default_train_rule",
    "row_supported",
    "check_row_supported",
    "check_blocked_supported",
    "train_supported",
    "check_train_supported",
    "decode_supported",
    "decode_gate_supported",
    "decode_rows_supported",
    "fused_gate_supported",
    "fused_gate_preferred",
    "fused_gate_variant",
    "FUSED_GATE_MIN_TOKENS",
]

FUSED_GATE_MIN_TOKENS = 2048  # from here the fused gate measured 1.08-1.14x faster than XLA's matmul + pack


class Side(enum.Enum):
    """Which side a call takes: decided by the cost model, or given."""

    AUTO = "auto"  # the rule: at trace time for a known active fraction, else per call on the device
    SPARSE = "sparse"  # the kernels (only exactness checks stay: the entry budget)
    DENSE = "dense"  # XLA's dense formula


class Kernel(enum.Enum):
    """The TwELL up + down kernel an inference plan may pick for prefill-sized calls."""

    AUTO = "auto"  # the blocked kernel with union products where the shape takes it, else the row kernel
    ROW = "row"  # one CTA a token row (ffi/twell_ffn.cu)
    BLOCKED = "blocked"  # 1024-token blocks sharing each weight slab, CUDA-core steps (ffi/twell_ffn_blocked.cu)
    BLOCKED_MMA = "blocked_mma"  # the same, up and down steps on tensor cores
    BLOCKED_UNION = "blocked_union"  # the same, up and down steps as products over each 64-token block's union
    WARP = "warp"  # one warp a token row, rows past the layout to a dense backup (ffi/twell_ffn_warp.cu)


class Path(enum.Enum):
    """What an inference plan runs."""

    EMPTY = "empty"  # no tokens: zeros
    DENSE = "dense"  # XLA's dense FFN
    GATHER = "gather"  # XLA, only the weights of the neurons active for some token
    DECODE_ROWS = "decode_rows"  # the rows kernel: whole FFN from weights stored by neuron
    DECODE_GATE = "decode_gate"  # our split-K gate kernel, then the decode kernel
    DECODE = "decode"  # XLA's gate matmul, then the decode kernel
    TILES = "tiles"  # the gate as TwELL, then the row or blocked kernel (or dense per call)
    WARP = "warp"  # the gate as TwELL, then the warp kernel and the dense backup (or dense per call)


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    """What is known about one FFN layer (all optional).

    Attributes:
      active_fraction: measured fraction of active (token, neuron) pairs (e.g.
        ``FFNAux.nnz_mean / f``): the sparse-or-dense choice is then made at trace time.
      union_fraction: measured mean union of active neurons over 64-token blocks, as a
        fraction of f (:func:`jax_twell.ops.stats.block_union_fraction`); it prices the
        union products (a trained layer's is about half the uniform pattern's).
      side: a side decided for the layer (a training loop's per-layer choice, a benchmark).
      overflow_fraction: measured fraction of tokens past the warp kernel's layout (more
        than ``layout.WARP_ROW_BUDGET`` active neurons, or a 256-neuron tile past its
        capacity): the rows its dense backup computes.
      kept_fraction: measured fraction of (token, neuron) pairs in the rows that fit that
        layout (the entries the warp kernel reads). With ``overflow_fraction`` it prices
        the warp path (:meth:`jax_twell.ops.costs.DenseCrossover.warp_cost`); without
        them a Poisson count at the mean stands in.
    """

    active_fraction: float | None = None
    union_fraction: float | None = None
    side: Side = Side.AUTO
    overflow_fraction: float | None = None
    kept_fraction: float | None = None

    def __post_init__(self):
        for name in ("active_fraction", "union_fraction", "overflow_fraction", "kept_fraction"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, numbers.Real) and 0.0 <= value <= 1.0):
                raise ValueError(f"{name} must be a Python float in [0, 1] or None, got {value!r}")
        if not isinstance(self.side, Side):
            raise TypeError(f"side must be a Side, got {self.side!r}")


# --- inference ------------------------------------------------------------------------------
def fused_gate_preferred(m: int, d: int, f: int, tile: int, capacity: int, dtype) -> bool:
    """Where the FFN paths pack the gate with the fused kernel: it takes the problem and
    measured faster than XLA's matmul + the pack (from ``FUSED_GATE_MIN_TOKENS`` tokens)."""
    return m >= FUSED_GATE_MIN_TOKENS and fused_gate_supported(d, f, tile, capacity, dtype)


@dataclasses.dataclass(frozen=True)
class FFNOptions:
    """Options of the inference plan (defaults: what the library runs).

    Attributes:
      tile, capacity: the TwELL layout of the gate activation.
      kernel: which up + down kernel prefill-sized calls may take (:class:`Kernel`).
      rule: the cost model (:class:`jax_twell.ops.costs.DenseCrossover`).
      fused_gate: pack the gate in the matmul's epilogue where it measured faster
        (:func:`fused_gate_preferred`); False: XLA's matmul + the pack kernel everywhere.
      gate_variant: the fused gate GEMM's configuration; None: :func:`fused_gate_variant`.
      device_backup: the warp path's rows past its layout go to the backup that reads
        their count on the device (no conditional; ffi/twell_backup.cu) where it takes
        the shape; False: a ``lax.switch`` over static backup sizes. A known layer with
        it and ``w_up.T`` given runs sparse from ``rule.layer_min_tokens_no_conditional``.
      choice_on_device: the per-call choice holds no conditional (the dense side behind a
        device flag: ``FFNKernels.warp_dense``, or the wgmma backup's flag); then a call
        with nothing known of its layer runs sparse from
        ``rule.per_call_min_tokens_no_conditional`` where that is set. Set by
        :func:`jax_twell.ops.ffn.cuda.sparse_ffn` from the kernels it is given.
    """

    tile: int = 256
    capacity: int = 32
    kernel: Kernel = Kernel.AUTO
    rule: DenseCrossover = DenseCrossover()
    fused_gate: bool = True
    gate_variant: int | None = None
    device_backup: bool = True
    choice_on_device: bool = False

    def __post_init__(self):
        object.__setattr__(self, "kernel", Kernel(self.kernel))  # a Kernel or its name


@dataclasses.dataclass(frozen=True)
class BlockedSteps:
    """How the blocked kernel runs its steps (named; the handler's ``mma`` attribute is
    built from them in one place, :func:`jax_twell.ops.ffn.binding.steps_attribute`).
    Each applies where the shape takes it (the binding checks), else the step before it."""

    tensor_cores: bool = False  # up and down steps on tensor cores
    up_union: bool = False  # the up step as a product over each 64-token block's union
    down_union: bool = False  # the down step likewise
    down_stationary: bool = False  # the down step on the weight stationary in shared memory (over down_union)


@dataclasses.dataclass(frozen=True)
class FFNPlan:
    """What one inference call runs (see :func:`plan_ffn`)."""

    path: Path
    layer: LayerInfo = LayerInfo()
    options: FFNOptions = FFNOptions()
    transposed: bool = True  # w_up comes as [f, d] (or the FFN is non-gated)
    decode_check: bool = False  # DECODE: a device check runs dense past rule.decode_dense_above
    gather_width: int = 0  # GATHER: neurons gathered
    fused_gate: bool = False  # TILES: the gate packed in the matmul's epilogue
    gate_variant: int = 0
    sample_rows: int = 0  # TILES: rows of g the device choice counts (XLA's gate)
    device_choice: bool = True  # TILES: sparse or dense decided per call (False: sparse)
    blocked: bool = False  # TILES: the blocked kernel is a candidate
    prefer_blocked: bool | None = None  # TILES: row or blocked, at trace time; None: on the device
    union_priced: bool = False  # the blocked kernel is priced with union products
    steps: BlockedSteps = BlockedSteps()
    max_entries: int = 0  # the blocked kernel's entry budget


def _kernel(options: FFNOptions, m: int, d: int, f: int, gated: bool) -> Kernel:
    kernel = options.kernel
    if kernel == Kernel.AUTO:
        kernel = Kernel.BLOCKED_UNION if layout.blocked_supported(d, options.tile) else Kernel.ROW
    if kernel == Kernel.BLOCKED_UNION:  # both union steps must run, else the same kernel without them
        e = layout.blocked_max_entries(m, f, options.tile, options.capacity)
        runs = (gated and m >= layout.BLOCKED_MIN_TOKENS and layout.union_up_supported(m, d, f, e)
                and layout.union_down_supported(m, d, f, e))
        kernel = kernel if runs else Kernel.BLOCKED_MMA
    return kernel


def _per_call_min_tokens(rule: DenseCrossover, options: FFNOptions, d: int, f: int, dtype) -> int:
    """Tokens below which a call with nothing known of its layer runs dense: the rule's
    ``per_call_min_tokens_no_conditional`` where one is set and the per-call choice holds
    no conditional (``options.choice_on_device``, the device backup and the warp kernel
    taking the shape), else its ``per_call_min_tokens``. Never raises
    ``per_call_min_tokens``."""
    no_conditional = (rule.per_call_min_tokens_no_conditional is not None and options.device_backup
                      and options.choice_on_device
                      and options.kernel == Kernel.AUTO and layout.warp_supported(d, dtype)
                      and layout.device_backup_supported(f))
    if not no_conditional:
        return rule.per_call_min_tokens
    return min(rule.per_call_min_tokens, max(rule.per_call_min_tokens_no_conditional, layout.WARP_MIN_TOKENS))


def _layer_min_tokens(rule: DenseCrossover, options: FFNOptions, d: int, f: int, dtype, transposed: bool) -> int:
    """Tokens from which a layer of known fraction runs sparse past the decode sizes: the
    rule's ``layer_min_tokens_no_conditional`` where its warp path holds no conditional
    (the device backup, ``w_up.T`` given), else its ``layer_min_tokens``. The lower floor
    counts only from ``layout.WARP_MIN_TOKENS`` (below it the TwELL path runs) and never
    raises ``layer_min_tokens``."""
    no_conditional = (options.device_backup and transposed and options.kernel == Kernel.AUTO
                      and layout.warp_supported(d, dtype) and layout.device_backup_supported(f))
    if not no_conditional:
        return rule.layer_min_tokens
    return min(rule.layer_min_tokens, max(rule.layer_min_tokens_no_conditional, layout.WARP_MIN_TOKENS))


def plan_ffn(m: int, d: int, f: int, dtype, *, gated: bool, layer: LayerInfo = LayerInfo(),
             options: FFNOptions = FFNOptions(), w_up_t: bool = False, w_act_t: bool = False) -> FFNPlan:
    """The inference plan for ``m`` tokens of ``x [m, d]`` in ``dtype`` through an FFN of
    ``f`` neurons; ``w_up_t``/``w_act_t``: whether the transposed weight copies are given.

    In order: no tokens; a given dense side; one token with both transposed weights given
    (a serving layer's cache) and nothing known: the rows kernel; decode sizes (the decode kernels where the
    rule's bounds say they win at the known fraction, or where the rule runs them unasked);
    known decode-sized layers past those bounds run dense; with nothing known of the layer
    (no fraction, no side, no kernel asked for), fewer tokens than the rule's
    ``per_call_min_tokens`` or d below its ``per_call_min_d`` run dense (the per-call
    choice costs more than it saves there); a known fraction with fewer tokens than its
    ``layer_min_tokens`` (``layer_min_tokens_no_conditional`` where the warp path holds no
    conditional: the device backup, ``w_up.T`` given), or one the rule prices dense, runs dense; else the warp or TwELL path, with the sparse-or-dense choice left to the device
    unless the side is known.
    """
    dtype = jnp.dtype(dtype)
    rule, af = options.rule, layer.active_fraction
    itemsize = dtype.itemsize
    kernel = _kernel(options, m, d, f, gated)
    transposed = w_up_t or not gated
    base = dict(layer=layer, options=options, transposed=transposed)
    if m == 0:
        return FFNPlan(Path.EMPTY, **base)
    if layer.side == Side.DENSE:
        return FFNPlan(Path.DENSE, **base)
    forced = layer.side == Side.SPARSE
    rows = w_act_t and transposed and m <= rule.decode_rows_max_tokens and decode_rows_supported(m, d, f, dtype)
    if rows and af is None and rule.decode_rows_unasked and options.kernel == Kernel.AUTO:
        # A serving layer that keeps both transposed weights: one token streams the gate's
        # weight and then only the active neurons' rows, at any density about dense's bytes.
        return FFNPlan(Path.DECODE_ROWS, **base)
    known = af is not None and transposed and rule.decode_wins(m, af)
    if (known or 0 < m <= rule.decode_kernel_max_tokens) and decode_supported(d, f, dtype):
        unchecked = known or forced or rule.decode_dense_above is None
        if unchecked and rows:
            return FFNPlan(Path.DECODE_ROWS, **base)
        if unchecked and rule.decode_fused_gate and m <= rule.decode_fused_gate_max_tokens and \
                decode_gate_supported(m, d, f):
            return FFNPlan(Path.DECODE_GATE, **base)
        return FFNPlan(Path.DECODE, decode_check=not unchecked, **base)
    tile, capacity = options.tile, options.capacity
    warp = layout.warp_supported(d, dtype) and (
        options.kernel == Kernel.WARP or (options.kernel == Kernel.AUTO and m >= layout.WARP_MIN_TOKENS))
    if not forced:
        # Decode-sized with the fraction known past the decode kernels' bound: the row
        # kernel would lose there (0.16x measured at M=4, 2% active).
        if af is not None and transposed and rule.decode_sized(m):
            return FFNPlan(Path.DENSE, **base)
        if 0 < m <= rule.decode_gather_max_tokens:
            return FFNPlan(Path.GATHER, gather_width=xla.gather_width(m, f, rule.decode_active_per_token), **base)
        if af is None and options.kernel == Kernel.AUTO and (m < _per_call_min_tokens(rule, options, d, f, dtype)
                                                             or d < rule.per_call_min_d):
            return FFNPlan(Path.DENSE, **base)  # nothing known: the per-call choice would cost more than it saves
        if af is not None and options.kernel == Kernel.AUTO and m < _layer_min_tokens(rule, options, d, f, dtype,
                                                                                        transposed):
            return FFNPlan(Path.DENSE, **base)  # a known layer past decode sizes: measured losing in a model
        if not rule.sparse_can_win(m, d, f, itemsize, transposed):
            return FFNPlan(Path.DENSE, **base)
        device_form = warp and options.device_backup and layout.device_backup_supported(f)
        if af is not None and device_form and options.kernel == Kernel.AUTO and d < rule.per_call_min_d:
            return FFNPlan(Path.DENSE, **base)  # every sparse path measured below dense at d=512 (0.40-0.90x)
        if af is not None and device_form:  # priced as the warp path that runs, its backed-up rows included
            if not rule.warp_predicted(m, d, f, itemsize, af, layer.overflow_fraction, layer.kept_fraction,
                                       transposed, gated):
                return FFNPlan(Path.DENSE, **base)
        elif af is not None and not rule.sparse_predicted(m, d, f, itemsize, af, transposed, kernel.value,
                                                          layer.union_fraction):
            return FFNPlan(Path.DENSE, **base)
    if warp:
        # Known or forced: the fused gate and no device check (the backup's overflow still
        # runs dense); otherwise XLA's gate, so a call that turns out dense reuses g. (A
        # per-call form that chose from a sample of rows' gate, then packed with the fused
        # gate, measured slower: its second device branch cost more than g's round trip.)
        fused = options.fused_gate and (forced or af is not None) and fused_gate_preferred(m, d, f, tile, capacity, dtype)
        return FFNPlan(Path.WARP, fused_gate=fused, gate_variant=fused_gate_variant(d) if options.gate_variant is None
                       else options.gate_variant, device_choice=not forced and af is None, **base)
    # Where the sparse side is expected the fused gate packs in the matmul's epilogue; a call
    # that then runs dense recomputes the gate. Otherwise XLA's matmul writes g and the
    # device choice reads a sample of its rows.
    fused = options.fused_gate and (forced or af is not None) and fused_gate_preferred(m, d, f, tile, capacity, dtype)
    plan = dict(fused_gate=fused, gate_variant=fused_gate_variant(d) if options.gate_variant is None
                else options.gate_variant, sample_rows=rule.sample_rows(m), device_choice=not forced, **base)
    if kernel == Kernel.ROW or m < layout.BLOCKED_MIN_TOKENS or dtype == jnp.float32:
        return FFNPlan(Path.TILES, **plan)
    check_blocked_supported(d, tile)
    union = kernel == Kernel.BLOCKED_UNION
    if forced:
        prefer = True
    elif af is not None:  # row or blocked (both exact): at trace time, no second device branch
        prefer = rule.blocked_preferred(m, d, f, itemsize, af, transposed, kernel.value, layer.union_fraction)
    else:
        prefer = None
    steps = BlockedSteps(
        tensor_cores=kernel != Kernel.BLOCKED, up_union=union, down_union=union,
        down_stationary=union and rule.down_stationary(m, d, f, itemsize, af, transposed),
    )
    return FFNPlan(Path.TILES, blocked=True, prefer_blocked=prefer, union_priced=union, steps=steps,
                   max_entries=layout.blocked_max_entries(m, f, tile, capacity), **plan)


# --- training -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TrainOptions:
    """Options of the training plan (defaults: what the library runs).

    Attributes:
      width: the hybrid format's row width: statistics count rows past it
        (``FFNAux.rows_over_capacity``) and the kernels' entry budget is ``width`` a token.
      backup_capacity: rows past ``width`` the sparse side takes at most, computed dense
        over their gathered rows (the hybrid format's backup; sizes
        :func:`jax_twell.ops.layout.train_backup_buckets`, None: up to a quarter of the
        tokens); a call with more runs dense (exact).
      rule: the cost model; None: :func:`default_train_rule` for the steps that run.
      tensor_cores: the up, down and dh steps on tensor cores (False: the bit-exact CUDA-core steps).
      dx_tensor_cores: dx on tensor cores too (None: as ``tensor_cores``).
      up_union, down_union, dh_union, dx_union: those steps as products over each 64-token
        block's union of active neurons (with tensor cores; where the shape takes them).
      down_stationary, dx_stationary: the forward's down step and the backward's dx by the
        walk with the weights stationary in shared memory; None: where the inference rule
        prices the walk below the union product.
      fused_gate: a call decided for the kernels packs the gate in the matmul's epilogue
        where it measured faster; False: XLA's matmul + the pack kernel.
    """

    width: int = 128
    backup_capacity: int | None = None
    rule: TrainCrossover | None = None
    tensor_cores: bool = True
    dx_tensor_cores: bool | None = None
    up_union: bool = True
    down_union: bool = True
    dh_union: bool = True
    dx_union: bool = True
    down_stationary: bool | None = None
    dx_stationary: bool | None = None
    fused_gate: bool = True


@dataclasses.dataclass(frozen=True)
class TrainSteps:
    """How the training kernels run their steps (named; the handlers' ``mma`` attributes are
    built from them in :mod:`jax_twell.ops.ffn_train.binding`)."""

    tensor_cores: bool = False
    dx_tensor_cores: bool = False
    up_union: bool = False
    down_union: bool = False
    dh_union: bool = False
    dx_union: bool = False
    down_stationary: bool = False
    dx_stationary: bool = False


@dataclasses.dataclass(frozen=True)
class TrainPlan:
    """What one training call runs (see :func:`plan_ffn_train`)."""

    kernels: bool  # False: XLA autodiff of the dense formula
    width: int = 128
    backup_capacity: int | None = None
    max_entries: int = 0
    rule: TrainCrossover = TrainCrossover()
    device_choice: bool = True  # sparse or dense per call by the rule (False: decided sparse)
    fused_gate: bool = False
    steps: TrainSteps = TrainSteps()


def _walks(m: int, d: int, f: int, itemsize: int, gated: bool, max_entries: int, options: TrainOptions,
           dx_mma: bool, active_fraction: float | None) -> tuple[bool, bool, bool]:
    """``(down_stationary, dx_stationary, walks)``: each as asked, or where the inference
    rule prices the walk below the union product (dx by default only where its two walks
    hold 16 columns a CTA, the shapes measured); ``walks``: both run (dx's alone non-gated)."""
    down, dx = options.down_stationary, options.dx_stationary
    if down is None or dx is None:
        pays = DenseCrossover().down_stationary(m, d, f, itemsize, active_fraction)
        down = pays if down is None else down
        dx = pays and (not gated or layout.walk_cols(f) == 16) if dx is None else dx
    down = options.tensor_cores and gated and bool(down)
    dx = dx_mma and bool(dx)
    walks = (dx and layout.walk_supported(m, d, f, max_entries, 2 if gated else 1)
             and (not gated or (down and layout.stationary_down_supported(m, d, f, max_entries))))
    return down, dx, walks


def default_train_rule(m: int, d: int, f: int, itemsize: int, *, gated: bool = True, width: int = 128) -> TrainCrossover:
    """The training rule a call of this shape uses by default: the default fit where the
    stationary walks run, the union steps' fit where they do not."""
    walks = _walks(m, d, f, itemsize, gated, layout.train_max_entries(m, f, width), TrainOptions(width=width),
                   True, None)[2]
    return train_crossover_for(walks)


def plan_ffn_train(m: int, d: int, f: int, dtype, *, gated: bool, layer: LayerInfo = LayerInfo(),
                   options: TrainOptions = TrainOptions()) -> TrainPlan:
    """The training plan for ``m`` tokens of ``x [m, d]`` in ``dtype`` (raises where the
    kernels can't take d: :func:`check_train_supported`).

    XLA autodiff for no tokens, f32, a given dense side, where even no active pair would
    pay the kernels' fixed costs, or a known fraction the rule prices dense; else the
    kernels, deciding sparse or dense per call on the device unless the side is known
    (a known fraction the rule prices sparse, or a given sparse side: then only the entry
    budget is checked per call).
    """
    dtype = jnp.dtype(dtype)
    check_train_supported(d)
    if layer.union_fraction is not None and layer.active_fraction is None and layer.side == Side.AUTO:
        raise ValueError("union_fraction is a trace-time measurement: give it with active_fraction")
    base = dict(width=options.width, backup_capacity=options.backup_capacity)
    if m == 0 or dtype == jnp.float32 or layer.side == Side.DENSE:
        return TrainPlan(False, **base)
    itemsize = dtype.itemsize
    mma = options.tensor_cores
    dx_mma = bool(mma if options.dx_tensor_cores is None else options.dx_tensor_cores)
    max_entries = layout.train_max_entries(m, f, options.width)
    down_stationary, dx_stationary, walks = _walks(m, d, f, itemsize, gated, max_entries, options, dx_mma,
                                                   layer.active_fraction)
    rule = train_crossover_for(walks, options.rule)
    decided = layer.side == Side.SPARSE
    if not decided:
        if not rule.sparse_can_win(m, d, f, itemsize):
            return TrainPlan(False, **base)
        if layer.active_fraction is not None:
            if not rule.prefers_sparse(m, d, f, itemsize, layer.active_fraction, layer.union_fraction):
                return TrainPlan(False, **base)
            decided = True
    steps = TrainSteps(
        tensor_cores=mma, dx_tensor_cores=dx_mma, up_union=mma and options.up_union,
        down_union=mma and options.down_union, dh_union=mma and options.dh_union,
        dx_union=dx_mma and options.dx_union, down_stationary=down_stationary, dx_stationary=dx_stationary,
    )
    fused = options.fused_gate and decided and fused_gate_preferred(m, d, f, layout.TRAIN_TILE,
                                                                    layout.TRAIN_CAPACITY, dtype)
    return TrainPlan(True, max_entries=max_entries, rule=rule, device_choice=not decided, fused_gate=fused,
                     steps=steps, **base)
