"""CUDA training FFN (ffi/twell_train.cu): sparse forward with sparse residuals, custom_vjp
backward, and the per-call dense crossover. Notes: ffi/notes/training_kernels.md; NumPy
model of the kernels: :mod:`jax_twell.ops.train_emulation`.

Layout: the blocked TwELL layout of the inference kernel (tile 256, capacity 32, token
blocks of 1024). The forward saves, per stored entry, the gate value and u (plus the
entries sorted by neuron), never an ``[M, f]`` tensor; the backward reads them.

``sparse_ffn_train(implementation=None)`` does not pick these kernels yet
(:data:`TRAINING_KERNELS_DEFAULT` is False until they are measured); pass
``implementation="cuda"``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_twell._kernels import kernel_call
from jax_twell.formats import TwELL, relu_matmul
from jax_twell.ops import blocked_emulation as _blocked
from jax_twell.ops import stationary_emulation as _stat
from jax_twell.ops import union_emulation as _union
from jax_twell.ops import cuda, reference, xla
from jax_twell.ops.common import RuleSlot

__all__ = [
    "TRAINING_KERNELS_DEFAULT",
    "TrainCrossover",
    "ffn_with_aux",
    "train_forward",
    "train_backward",
    "Residuals",
    "residual_shapes",
    "forward_down_stationary",
    "max_entries_for",
    "supports",
    "check_supported",
    "train_crossover",
    "set_train_crossover",
    "crossover_for",
]

# implementation=None keeps "xla" for training until the kernels are measured on a GPU.
TRAINING_KERNELS_DEFAULT = False

TILE = 256
CAPACITY = 32
TOKEN_SHIFT = 18  # by_col word: token in block << 18 | entry within the segment


def check_supported(d: int, dtype) -> None:
    """Raises ValueError naming the constraint when the training kernels can't take ``d``.

    d must be a multiple of 64 and at most 16384 (the blocked layout's column ranges).
    f32 is accepted by :func:`ffn_with_aux` and runs dense through XLA (documented).
    """
    if d % _blocked.UP_COLS or d > 16384:
        raise ValueError(
            f"the CUDA training FFN needs d a multiple of {_blocked.UP_COLS} and at most 16384, got d={d}; "
            "use implementation='xla' or 'reference'"
        )
    del dtype


def supports(d: int, dtype) -> bool:
    """Whether the training kernels take model width ``d`` and ``dtype`` (what
    :func:`check_supported` raises for, as a bool)."""
    try:
        check_supported(d, dtype)
    except ValueError:
        return False
    return True


def max_entries_for(m: int, f: int, width: int) -> int:
    """Entry budget of the residual/workspace buffers for ``m`` tokens: ``width`` entries
    per token on average (never more than the TwELL's slots), at least one tile."""
    n_tiles = -(-f // TILE)
    return max(TILE, m * min(width, n_tiles * CAPACITY))


@dataclasses.dataclass(frozen=True)
class TrainCrossover:
    """When the training FFN runs the sparse kernels, and when dense math through XLA.

    Both sides share the forward gate matmul; the rule compares what follows, in seconds:

    - dense: XLA autodiff of the rest, 8 matmuls of ``2 M d f`` at ``matmul_rate``;
    - sparse: the pack (``M f`` elements at ``hbm_bandwidth``), the per-call transposes
      (``5 d f`` at ``transpose_bandwidth``), ``8 d`` FMA per active pair at
      ``pair_rate``, the weight gradients' x/dy slices (``2 d`` elements per pair at
      ``grad_stream_bandwidth``, slowed by ``1 + 2 M d itemsize / grad_stream_spill``:
      the slices miss L2 more as x and dy outgrow it), the union products' rows (per
      64-token block, its union of active neurons times ``5 d`` elements, one row of each
      table the products read, at ``union_bandwidth``), ``overflow_penalty`` per
      overflowed tile and ``fixed_overhead``.

    The union term takes a layer's measured mean 64-token union where it is given (a
    trained layer's is well below the uniform pattern's at the same density, and its step
    is that much faster); otherwise the uniform pattern's ``1 - (1 - p)^64`` at ``p``
    active, the largest union a density has in practice, so the estimate errs toward dense.

    Sparse runs where its entries fit the budget and its estimate is below ``margin`` times
    the dense one (decided on the device, per call, or at trace time given the layer's
    fractions: :meth:`prefers_sparse`). Below ``min_tokens`` tokens the kernels never run
    (trace time: pure XLA autodiff). ``margin=inf`` forces the kernels (when the entries
    fit), ``margin=0`` forces dense. Constants fitted to the H200 benchmark
    (``benchmarks/fit_train_rule.py``; ffi/notes/training_kernels.md).
    """

    # Fitted on the H200 (benchmarks/fit_train_rule.py on the three training_fit_e593e40
    # files: 31 points, M = 4,096, 16,384 and 65,536, 0.25-1.27% active, uniform,
    # heavy-tailed and skewed rows; d=2048, f=5632; the kernels of e593e40: dx by two walks,
    # the layout passes of 810a7f9-1348364, S6's trimmed loop). Model within 8% of 25
    # points, +10.6% and +15.2% at M=65,536 0.74% / 0.99% uniform (over-priced: the safe
    # side), -9.8 to -17.2% at five 0.25% points (sparse either way). Timed as a training
    # step takes it (value_and_grad: XLA's dense step runs its nine matmuls, the forward's
    # down matmul included), so matmul_rate is the dense step's own rate past the gate
    # (7.4e14: eight matmuls of m d f in ~4.1 ms at M=16,384) and the gate a ninth of the
    # step. The kernels won at every point of the sweep (lowest 1.09x, M=4,096, 1% uniform)
    # and the rule picks them at all 31. (Before: 7cd0811, 0.271 ms fixed, 1.38e13 pairs,
    # 3.11e13 union, 8.4e8 spill; 64666f9 0.285 ms, 1.46e13, 2.73e13; 2cb8fdd 0.403 ms,
    # 1.36e13, 3.16e13; 241db25 ~1.9 ns per pair and ~2.3 ns per union row at M=16,384;
    # a26fd98 ~3.61 ns per pair.)
    matmul_rate: float = 7.397e14
    hbm_bandwidth: float = 3.0e12
    union_bandwidth: float = 2.28e13
    transpose_bandwidth: float = 1.4e12
    pair_rate: float = 2.167e13
    grad_stream_bandwidth: float = 7.0e12
    grad_stream_spill: float = 7.716e8
    overflow_penalty: float = 2.0e-6
    fixed_overhead: float = 0.2491e-3
    margin: float = 1.0
    min_tokens: int = 256

    def dense_cost(self, m: int, d: int, f: int) -> float:
        """Seconds of XLA's dense forward + backward for ``m`` tokens past the gate matmul
        (which both sides run): eight matmuls of ``m d f`` FMAs at ``matmul_rate``."""
        return 16.0 * m * d * f / self.matmul_rate

    def sparse_fixed_cost(self, m: int, d: int, f: int, itemsize: int) -> float:
        """Seconds the kernels' step pays whatever its entries: ``fixed_overhead``, the pack
        of the ``M x f`` activation and the per-call weight transposes."""
        pack = m * f * itemsize / self.hbm_bandwidth
        return self.fixed_overhead + pack + 5.0 * d * f * itemsize / self.transpose_bandwidth

    def pair_cost(self, m: int, d: int, itemsize: int) -> float:
        """Seconds per active pair in a call of ``m`` tokens: the FMAs of the up, down and
        backward steps, and the weight gradients' x/dy slices."""
        spill = 1.0 + 2.0 * m * d * itemsize / self.grad_stream_spill
        return 8.0 * d / self.pair_rate + 2.0 * d * itemsize / self.grad_stream_bandwidth * spill

    @staticmethod
    def uniform_union(active_fraction):
        """The mean 64-token union, as a fraction of f, of the uniform pattern with
        ``active_fraction`` of the pairs active: ``1 - (1 - p)^64`` (Python float or
        array)."""
        return _union.uniform_union(active_fraction)

    def union_bytes(self, m: int, d: int, f: int, itemsize: int, union_fraction) -> float:
        """Bytes of table rows the union products read for ``m`` tokens whose 64-token
        blocks' mean union is ``union_fraction`` of f."""
        blocks = -(-m // _union.TOKENS)
        return blocks * union_fraction * f * 5.0 * d * itemsize

    def sparse_cost(self, nnz, n_overflow, m: int, d: int, f: int, itemsize: int, union=None) -> jax.Array:
        """``[]`` f32 seconds of the kernels for ``nnz`` active pairs and ``n_overflow``
        overflowed tiles (device values); ``union`` the measured mean 64-token union as a
        fraction of f, else the uniform pattern's at this density."""
        nnz = jnp.asarray(nnz).astype(jnp.float32)
        union = self.uniform_union(nnz / max(m * f, 1)) if union is None else jnp.asarray(union, jnp.float32)
        cost = self._estimate(nnz, union, m, d, f, itemsize)
        return cost + jnp.asarray(n_overflow).astype(jnp.float32) * self.overflow_penalty

    def _estimate(self, nnz, union, m: int, d: int, f: int, itemsize: int):
        """Seconds without overflow: plain arithmetic, on Python floats (at trace time)
        or device arrays alike."""
        return (nnz * self.pair_cost(m, d, itemsize) + self.sparse_fixed_cost(m, d, f, itemsize)
                + self.union_bytes(m, d, f, itemsize, union) / self.union_bandwidth)

    def prefers_sparse(self, m: int, d: int, f: int, itemsize: int, active_fraction: float,
                       union_fraction: float | None = None) -> bool:
        """Static: True where the kernels are predicted faster for calls of ``m`` tokens
        with ``active_fraction`` of the (token, neuron) pairs active and, where measured,
        a mean 64-token union of ``union_fraction`` of f (no overflow assumed). What
        :func:`ffn_with_aux` decides at trace time when given ``active_fraction``."""
        if not 0.0 <= active_fraction <= 1.0:
            raise ValueError(f"active_fraction must be in [0, 1], got {active_fraction}")
        if union_fraction is not None and not 0.0 <= union_fraction <= 1.0:
            raise ValueError(f"union_fraction must be in [0, 1], got {union_fraction}")
        if self.margin == float("inf"):
            return True
        if self.margin <= 0 or not self.sparse_can_win(m, d, f, itemsize):
            return False
        union = self.uniform_union(active_fraction) if union_fraction is None else union_fraction
        # in Python floats: this runs while tracing, where jnp would stage it
        return self._estimate(active_fraction * m * f, union, m, d, f, itemsize) < self.margin * self.dense_cost(m, d, f)

    def sparse_can_win(self, m: int, d: int, f: int, itemsize: int) -> bool:
        """Static: False where the kernels should not even be traced (tiny M, fixed costs)."""
        if self.margin == float("inf"):
            return True
        if m < self.min_tokens:
            return False
        return self.sparse_fixed_cost(m, d, f, itemsize) < self.margin * self.dense_cost(m, d, f)

    def use_sparse(self, nnz, n_overflow, m: int, d: int, f: int, itemsize: int) -> jax.Array:
        """``[]`` bool on the device: True where the sparse kernels should run (the union
        estimated from the density, as the uniform pattern's)."""
        if self.margin == float("inf"):
            return jnp.bool_(True)
        return self.sparse_cost(nnz, n_overflow, m, d, f, itemsize) < self.margin * self.dense_cost(m, d, f)


_crossover = RuleSlot(TrainCrossover())

# The constants of the fit before the walks (241db25: the forward's down step and dx as
# union products, 31 points at d=2048, f=5632). The default rule's fit (7cd0811) holds
# where both walks run; where they do not (f past 7,264, where dx's walks hold 8 columns a
# CTA and ffn_with_aux does not choose them by default; or the walks switched off), the
# union products they replace run again and
# ffn_with_aux prices them with these, and the dense side at the matmul rate they were
# fitted with (jax.grad steps, 8.58e14): those shapes keep the decisions they were measured
# with.
UNION_STEPS_CONSTANTS = dict(union_bandwidth=8.86e12, pair_rate=3.07e13, grad_stream_spill=7.24e8,
                             fixed_overhead=0.370e-3, matmul_rate=8.58e14)


def crossover_for(m: int, d: int, f: int, itemsize: int, *, gated: bool = True, width: int = 128,
                  walks: bool | None = None) -> TrainCrossover:
    """The rule for training calls of this shape: :func:`train_crossover`, with
    :data:`UNION_STEPS_CONSTANTS` where it is the default rule and the stationary walks (the
    forward's down step, gated, and dx) do not run (``walks``; None: as :func:`ffn_with_aux`
    runs them by default). A rule set by :func:`set_train_crossover` is returned as set."""
    rule = _crossover.get()
    if walks is None:
        walks = _walk_steps(m, d, f, itemsize, gated, max_entries_for(m, f, width))[2]
    if rule == TrainCrossover() and not walks:
        return dataclasses.replace(rule, **UNION_STEPS_CONSTANTS)
    return rule


def train_crossover() -> TrainCrossover:
    """The rule :func:`ffn_with_aux` uses now (inspectable)."""
    return _crossover.get()


def set_train_crossover(rule: TrainCrossover) -> TrainCrossover:
    """Replaces the training crossover rule for later traces; returns the previous one."""
    return _crossover.set(rule)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Residuals:
    """What the sparse forward keeps for the backward (besides x and the weights).

    seg_start ``[n_blocks * n_tiles + 1]`` s32, tok_off ``[n_blocks, n_tiles, 1025]`` s32:
    the blocked layout; entries ``[E]`` u32: ``g bits << 16 | flag << 15 | column``; up
    ``[E]`` u16: u bits (gated; None otherwise); col_off ``[n_blocks, n_tiles, tile + 1]``
    s32 and by_col ``[E]`` u32: each segment's entries with g != 0 by (column, token).
    stat_order ``[stationary_emulation.order_words(M)]`` s32: the tokens' order of the gated
    forward's stationary down walk (ranks, order, group offsets), which the backward's dx
    walk takes instead of computing it again from the same counts; None where the forward
    ran another down step.
    """

    seg_start: jax.Array
    tok_off: jax.Array
    entries: jax.Array
    up: jax.Array | None
    col_off: jax.Array
    by_col: jax.Array
    stat_order: jax.Array | None = None


def residual_shapes(m: int, n_tiles: int, tile: int, max_entries: int, gated: bool,
                    down_stationary: bool = False) -> Residuals:
    """Shapes and dtypes of :class:`Residuals` for ``m`` tokens (``down_stationary``: the
    forward ran its down step with the weight stationary, and kept its token order)."""
    n_blocks = -(-m // _blocked.BLOCK_TOKENS)
    s = jax.ShapeDtypeStruct
    return Residuals(
        seg_start=s((n_blocks * n_tiles + 1,), jnp.int32),
        tok_off=s((n_blocks, n_tiles, _blocked.BLOCK_TOKENS + 1), jnp.int32),
        entries=s((max_entries,), jnp.uint32),
        up=s((max_entries,), jnp.uint16) if gated else None,
        col_off=s((n_blocks, n_tiles, tile + 1), jnp.int32),
        by_col=s((max_entries,), jnp.uint32),
        stat_order=s((_stat.order_words(m),), jnp.int32) if gated and down_stationary else None,
    )


def forward_down_stationary(m: int, d: int, f: int, max_entries: int, gated: bool, down_stationary: bool) -> bool:
    """Whether :func:`train_forward` runs its down step with the weight stationary (and so
    keeps ``Residuals.stat_order``) when asked ``down_stationary``."""
    return bool(down_stationary) and gated and stationary_down_supported(m, d, f, max_entries)


def union_down_supported(m: int, d: int, f: int, max_entries: int) -> bool:
    """Whether the gated forward's down step can run as a union product
    (``train_forward(down_union=True)``): as :func:`union_dx_supported` with one row per
    neuron, its layout within the up step's partials workspace ``[d / 64, max_entries]`` f32
    (the handler's test)."""
    return _union.down_supported(m, d, f, max_entries)


def _walk_steps(m: int, d: int, f: int, itemsize: int, gated: bool, max_entries: int, down_stationary=None,
                dx_stationary=None, mma: bool = True, dx_mma: bool = True, active_fraction=None):
    """``(down_stationary, dx_stationary, walks)`` as :func:`ffn_with_aux` decides them: each
    as given, or by default (``*_STATIONARY_DEFAULT``) where the inference rule prices the
    walk below the union product (the dx walk reads twice the words and two tables'
    unions); ``walks``: both run here (dx's alone non-gated)."""
    if down_stationary is None or dx_stationary is None:
        pays = cuda.dense_crossover().down_stationary(m, d, f, itemsize, active_fraction)
        down_stationary = DOWN_STATIONARY_DEFAULT and pays if down_stationary is None else down_stationary
        # gated, by default where dx's two walks hold 16 columns a CTA (f <= 7,264), the shapes
        # measured; past that (8 columns) only when asked
        dx_default = DX_STATIONARY_DEFAULT and pays and (not gated or _stat.cols(f) == 16)
        dx_stationary = dx_default if dx_stationary is None else dx_stationary
    down_stationary = bool(mma) and gated and bool(down_stationary)
    dx_stationary = bool(dx_mma) and bool(dx_stationary)
    walks = (dx_stationary and stationary_dx_supported(m, d, f, max_entries, gated)
             and (not gated or (down_stationary and stationary_down_supported(m, d, f, max_entries))))
    return down_stationary, dx_stationary, walks


def stationary_down_supported(m: int, d: int, f: int, max_entries: int) -> bool:
    """Whether the gated forward's down step can run with the weight stationary
    (``train_forward(down_stationary=True)``): f at most 14,524, d a multiple of the 16 (8
    where f > 7,264) columns of Wd a CTA holds, and the walk's workspace within the partials
    ``[d / 64, max_entries]`` f32 (the handler's test, as the inference step's:
    :func:`jax_twell.ops.cuda.stationary_down_supported`)."""
    return _stat.supported(m, d, f, max_entries)


def union_up_supported(m: int, d: int, f: int, max_entries: int) -> bool:
    """Whether the gated forward's up step can run as a union product
    (``train_forward(up_union=True)``): f at most 65536 and its layout (~4 words per entry)
    within rows 1.. of the partials workspace ``[d / 64, max_entries]``, so d at least 320
    (the handler's test)."""
    return _union.up_supported(m, d, f, max_entries)


def train_forward(x, act: TwELL, w_act, w_up, w_down, *, max_entries: int, w_up_t=None, mma: bool = False,
                  down_union: bool = False, up_union: bool = False, down_stationary: bool = False):
    """One ``jax_twell_train_fwd[_gated]`` call: ``(y, Residuals, h_source)``.

    x ``[M, d]`` bf16/f16; act: TwELL of ``relu(x @ w_act)`` (tile <= 256); w_up None for
    the non-gated FFN. ``h_source`` ``[E]`` u32 holds h in its high half (h words, or the
    entries themselves when non-gated). Entries past ``seg_start[-1]`` are unwritten.
    ``mma``: the up and down steps on tensor cores (measured no faster, training_kernels.md; sums equal
    to f32 rounding, not bitwise, see ffi/notes/twell_ffn_blocked.md). ``down_union`` (gated,
    where :func:`union_down_supported` allows): y as a dense product over each 64-token
    block's union of active neurons (ffi/twell_union.cuh; the same h, f32 sums in another
    order). On by default in :func:`ffn_with_aux` (:data:`DOWN_UNION_DEFAULT`). ``up_union``
    (gated, where :func:`union_up_supported` allows): u of every entry from a dense product
    of each 64-token block's x with its union's rows of Wu^T (f32 sums over d in another
    order: the up residual and h may differ from the per-entry step's in their last bit;
    :data:`UP_UNION_DEFAULT`). ``down_stationary`` (gated, where
    :func:`stationary_down_supported` allows; taking precedence over ``down_union``): y by
    the inference down step that holds 16 (or 8) columns of Wd in each CTA's shared memory
    while it walks every token's h words (ffi/twell_stationary.cuh; y in the order
    jax_twell/ops/stationary_emulation.py models). Residuals and h words are the same in
    every down step.
    """
    m, d = x.shape
    e, tile = max_entries, act.tile
    f = w_down.shape[0]
    down_union = bool(down_union) and w_up is not None and union_down_supported(m, d, f, e)
    up_union = bool(up_union) and w_up is not None and union_up_supported(m, d, f, e)
    down_stationary = forward_down_stationary(m, d, f, e, w_up is not None, down_stationary)
    down_union = down_union and not down_stationary
    # the handler's bits: 0 tensor-core steps, 2 down and 3 up as union products, 4 down stationary
    mma = int(bool(mma)) | int(down_union) << 2 | int(up_union) << 3 | int(down_stationary) << 4
    r = residual_shapes(m, act.n_tiles, tile, e, w_up is not None, down_stationary)
    layout = [r.seg_start, r.tok_off, r.entries]
    by_column = [r.col_off, r.by_col]
    y_type = jax.ShapeDtypeStruct(x.shape, x.dtype)
    if w_up is None:
        call = kernel_call("jax_twell_train_fwd", (y_type, *layout, *by_column), vmap_method="sequential")
        y, seg_start, tok_off, entries, col_off, by_col = call(
            x, act.values, act.cols, act.counts, w_act, w_down, tile=np.int32(tile), mma=np.int32(mma)
        )
        return y, Residuals(seg_start, tok_off, entries, None, col_off, by_col), entries
    if w_up_t is None:
        w_up_t = w_up.T
    gated_ws = [
        jax.ShapeDtypeStruct((e,), jnp.uint16),
        jax.ShapeDtypeStruct((e,), jnp.uint32),
        jax.ShapeDtypeStruct((d // _blocked.UP_COLS, e), jnp.float32),
    ]
    # the down walk's token order (a residual), else one unused word
    order = r.stat_order if down_stationary else jax.ShapeDtypeStruct((1,), jnp.int32)
    call = kernel_call("jax_twell_train_fwd_gated", (y_type, *layout, *gated_ws, *by_column, order),
                       vmap_method="sequential")
    y, seg_start, tok_off, entries, up, h_words, _, col_off, by_col, stat_order = call(
        x, act.values, act.cols, act.counts, w_act, w_up, w_up_t, w_down, tile=np.int32(tile), mma=np.int32(mma)
    )
    res = Residuals(seg_start, tok_off, entries, up, col_off, by_col, stat_order if down_stationary else None)
    return y, res, h_words


# The forward's down step as a union product by default (ffn_with_aux): measured 0.13-0.14 ms
# faster per step at 0.25% active, -0.08 / +0.02 ms (uniform / heavy) at 0.5%
# (training_eb8bc79_union_down.json).
DOWN_UNION_DEFAULT = True
# The forward's down step with the weight stationary (ffn_with_aux), where the inference
# rule prices it below the union product (DenseCrossover.down_stationary): the same kernel
# as the inference call's down step.
DOWN_STATIONARY_DEFAULT = True
# dx by the stationary walk (ffn_with_aux), where the same price says so.
DX_STATIONARY_DEFAULT = True
# The forward's up step as a union product by default (ffn_with_aux): measured 0.05-0.07 ms
# faster per step at 0.5% active, 0.005-0.06 ms at 0.25% (training_725c27c_union_up.json).
UP_UNION_DEFAULT = True
# dx as a union product by default (ffn_with_aux): measured 0.24-0.35 ms faster per step
# than the per-entry tensor-core dx at 0.25-0.5% active (training_e16d5b5.json).
DX_UNION_DEFAULT = True
# The backward's dh step as a union product by default (ffn_with_aux, with mma): the forward
# up step's product with dy and Wd. Measured 0.04-0.17 ms faster per step at 0.25-0.5%
# active (training_quick_3be377b_dh_union.json).
DH_UNION_DEFAULT = True


def union_workspace_ints(m: int, max_entries: int, gated: bool) -> int:
    """Words of the union product's layout (ffi/twell_union_layout.cuh, UnionLayoutOf; modelled by
    :mod:`jax_twell.ops.union_emulation`): per 64-token block a meta record, and ranges
    placed by the entries before the block for its entry words, table rows and chunk
    offsets (a block's union has at most as many neurons as it has entries)."""
    return _union.workspace_ints(m, max_entries, gated)


def grad_workspace_ints(m: int, f: int, tile: int, max_entries: int) -> int:
    """Words of the weight gradients' neuron-major lists (ffi/twell_train.cu, GradWorkspaceOf):
    a 4-word record per entry, each tile's list starts ``[n_tiles, tile + 1]`` and each
    (block, tile) segment's first record per neuron ``[blocks, n_tiles, tile]``."""
    n_tiles = -(-f // tile)
    n_blocks = -(-m // _blocked.BLOCK_TOKENS)
    return 4 * max_entries + n_tiles * (tile + 1) + n_blocks * n_tiles * tile


def union_dx_supported(m: int, d: int, f: int, max_entries: int, gated: bool) -> bool:
    """Whether dx can run as a union product (``train_backward(dx_union=True)``) here: d a
    multiple of 256, f at most 65536 and the layout below 2^31 words. The same test as
    the handler's."""
    return _union.dx_supported(m, d, f, max_entries, gated)


def stationary_dx_supported(m: int, d: int, f: int, max_entries: int, gated: bool) -> bool:
    """Whether dx can run with the weights stationary (``train_backward(dx_stationary=True)``):
    a walk over Wact^T's f rows and, gated, a second over Wu^T's; f at most 14,524; d a
    multiple of the 16 (8 where f > 7,264) columns a CTA holds; the workspace (the walk's
    layout; gated, a second layout and the first walk's f32 sums ``[m, d]``) within the
    partials ``[d / 64, max_entries]`` f32, which holds ``2 m d`` words at the default 128
    entries a token (d=2048). The same test as the handler's."""
    return _stat.walk_supported(m, d, f, max_entries, 2 if gated else 1)


def train_backward(
    x, dy, w_gate, w_up, w_down, res: Residuals, l1_grad, *, tile: int, workspace: bool = False, mma: bool = False,
    dx_mma: bool = False, dx_union: bool = False, dh_union: bool = False, dx_stationary: bool = False,
):
    """One ``jax_twell_train_bwd[_gated]`` call: ``(dx, dw_gate, dw_up, dw_down)``.
    ``mma``: the dh step on tensor cores (as in :func:`train_forward`). ``dx_mma``: dx on
    tensor cores too, its coefficients rounded to x's dtype as XLA's dense backward rounds
    them (ffi/notes/training_kernels.md); False, dx on CUDA cores from the f32
    coefficients (the bit-exact model's dx). ``dx_union``: dx as a dense tensor-core
    product over each 64-token block's union of active neurons (ffi/twell_union.cuh; the
    same rounded coefficients, another summation order), where
    :func:`union_dx_supported` allows; elsewhere as ``dx_mma`` says. ``dh_union``: dh as
    the union up product of dy and Wd's rows (every entry with g != 0; dh's f32 sum in
    another order than the per-entry step's), where :func:`union_up_supported` allows;
    elsewhere the per-entry step (as ``mma`` says). ``dx_stationary`` (where
    :func:`stationary_dx_supported` allows; taking precedence over ``dx_union``): dx by the
    walk of the inference down step with the weights stationary in shared memory
    (ffi/twell_stationary.cuh): each CTA holds 16 (or 8) columns of Wact^T, staged from the
    weight in its own ``[d, f]`` layout (no transposed copies), and walks every token's
    words; gated, a second walk holds Wu^T's and adds the first walk's f32 sums once at the
    end; the same rounded coefficients (f32 sums in the order
    jax_twell/ops/stationary_emulation.py models: :func:`~jax_twell.ops.stationary_emulation.dx`).

    ``l1_grad``: ``[]`` f32, the cotangent of the L1 term divided by M. w_gate None: the
    non-gated FFN (dw_gate None). ``workspace=True`` (tests) returns the raw results
    ``(dx, dw_down, dw_act_t[, dw_up_t], partial, coef)`` instead (the union layout's
    workspace left out).
    """
    m, d = x.shape
    f = w_down.shape[0]
    e = res.entries.shape[0]
    gated = w_gate is not None
    grad_t = jax.ShapeDtypeStruct((f, d), x.dtype)
    outs = [jax.ShapeDtypeStruct(x.shape, x.dtype), grad_t, grad_t] + ([grad_t] if gated else [])
    dx_stationary = bool(dx_stationary) and stationary_dx_supported(m, d, f, e, gated)
    # The weights as the dx step reads them: the walk stages its table from them as they
    # are ([d, f]); the other dx steps read rows of their transposes.
    as_read = (lambda w: w) if dx_stationary else (lambda w: w.T)
    w_act_op = as_read(w_gate if gated else w_up)
    w_up_op = as_read(w_up) if gated else None
    dx_union = bool(dx_union) and not dx_stationary and union_dx_supported(m, d, f, e, gated)
    dh_union = bool(dh_union) and union_up_supported(m, d, f, e)
    outs += [
        jax.ShapeDtypeStruct((d // _blocked.UP_COLS, e), jnp.float32),
        jax.ShapeDtypeStruct((3 if gated else 2, e), jnp.float32),
        # the weight gradients' lists, and dx's union layout (free once dx is done)
        jax.ShapeDtypeStruct((max(grad_workspace_ints(m, f, tile, e),
                                  union_workspace_ints(m, e, gated) if dx_union else 0),), jnp.int32),
    ]
    l1 = jnp.reshape(l1_grad, (1,)).astype(jnp.float32)
    tile_attr = np.int32(tile)
    # bit 0: dh step on tensor cores, bit 1: dx too, bit 2: dx, bit 3: dh as union products,
    # bit 4: dx with the weights stationary
    mma_attr = np.int32(int(bool(mma)) | int(bool(dx_mma)) << 1 | int(dx_union) << 2 | int(dh_union) << 3
                        | int(dx_stationary) << 4)
    if gated:
        # the forward down walk's token order where it kept one (dx's walk then skips its
        # S1-S4), else one word the handler ignores
        order = res.stat_order if res.stat_order is not None else jnp.zeros((1,), jnp.int32)
        call = kernel_call("jax_twell_train_bwd_gated", outs, vmap_method="sequential")
        out = call(x, dy, w_act_op, w_up_op, w_down, res.seg_start, res.tok_off, res.entries, res.up, res.col_off,
                   res.by_col, l1, order, tile=tile_attr, mma=mma_attr)
        if workspace:
            return out[:-1]
        dx, dw_down, dw_gate_t, dw_up_t = out[:4]
        return dx, dw_gate_t.T, dw_up_t.T, dw_down
    call = kernel_call("jax_twell_train_bwd", outs, vmap_method="sequential")
    out = call(x, dy, w_act_op, w_down, res.seg_start, res.tok_off, res.entries, res.col_off, res.by_col, l1,
               tile=tile_attr, mma=mma_attr)
    if workspace:
        return out[:-1]
    dx, dw_down, dw_up_t = out[:3]
    return dx, None, dw_up_t.T, dw_down


# The three device steps, module attributes so the CPU tests can stand the NumPy model in
# for the kernels (tests/test_train_emulation.py) and exercise everything around them.
_pack = cuda.pack_twell
_forward_call = train_forward
_backward_call = train_backward


def h_l1(h_source: jax.Array, total: jax.Array, dtype, m: int) -> jax.Array:
    """``sum |h| / M`` over the first ``total`` words (h in the high half) of ``h_source``."""
    h = jax.lax.bitcast_convert_type((h_source >> 16).astype(jnp.uint16), dtype).astype(jnp.float32)
    valid = jnp.arange(h_source.shape[0]) < total
    return jnp.where(valid, jnp.abs(h), 0.0).sum() / max(m, 1)


def fired_from_columns(col_off: jax.Array, f: int) -> jax.Array:
    """``[f]`` bool: neurons with an entry (g != 0) in any block."""
    nonempty = (jnp.diff(col_off, axis=-1) > 0).any(axis=0)  # [n_tiles, tile]
    return nonempty.reshape(-1)[:f]


@dataclasses.dataclass(frozen=True)
class _Config:
    width: int
    backup_capacity: int | None
    max_entries: int
    rule: TrainCrossover
    mma: bool = False
    dx_mma: bool = False
    dx_union: bool = False
    down_union: bool = False
    up_union: bool = False
    dh_union: bool = False
    down_stationary: bool = False
    dx_stationary: bool = False


def _mesh_axes(*arrays) -> frozenset:
    """Manual mesh axes over which any of ``arrays`` varies (empty outside shard_map)."""
    axes = frozenset()
    for a in arrays:
        if a is not None:
            axes |= reference._varying_axes(a)
    return axes


def _as_varying(tree, axes: frozenset):
    """``tree`` typed as varying over ``axes`` (under shard_map). Custom-call results need
    not carry the varying axes of their operands, and both lax.cond branches must agree;
    per-shard weight gradients must be typed varying to be summed over the token shards."""

    def one(a):
        missing = tuple(sorted(axes - reference._varying_axes(a)))
        return jax.lax.pcast(a, missing, to="varying") if missing else a

    return jax.tree.map(one, tree)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _train_ffn(x, w_gate, w_up, w_down, cfg):
    out, _ = _train_fwd(x, w_gate, w_up, w_down, cfg)
    return out


def _train_fwd(x, w_gate, w_up, w_down, cfg: _Config):
    m, d = x.shape
    gated = w_gate is not None
    w_act = w_gate if gated else w_up
    f = w_act.shape[1]
    # Decided for the kernels (margin inf: only the entry budget is checked per call): the
    # fused gate kernel packs in the matmul's epilogue and g is never written; the dense
    # branch, then taken only past the budget, recomputes it.
    fused = cfg.rule.margin == float("inf") and cuda.fused_gate_preferred(m, d, f, TILE, CAPACITY, x.dtype)
    g = None if fused else relu_matmul(x, w_act)
    act = cuda.gate_pack(x, w_act, tile=TILE, capacity=CAPACITY) if fused else _pack(g, tile=TILE, capacity=CAPACITY)
    counts = act.counts.sum(axis=-1, dtype=jnp.int32)
    fits = cuda.blocked_needed_entries(act) <= cfg.max_entries
    use = fits & cfg.rule.use_sparse(
        act.counts.sum(dtype=jnp.int32), act.overflowed.sum(dtype=jnp.int32), m, d, f, x.dtype.itemsize
    )
    if cfg.backup_capacity is not None:
        use = use & ((counts > cfg.width).sum(dtype=jnp.int32) <= cfg.backup_capacity)

    axes = _mesh_axes(x, w_gate, w_up, w_down)

    def sparse(_):
        y, res, h_source = _forward_call(
            x, act, w_act, w_up if gated else None, w_down, max_entries=cfg.max_entries, mma=cfg.mma,
            down_union=cfg.down_union, up_union=cfg.up_union, down_stationary=cfg.down_stationary,
        )
        l1 = h_l1(h_source, res.seg_start[-1], x.dtype, m)
        return _as_varying((y, l1, fired_from_columns(res.col_off, f), res), axes)

    def dense(_):
        gate = relu_matmul(x, w_act) if g is None else g
        h = gate * jnp.matmul(x, w_up) if gated else gate
        y = jnp.matmul(h, w_down)
        l1 = jnp.abs(h.astype(jnp.float32)).sum() / max(m, 1)
        shapes = residual_shapes(m, act.n_tiles, TILE, cfg.max_entries, gated,
                                 forward_down_stationary(m, d, f, cfg.max_entries, gated, cfg.down_stationary))
        res = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # not read by the dense backward
        return _as_varying((y, l1, (gate != 0).any(axis=0), res), axes)

    y, l1, fired, res = jax.lax.cond(use, sparse, dense, None)
    return (y, l1, counts, fired), (x, w_gate, w_up, w_down, use, res)


def _train_bwd(cfg: _Config, saved, cotangents):
    x, w_gate, w_up, w_down, use, res = saved
    dy, dl1, _, _ = cotangents
    m = max(x.shape[0], 1)
    l1_grad = dl1.astype(jnp.float32) / m

    axes = _mesh_axes(x, w_gate, w_up, w_down, dy)

    def sparse(_):
        grads = _backward_call(
            x, dy.astype(x.dtype), w_gate, w_up, w_down, res, l1_grad, tile=TILE, mma=cfg.mma, dx_mma=cfg.dx_mma,
            dx_union=cfg.dx_union, dh_union=cfg.dh_union, dx_stationary=cfg.dx_stationary,
        )
        grads = _as_varying(grads, axes)
        return tuple(reference._sum_over_shards(g, p) for g, p in zip(grads, (x, w_gate, w_up, w_down)))

    def dense(_):
        # Nothing M x f was kept: the dense backward recomputes g and u (2 matmuls).
        def loss_terms(x, w_gate, w_up, w_down):
            y, l1, _, _ = xla.ffn_with_aux(x, w_gate, w_up, w_down)
            return y, l1

        _, vjp = jax.vjp(loss_terms, x, w_gate, w_up, w_down)
        return vjp((dy, dl1.astype(jnp.float32)))

    return jax.lax.cond(use, sparse, dense, None)


_train_ffn.defvjp(_train_fwd, _train_bwd)


def ffn_with_aux(
    x, w_gate, w_up, w_down, *, width: int, backup_capacity: int | None = None,
    crossover: TrainCrossover | None = None, mma: bool = True, active_fraction: float | None = None,
    dx_mma: bool | None = None, dx_union: bool | None = None, down_union: bool | None = None,
    up_union: bool | None = None, dh_union: bool | None = None, union_fraction: float | None = None,
    down_stationary: bool | None = None, dx_stationary: bool | None = None,
):
    """Training FFN through the CUDA kernels. x: ``[M, d]``.

    Returns ``(y [M, d], l1 [], counts [M] int32, fired [f] bool)`` like
    :func:`jax_twell.ops.reference.ffn_with_aux`, differentiable (custom_vjp) with the
    gradients of the dense formula. Per call, on the device, the sparse kernels run where
    the entries fit ``max_entries_for(M, f, width)`` and ``crossover`` (default
    :func:`crossover_for` this shape: :func:`train_crossover`, priced for the steps that
    run) predicts them faster, and (if ``backup_capacity`` is given) at
    most ``backup_capacity`` rows exceed ``width`` active neurons; otherwise the call is
    dense (exact; its backward recomputes g and u). f32 inputs and M below the rule's
    ``min_tokens`` run :func:`jax_twell.ops.xla.ffn_with_aux` (pure XLA autodiff).
    ``mma`` (default True) runs the up, down and dh steps on tensor cores (version 4 of the
    blocked steps; ffi/notes/training_kernels.md); False, the CUDA-core steps (the
    bit-exact model).
    ``dx_mma`` (default: as ``mma``) runs the backward's dx on tensor cores as well
    (:func:`train_backward`; 4.09 ms against 4.47 ms with dx on CUDA cores at 0.5%).
    ``dx_union`` (default: :data:`DX_UNION_DEFAULT`, with ``dx_mma``) runs dx as a dense
    product over each 64-token block's union of active neurons where
    :func:`union_dx_supported` allows (ffi/notes/training_kernels.md). ``down_union``
    (default: :data:`DOWN_UNION_DEFAULT`, on, with ``mma``) does the same for the forward's down step
    and ``up_union`` (default: :data:`UP_UNION_DEFAULT`, with ``mma``) for its up step
    (:func:`train_forward`); ``dh_union`` (default: :data:`DH_UNION_DEFAULT`, with ``mma``)
    for the backward's dh step (:func:`train_backward`). ``down_stationary`` (gated, with
    ``mma``; default: :data:`DOWN_STATIONARY_DEFAULT` where
    :meth:`jax_twell.ops.cuda.DenseCrossover.down_stationary` prices it below the union
    product at ``active_fraction``) runs the forward's down step with the weight stationary
    in shared memory instead (:func:`train_forward`); ``dx_stationary`` (with ``dx_mma``;
    default: :data:`DX_STATIONARY_DEFAULT` where the same price says so) runs the backward's
    dx by that walk over Wact^T and Wu^T (:func:`train_backward`).

    ``active_fraction`` (a Python float, e.g. the layer's fraction measured over recent
    steps): the choice is made at trace time instead (:meth:`TrainCrossover.prefers_sparse`
    for this call's M): where dense is predicted faster the call is pure XLA autodiff (the
    dense formula's cost, nothing added); else the kernels, dense only where the entries do
    not fit (exactness). The per-call device decision costs the dense side ~15% (its
    residuals share the sparse side's static shapes, so its backward recomputes g and u);
    a per-layer trace-time choice does not. Each distinct decision is a distinct trace:
    change it when a layer's density crosses, not every step. ``union_fraction`` (with
    ``active_fraction``; a Python float): the layer's measured mean union of active
    neurons over 64-token blocks, as a fraction of f (``jax_twell.ops.cuda.block_union_fraction``
    of its gate activations), which the union products' cost follows; without it the
    rule assumes the uniform pattern's, the largest at that density.
    """
    m, d = x.shape
    f = w_up.shape[1]
    gated = w_gate is not None
    check_supported(d, x.dtype)
    if union_fraction is not None:
        if active_fraction is None:
            raise ValueError("union_fraction is a trace-time measurement: pass it with active_fraction")
        if not 0.0 <= union_fraction <= 1.0:
            raise ValueError(f"union_fraction must be in [0, 1], got {union_fraction}")
    if m == 0 or jnp.dtype(x.dtype) == jnp.float32:
        return xla.ffn_with_aux(x, w_gate, w_up, w_down)
    dx_mma = bool(mma if dx_mma is None else dx_mma)
    max_entries = max_entries_for(m, f, width)
    down_stationary, dx_stationary, walks = _walk_steps(
        m, d, f, x.dtype.itemsize, gated, max_entries, down_stationary, dx_stationary, mma, dx_mma, active_fraction)
    rule = crossover_for(m, d, f, x.dtype.itemsize, gated=gated, walks=walks) if crossover is None else crossover
    if not rule.sparse_can_win(m, d, f, x.dtype.itemsize):
        return xla.ffn_with_aux(x, w_gate, w_up, w_down)
    if active_fraction is not None:
        if not rule.prefers_sparse(m, d, f, x.dtype.itemsize, active_fraction, union_fraction):
            return xla.ffn_with_aux(x, w_gate, w_up, w_down)
        rule = dataclasses.replace(rule, margin=float("inf"))  # decided: only the entry budget is checked per call
    dx_union = dx_mma and bool(DX_UNION_DEFAULT if dx_union is None else dx_union)
    down_union = bool(mma) and bool(DOWN_UNION_DEFAULT if down_union is None else down_union)
    up_union = bool(mma) and bool(UP_UNION_DEFAULT if up_union is None else up_union)
    dh_union = bool(mma) and bool(DH_UNION_DEFAULT if dh_union is None else dh_union)
    cfg = _Config(width, backup_capacity, max_entries, rule, bool(mma), dx_mma, dx_union, down_union,
                  up_union, dh_union, down_stationary, dx_stationary)
    return _train_ffn(x, w_gate, w_up, w_down, cfg)
