"""CUDA implementations: thin ``jax.ffi.ffi_call`` wrappers over the registered handlers.

Each wrapper builds the call for operands already validated by the public API; the
handlers re-check shapes and fail with an InvalidArgument naming the constraint.
Attributes are numpy scalars of the declared type (a Python float would arrive as F64).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_twell._kernels import kernel_call
from jax_twell.formats import TwELL, relu_matmul
from jax_twell.ops import blocked_emulation as _blocked
from jax_twell.ops import stationary_emulation as _stat
from jax_twell.ops import union_emulation as _union
from jax_twell.ops import xla
from jax_twell.ops.common import RuleSlot

__all__ = [
    "pack_twell",
    "gate_twell",
    "gate_pack",
    "fused_gate_supported",
    "fused_gate_preferred",
    "fused_gate_variant",
    "twell_ffn",
    "union_up_supported",
    "union_down_supported",
    "stationary_down_supported",
    "sparse_ffn",
    "DenseCrossover",
    "supports",
    "check_supported",
    "dense_crossover",
    "set_dense_crossover",
    "KERNELS",
    "STATIONARY_DOWN",
    "blocked_supported",
    "check_blocked_supported",
    "blocked_max_entries",
    "blocked_needed_entries",
    "gate_counts",
    "sampled_gate_counts",
    "sampled_block_union",
    "decode_ffn",
    "decode_ffn_gate",
    "decode_ffn_rows",
    "decode_rows_supported",
    "decode_supported",
    "decode_gate_supported",
    "DECODE_TILE",
]

KERNELS = ("row", "blocked", "blocked_mma", "blocked_union")

# "blocked_union" runs its down step with the weight stationary in shared memory
# (``blocked_ffn(down_stationary=True)``) where :func:`stationary_down_supported` says the
# shape takes it. Read when a call is traced: set it False before tracing to run the union
# down product instead (the benchmarks' A/B does).
STATIONARY_DOWN = True


def pack_twell(a: jax.Array, *, tile: int, capacity: int) -> TwELL:
    """TwELL packing of ``a [..., f]`` by the ``jax_twell_pack`` kernel (see formats.TwELL)."""
    f = a.shape[-1]
    n_tiles = -(-f // tile)
    lead = a.shape[:-1]
    out_types = (
        jax.ShapeDtypeStruct((*lead, n_tiles, capacity), a.dtype),
        jax.ShapeDtypeStruct((*lead, n_tiles, capacity), jnp.int16),
        jax.ShapeDtypeStruct((*lead, n_tiles), jnp.int32),
    )
    # The handler flattens leading dimensions, so a vmapped call is one launch.
    call = kernel_call("jax_twell_pack", out_types, vmap_method="broadcast_all")
    values, cols, counts = call(a, tile=np.int32(tile), capacity=np.int32(capacity))
    return TwELL(values, cols, counts, f=f, tile=tile)


# ---------------------------------------------------------------------------------------
# Fused up + down projection on a TwELL gate (ffi/twell_ffn.cu), and the dense crossover.


_MAX_D_BYTES = 16384  # the kernel's register tiling: 8 warps x 4 chunks x 32 lanes x 16 bytes


def supports(d: int, dtype) -> bool:
    """True when the fused kernel takes model width ``d`` in ``dtype`` (see :func:`check_supported`)."""
    try:
        check_supported(d, dtype)
    except ValueError:
        return False
    return True


def check_supported(d: int, dtype) -> None:
    """Raises ValueError naming the constraint when the fused kernel can't take ``d``.

    Rows are read 16 bytes at a time, so d must be a multiple of 8 (bf16/f16) or 4 (f32),
    and at most 8192 (bf16/f16) or 4096 (f32).
    """
    itemsize = jnp.dtype(dtype).itemsize
    vec = 16 // itemsize
    if d % vec or d * itemsize > _MAX_D_BYTES:
        raise ValueError(
            f"the fused TwELL FFN kernel needs d a multiple of {vec} and at most "
            f"{_MAX_D_BYTES // itemsize} for {jnp.dtype(dtype).name}, got d={d}; use implementation='xla'"
        )


def _twell_ffn_call(x, act: TwELL, w_act, w_up, w_down, w_up_t=None):
    check_supported(x.shape[-1], x.dtype)
    out_type = jax.ShapeDtypeStruct(x.shape, x.dtype)
    # Weights are shared by every row, so a vmapped call runs once per batch element.
    if w_up is None:
        call = kernel_call("jax_twell_ffn", out_type, vmap_method="sequential")
        return call(x, act.values, act.cols, act.counts, w_act, w_down, tile=np.int32(act.tile))
    if w_up_t is None:
        w_up_t = w_up.T
    call = kernel_call("jax_twell_ffn_gated", out_type, vmap_method="sequential")
    return call(x, act.values, act.cols, act.counts, w_act, w_up, w_up_t, w_down, tile=np.int32(act.tile))


def twell_ffn(x, act: TwELL, w_act, w_up, w_down, *, w_up_t=None, kernel: str = "row", max_entries: int | None = None):
    """FFN output from a packed activation by the fused ``jax_twell_ffn`` kernels.

    ``kernel``: "row" (one CTA per token row, ffi/twell_ffn.cu), "blocked" (token blocks
    of 1024 sharing each weight slab, ffi/twell_ffn_blocked.cu; see :func:`blocked_ffn`,
    whose fallbacks apply: f32 and calls needing more than ``max_entries`` entries run
    the row kernel), "blocked_mma" (the same with the up and down steps on tensor cores;
    measured no faster, ffi/notes/twell_ffn_blocked.md) or "blocked_union" (as
    "blocked_mma", with the up and down steps dense products over each 64-token block's
    union of active neurons where the shape allows, ffi/twell_union.cuh; the down step with
    the weight stationary in shared memory instead where :func:`stationary_down_supported`,
    :data:`STATIONARY_DOWN` and the rule's :meth:`DenseCrossover.down_stationary`,
    ffi/twell_stationary.cuh).

    Gated (``w_up`` given): ``y = (act * (x @ w_up)) @ w_down``; non-gated: ``y = act @ w_down``.
    Overflowed tiles are recomputed exactly inside the kernel from ``(x, w_act[, w_up])``.

    Args:
      x: ``[..., M, d]`` bf16 (fast path), f16 or f32; d a multiple of 16 bytes' worth of
        elements and at most 8192 (bf16/f16) or 4096 (f32).
      act: TwELL of ``relu(x @ w_act)``.  w_act, w_up: ``[d, f]``.  w_down: ``[f, d]``.
      w_up_t: optional ``[f, d]`` copy of ``w_up.T``, the layout the kernel reads (rows of
        Wu^T are contiguous). Omitted, it is transposed here (one pass over w_up per call,
        about 12 us at d=2048, f=5632; XLA hoists it out of loops where w_up is invariant).
    Returns:
      y: ``[..., M, d]`` dtype of x.
    """
    _check_kernel(kernel)
    if kernel != "row":
        return blocked_ffn(
            x, act, w_act, w_up, w_down, w_up_t=w_up_t, max_entries=max_entries, mma=kernel != "blocked",
            down_union=kernel == "blocked_union", up_union=kernel == "blocked_union",
            down_stationary=kernel == "blocked_union" and _crossover.get().down_stationary(
                int(np.prod(x.shape[:-1])), x.shape[-1], act.f, x.dtype.itemsize, None, w_up_t is not None),
        )
    return _twell_ffn_call(x, act, w_act, w_up, w_down, w_up_t)


# ---------------------------------------------------------------------------------------
# Token-blocked fused up + down (ffi/twell_ffn_blocked.cu; algorithm and layout modelled in
# jax_twell/ops/blocked_emulation.py).

BLOCKED_MIN_TOKENS = 256  # below, the row kernel reads fewer weight bytes (see DenseCrossover)


def _check_kernel(kernel: str, allow_auto: bool = False) -> None:
    allowed = KERNELS + (("auto",) if allow_auto else ())
    if kernel not in allowed:
        raise ValueError(f"kernel must be one of {allowed}, got {kernel!r}")


def blocked_supported(d: int, tile: int) -> bool:
    """Whether the blocked kernel takes this shape (:func:`check_blocked_supported`)."""
    return d % _blocked.UP_COLS == 0 and d <= 16384 and tile <= _blocked.MAX_TILE


def check_blocked_supported(d: int, tile: int) -> None:
    """Raises ValueError naming the constraint when the blocked kernel can't take the shape.

    d must be a multiple of 64 (the up step's column ranges) and at most 16384; the TwELL
    tile at most 256 (a tile's weight slab is staged in shared memory).
    """
    if d % _blocked.UP_COLS or d > 16384:
        raise ValueError(
            f"the blocked TwELL FFN kernel needs d a multiple of {_blocked.UP_COLS} and at most 16384, got d={d}; "
            "use kernel='row'"
        )
    if tile > _blocked.MAX_TILE:
        raise ValueError(f"the blocked TwELL FFN kernel needs tile <= {_blocked.MAX_TILE}, got {tile}; use kernel='row'")


def blocked_max_entries(m: int, f: int, tile: int, capacity: int) -> int:
    """Static entry budget of the blocked kernel's workspace for ``m`` tokens.

    An entry is one active (token, neuron) pair, or one column of an overflowed tile.
    Budget: ``m * min(f // 32, n_tiles * capacity)`` (3.1% of f per token on average,
    never more than the TwELL's slots), at least one tile width. Workspace bytes:
    ``4 * entries * (1 + d / 64)`` gated (entries + partial up sums), ``4 * entries``
    non-gated; at M=16384, d=2048, f=5632: 2.9M entries, 380 MB. Calls that need more
    (denser than the budget, or many overflowed tiles, each taking its full width) run
    the row kernel (exact; dense is faster there anyway).
    """
    n_tiles = -(-f // tile)
    return max(tile, m * min(f // 32, n_tiles * capacity))


def blocked_needed_entries(act: TwELL) -> jax.Array:
    """``[]`` int32: entries the blocked kernel needs for ``act`` (stored entries, plus the
    full width of every overflowed tile, recomputed from the weights)."""
    return jnp.where(act.overflowed, _tile_widths(act.f, act.tile), act.counts).sum(dtype=jnp.int32)


def _tile_widths(f: int, tile: int) -> jax.Array:
    """``[n_tiles]`` int32: columns of each tile (the last one may be narrower)."""
    n_tiles = -(-f // tile)
    return jnp.minimum(tile, f - tile * jnp.arange(n_tiles, dtype=jnp.int32))


def union_up_supported(m: int, d: int, f: int, max_entries: int) -> bool:
    """Whether the blocked kernel can run its up step as a union product
    (``blocked_ffn(up_union=True)``, ``kernel="blocked_union"``) for ``m`` tokens and a
    workspace of ``max_entries``: f at most 65536 and the layout (~4 words per entry) within
    the partials after u's row, so d at least 320. Elsewhere the per-entry step runs."""
    return _union.up_supported(m, d, f, max_entries)


def union_down_supported(m: int, d: int, f: int, max_entries: int) -> bool:
    """Whether the blocked kernel can run its down step as a union product
    (``blocked_ffn(down_union=True)``): d a multiple of 256, f at most 65536 and the layout
    (~2 words per entry) within the partials workspace. Elsewhere the per-entry step runs."""
    return _union.down_supported(m, d, f, max_entries)


def stationary_down_supported(m: int, d: int, f: int, max_entries: int) -> bool:
    """Whether the blocked kernel can run its down step with the weight stationary in shared
    memory (``blocked_ffn(down_stationary=True)``; ffi/twell_stationary.cuh): gated, f at most
    14,524 (16 columns of Wd a CTA, ``f x 32`` bytes of its shared memory, up to f = 7,264; 8
    columns, ``f x 16`` bytes, above), d a multiple of those columns, and the walk's workspace
    within the partials. Elsewhere the union product (or the per-entry step) runs."""
    return _stat.supported(m, d, f, max_entries)


def _union_runs(gated: bool, m: int, d: int, f: int, tile: int, capacity: int) -> bool:
    """Whether "blocked_union" runs both of its union steps for this call at the default
    entry budget (gated, d a multiple of 256, the layouts within the workspace)."""
    if not gated or m < BLOCKED_MIN_TOKENS:
        return False
    e = blocked_max_entries(m, f, tile, capacity)
    return union_up_supported(m, d, f, e) and union_down_supported(m, d, f, e)


def _blocked_call(x, act: TwELL, w_act, w_up, w_down, w_up_t, max_entries: int, mma: bool = False,
                  down_union: bool = False, up_union: bool = False, fallback: bool = False,
                  down_stationary: bool = False):
    """The blocked handler: ``(y, seg_start, tok_off, entries[, partial])``. ``fallback``:
    where the call's entries overflow ``max_entries`` (read on the device), the handler's
    last launch, the row kernel, writes y exactly; without it y is NaN there."""
    m, d = int(np.prod(x.shape[:-1])), x.shape[-1]
    down_union = down_union and w_up is not None and _union.down_supported(m, d, act.f, max_entries)
    up_union = up_union and w_up is not None and _union.up_supported(m, d, act.f, max_entries)
    down_stationary = down_stationary and w_up is not None and _stat.supported(m, d, act.f, max_entries)
    down_union = down_union and not down_stationary
    # the handler's bits: 0 tensor cores, 2 down and 3 up as union products, 4 down stationary
    mma = int(bool(mma)) | int(down_union) << 2 | int(up_union) << 3 | int(down_stationary) << 4
    n_blocks = -(-m // _blocked.BLOCK_TOKENS)
    workspace = [
        jax.ShapeDtypeStruct((n_blocks * act.n_tiles + 1,), jnp.int32),
        jax.ShapeDtypeStruct((n_blocks, act.n_tiles, _blocked.BLOCK_TOKENS + 1), jnp.int32),
        jax.ShapeDtypeStruct((max_entries,), jnp.uint32),
    ]
    y_type = jax.ShapeDtypeStruct(x.shape, x.dtype)
    attrs = dict(tile=np.int32(act.tile), mma=np.int32(mma), fallback=np.int32(bool(fallback)))
    if w_up is None:
        call = kernel_call("jax_twell_ffn_blocked", (y_type, *workspace), vmap_method="sequential")
        return call(x, act.values, act.cols, act.counts, w_act, w_down, **attrs)
    workspace.append(jax.ShapeDtypeStruct((d // _blocked.UP_COLS, max_entries), jnp.float32))
    if w_up_t is None:
        w_up_t = w_up.T
    call = kernel_call("jax_twell_ffn_blocked_gated", (y_type, *workspace), vmap_method="sequential")
    return call(x, act.values, act.cols, act.counts, w_act, w_up, w_up_t, w_down, **attrs)


def blocked_ffn(
    x, act: TwELL, w_act, w_up, w_down, *, w_up_t=None, max_entries: int | None = None, workspace: bool = False,
    mma: bool = False, down_union: bool = False, up_union: bool = False, down_stationary: bool = False,
):
    """Fused up + down over token blocks (``jax_twell_ffn_blocked[_gated]``).

    Same math and arguments as :func:`twell_ffn`. Per block of 1024 tokens each weight slab
    is read once, so weight traffic is ``ceil(M/1024) * (|Wu| + |Wd|)`` instead of
    ``nnz * 2 * d * itemsize``. Overflowed tiles are recomputed exactly from the weights.

    Constraints: bf16 or f16 (f32 runs the row kernel); d a multiple of 64 and at most
    16384, tile at most 256 (ValueError otherwise, see :func:`check_blocked_supported`).
    ``max_entries`` (default :func:`blocked_max_entries`) sizes the workspace; a call that
    needs more entries runs the row kernel instead, exact: the handler launches it last, and
    it reads the needed entries on the device and exits at once where they fit (no
    ``lax.cond`` in the op, and under vmap no select running both kernels).
    ``workspace=True`` (tests) returns ``(y, seg_start, tok_off, entries[, partial])``
    from the blocked kernel alone, without the fallback (y is NaN where the entries
    overflow). ``mma=True`` runs the up and down steps on tensor cores
    (``kernel="blocked_mma"``; sums equal to f32 rounding, not bitwise, see
    ffi/notes/twell_ffn_blocked.md). ``down_union=True`` (gated, d a
    multiple of 256 and the layout within the partials workspace; elsewhere ignored) runs
    the down step as a dense product over each 64-token block's union of active neurons
    (``kernel="blocked_union"``; the same h, f32 sums in another order). ``up_union=True``
    (gated, the layout within the partials workspace, ~4 words per entry after u's: d at
    least 320; elsewhere ignored)
    runs the up step likewise: u = x . Wu^T[j] for every entry from a dense product of the
    block's x with the union's rows of Wu^T (f32 sums over d in another order, so h may
    differ from the per-entry step's by its last bit). ``down_stationary=True`` (gated,
    where :func:`stationary_down_supported`; elsewhere ignored, and taking precedence over
    ``down_union``) runs the down step with 16 columns of Wd held in each CTA's shared memory
    while it walks every token's h entries (ffi/twell_stationary.cuh; y in the order
    jax_twell/ops/stationary_emulation.py models).
    """
    if jnp.dtype(x.dtype) == jnp.float32:
        if workspace:
            raise ValueError("the blocked kernel takes bf16 or f16; f32 runs the row kernel")
        return _twell_ffn_call(x, act, w_act, w_up, w_down, w_up_t)
    check_blocked_supported(x.shape[-1], act.tile)
    check_supported(x.shape[-1], x.dtype)
    m = int(np.prod(x.shape[:-1]))
    if max_entries is None:
        max_entries = blocked_max_entries(m, act.f, act.tile, act.capacity)
    args = (x, act, w_act, w_up, w_down, w_up_t, max_entries, mma, down_union, up_union)
    if workspace:
        return _blocked_call(*args, down_stationary=down_stationary)
    if m == 0:
        return jnp.zeros(x.shape, x.dtype)
    return _blocked_call(*args, fallback=True, down_stationary=down_stationary)[0]


@dataclasses.dataclass(frozen=True)
class DenseCrossover:
    """When the sparse FFN runs the fused TwELL kernel, and when dense math through XLA.

    Both paths share the gate matmul; a reduction over a sample of its rows estimates the
    number of active (token, neuron) pairs ``nnz`` (:func:`sampled_gate_counts`; only the
    sparse branches pack). The rule compares what comes after, in seconds:

    - sparse: ``nnz * 2 * d * itemsize / pair_bandwidth`` (the kernel reads one row of
      Wu^T and one of Wd per pair, mostly from L2; the rate scaled by ``M /
      row_full_tokens`` below that many tokens) + ``overflow_penalty`` per overflowed
      tile + ``2 * d * f * itemsize / transpose_bandwidth`` when the up weight is
      transposed in the call + ``fixed_overhead``;
    - dense up + down: ``max(4 * M * d * f / matmul_rate, 2 * d * f * itemsize / hbm_bandwidth)``;
    - the blocked kernels: :meth:`blocked_cost` and :meth:`union_cost`.

    The kernel runs where the sparse estimate is below ``margin`` times the dense one.
    Where even ``nnz = 0`` can't win (decode-sized M) the choice is made at trace time
    (no device-side branch); otherwise on the device, per call, with ``lax.cond``.
    Constants fitted to H200 measurements of this kernel (ffi/notes/twell_ffn.md).
    Override with :func:`set_dense_crossover`: ``DenseCrossover(margin=inf)`` always runs
    sparse, ``margin=0`` always dense; or per call through :func:`sparse_ffn`.
    """

    pair_bandwidth: float = 3.3e12
    # ... at calls of at least this many tokens; below, the row kernel's grid is too small to
    # reach that rate and it is scaled by M / row_full_tokens. At (4096, 11008) with w_up_t
    # given, 0.25-0.5% active, the row kernel measured 0.65-0.92x of dense at M=128, 0.70-0.97x
    # at M=256 but 1.14x at M=384 and 1.07x at M=512; the unscaled rate had sent M=128-256
    # there to it (inference_row_small_m_ebac2a0.json, inference_layer_pret_check_ebac2a0.json).
    row_full_tokens: int = 512
    # Dense up + down at M=16384, d=2048, f=5632: 1.10 ms on the H200 (XLA, bf16 results).
    matmul_rate: float = 6.9e14
    hbm_bandwidth: float = 3.0e12
    transpose_bandwidth: float = 1.4e12
    overflow_penalty: float = 2.0e-6
    fixed_overhead: float = 1.0e-5
    # Sparse runs only where predicted at least 5% faster than dense. The margin was 0.9
    # while the per-call branch cost ~0.1 ms (a host round trip); on the device it costs
    # ~10 us. At 0.95 the three points that change sides measured 1.09x (M=16384, 0.5%
    # uniform), 1.01x ((2048, 8192), M=256, 0.25%) and 1.05x ((4096, 11008), M=4096,
    # 0.5%) under the layer rule (inference_configs_3ea68d3_margin095.json).
    margin: float = 0.95
    # Blocked kernel with its tensor-core steps (version 4.1): everything after the gate
    # matmul (pack, layout, the fused steps), fitted by least squares to the H200's
    # interleaved timings (ffi/notes/twell_ffn_blocked.md, inference_quick_b47940f.json):
    # ~1.34 ms at M=16384, d=2048, f=5632, 0.5% active, ~3.1 ms at 2% (~1.27 ns per pair),
    # (2048, 8192) and (4096, 11008) at 0.5% 1.81 and 4.31 ms, all within 5% of measured;
    # dense up + down takes 1.09, 1.47 and 3.82 ms there, so the rule now runs dense.
    blocked_weight_bandwidth: float = 1.68e12
    blocked_pair_rate: float = 3.22e12
    blocked_fixed_overhead: float = 3.2e-4
    # Blocked kernel with its up and down steps as union products ("blocked_union", gated,
    # where union_up_supported and union_down_supported hold): after the gate matmul, each
    # 64-token block reads its union's rows of Wu^T and Wd, 1 - (1 - p)^64 of f at a
    # fraction p of active pairs (uniform; heavy-tailed patterns have smaller unions, so
    # the estimate errs toward dense), plus a fixed part (pack, layouts, finish), plus the
    # up weight's transpose where the call is not given ``w_up_t``. Refit at 2b4db29
    # (benchmarks/fit_inference_rule.py) by relative least squares to the after-gate time
    # (the call less a third of the dense call) of 29 uniform points on the H200, each
    # with and without ``w_up_t``
    # (inference_union_sweep_2b4db29.json, inference_acceptance_b6d0b51.json,
    # inference_sample_rows_ab_c12fdb7.json): M=2,048-16,384 at 0.25-2% for d=2048,
    # f=5632, M=1,024-16,384 at 0.5% for (4096, 11008), M=16,384 for (2048, 8192). 56 of
    # the 58 within 7%, the worst 11% (M=8,192 at 0.25%, overpriced toward dense, far
    # from the crossover). The previous fit (5.22e12 B/s, 0.129 ms, no transpose term)
    # came from M >= 4,096 on older kernels and overpriced M=2,048-4,096 by 20-45%.
    # Crossovers now (without / with w_up_t): 0.89% / 0.91% at the headline shape
    # (M=16,384), 0.79% / 0.82% at M=8,192, 0.60% / 0.67% at M=4,096.
    union_row_bandwidth: float = 5.39e12
    union_fixed_overhead: float = 6.8e-5
    # The up weight's transpose in a call without ``w_up_t`` (a separate fit from
    # ``transpose_bandwidth``, which the row kernel's older fit keeps): 2 d f itemsize
    # bytes at this rate, ~15 us at d=2048, f=5632 and ~58 us at (4096, 11008).
    union_transpose_bandwidth: float = 3.1e12
    # Below this many tokens the union products are priced as never winning (a forced rule
    # still runs them): at M=256-512 the few 64-token blocks leave most of the GPU idle and
    # the fit above, made from M=1,024 on, underprices them by ~25%; forced, they measured
    # 0.56-1.01x there (inference_union_refit_check_01f4824.json).
    union_min_tokens: int = 1024
    # "blocked_union" with its down step on the weight stationary in shared memory
    # (:data:`STATIONARY_DOWN`, where :meth:`stationary_runs`): after the gate matmul, the
    # up product's union rows of Wu^T (half of :meth:`union_row_bytes`) at
    # ``stationary_up_bandwidth``, plus ``stationary_pair_seconds`` per active pair and wave
    # of ``stationary_sms`` CTAs (each CTA owns 16 output columns, 8 where f > 7,264, and
    # walks every pair: d / 16 or d / 8 CTAs, one a SM; ``stationary_pair_seconds_8`` for
    # the 8-column walk), plus ``stationary_token_seconds`` per token (the walk's layout,
    # Finish), a fixed part, and the up weight's transpose where the call is not given
    # ``w_up_t``. Fitted by relative least squares (benchmarks/fit_inference_rule.py) to the
    # after-gate time of 31 uniform rows on the H200, each with and without ``w_up_t``
    # (inference_stationary_sweep_fc4b868.json: M=2,048-16,384 at 0.25-1.5% for d=2048,
    # f=5632, M=16,384 at 0.5% and 1% for (1024, 2816); inference_stationary8_ab_c8wip.json:
    # (2048, 8192) at 0.5% and 1%, (4096, 11008) at M=4,096 and 16,384): 62 points, all
    # within 9.2%.
    stationary_up_bandwidth: float = 5.73e12
    stationary_pair_seconds: float = 3.05e-10
    stationary_pair_seconds_8: float = 2.53e-10  # ... a wave of 8-column CTAs (f > 7,264)
    stationary_token_seconds: float = 3.57e-9
    stationary_fixed_overhead: float = 9.10e-5
    stationary_transpose_bandwidth: float = 2.59e12
    stationary_sms: int = 132
    # Where both down steps take the shape, "blocked_union" runs the stationary one where
    # its price is below the union product's (:meth:`down_stationary`), at the layer's
    # active fraction when known, else at this one.
    stationary_reference_fraction: float = 0.005
    # The per-call choice counts the active pairs of about this many rows of g (whole
    # 64-row blocks, evenly spaced; all rows below 2x this many; the blocked_union estimate
    # of the union reads the same rows), and scales up: a full count reads all of g
    # (~0.1 ms at M=16384, f=5632), which a dense decision would pay for nothing. The
    # blocked kernel's handler still checks its exact entry budget after packing.
    count_sample_rows: int = 1024
    # ... or M / 8 rows where fewer (never fewer than ``count_sample_min_rows``): at M=2,048 a
    # 1,024-row sample was half of g, and its reductions (~17 us in the GPU trace,
    # timeline_auto_2048_c12fdb7.json) were most of what the per-call check cost there.
    count_sample_min_rows: int = 256

    def sample_rows(self, m: int) -> int:
        """Rows of g the per-call choice reads for ``m`` tokens: ``m // 8``, but at least
        ``count_sample_min_rows`` and never more than ``count_sample_rows``."""
        return min(self.count_sample_rows, max(self.count_sample_min_rows, m // 8))
    # Decode: calls of at most this many tokens run xla.gather_ffn (only the weights of
    # neurons active for some token are read) with room for ``decode_active_per_token``
    # of f per token. 0 = off: measured 0.3-0.7x of dense on the H200 (ffi/notes/decode.md).
    decode_gather_max_tokens: int = 0
    decode_active_per_token: float = 0.01
    # Decode kernel (ffi/twell_decode.cu): calls of at most this many tokens that the kernel
    # takes (:func:`decode_supported`) run the gate matmul then it, reading only the weight
    # rows of active neurons. 0 = off (the default: measured 1.4-1.5x at M=1 and 1.1-1.25x at M=64
    # at 0.5% active with w_up_t given, but below dense above ~2% active and without
    # w_up_t; ffi/notes/decode.md). ``decode_dense_above``: when set, a per-call device
    # check runs dense up + down instead where more than this fraction of (token, neuron)
    # pairs is active (a ``lax.cond``); None = no check (the kernel's cost grows with the
    # active pairs: see ffi/notes/decode.md for where it crosses dense).
    decode_kernel_max_tokens: int = 0
    decode_dense_above: float | None = None
    # The decode path's gate matmul on our tensor-core kernel (decode_ffn_gate: reads the
    # gate weight once, split-K, deterministic) where it takes the shape (f a multiple of
    # 8, d of 16); else XLA's. Measured 1-4 us faster than XLA's gate at M 1-64 on the H200
    # (ffi/notes/decode.md).
    decode_fused_gate: bool = True
    # ... for calls of at most this many tokens (at M=64 XLA's gate was faster: the kernel's
    # K-range partial sums, 11.5 MB at M=64, cost more than they save).
    decode_fused_gate_max_tokens: int = 32
    # Decode kernels chosen at trace time from a layer's known active fraction (the
    # ``active_fraction`` argument, e.g. measured by TransformerLM.calibrate_ffn): a call
    # of M tokens runs them, without any device check, where M is at most one of these
    # token counts and the fraction is below its bound (the first count >= M), and the up
    # weight is given as [f, d] (or the FFN is non-gated). Measured crossovers on the H200,
    # d=2048, f=5632 (decode_84e3a52.json): ~2.9% active at M=1, ~1.7% at M=16, ~0.9% at
    # M=64 for uniform rows; the bounds keep a margin. Heavy-tailed rows at M=64 lose at
    # 0.54% (0.83-0.88x, decode_quick_2e77b43.json, _fdfd87d.json) while uniform 0.5% gains
    # only 1.00-1.12x, so past 16 tokens the bound is 0.4%.
    decode_active_below: tuple[tuple[int, float], ...] = ((1, 0.025), (16, 0.015), (64, 0.004))
    # Where the decode kernels run (decided at trace time or forced) and the activation's
    # weight also comes stored by neuron (``w_act_t``), calls of at most this many tokens
    # run decode_ffn_rows instead. Measured on the H200 at d=2048, f=5632, interleaved with
    # the tile path: M=1 1.48-1.52x against 1.35-1.45x at 0.5% active, 1.45x against 1.12x
    # at 2%; M=4 1.00-1.10x against 1.34-1.36x (decode_quick_2e77b43.json, _248d2f6.json).
    decode_rows_max_tokens: int = 1

    def decode_wins(self, m: int, active_fraction: float) -> bool:
        """Static: True where the decode kernels beat dense for ``m`` tokens at this
        active fraction (:attr:`decode_active_below`)."""
        if not 0.0 <= active_fraction <= 1.0:
            raise ValueError(f"active_fraction must be in [0, 1], got {active_fraction}")
        if m <= 0 or self.margin <= 0:
            return False
        for tokens, bound in sorted(self.decode_active_below):
            if m <= tokens:
                return active_fraction < bound
        return False

    def blocked_cost(self, nnz, m: int, d: int, f: int, itemsize: int) -> jax.Array:
        """Seconds for the blocked kernel: weight slabs once per block of 1024 tokens (L2),
        plus the up and down steps' work per (pair, model column)."""
        return self._blocked_seconds(jnp.asarray(nnz).astype(jnp.float32), m, d, f, itemsize)

    def _blocked_seconds(self, nnz, m: int, d: int, f: int, itemsize: int):
        n_blocks = -(-m // _blocked.BLOCK_TOKENS)
        weights = n_blocks * 2.0 * d * f * itemsize / self.blocked_weight_bandwidth
        return weights + nnz * (2.0 * d / self.blocked_pair_rate) + self.blocked_fixed_overhead

    def union_cost(
        self, nnz, m: int, d: int, f: int, itemsize: int, union=None, transposed: bool = True,
        active_fraction: float | None = None,
    ) -> jax.Array:
        """Seconds for the blocked kernel with union products ("blocked_union"): the union
        rows of Wu^T and Wd read per 64-token block, plus a fixed part, plus the up weight's
        transpose where ``transposed`` is False (the call is not given ``w_up_t``). ``union``: the
        blocks' mean union as a fraction of f where measured (:func:`sampled_block_union`);
        None: the uniform pattern's at the density ``nnz / (M f)``, ``1 - (1 - p)^64``, which
        a trained model's skewed neuron rates stay well below (about half at ~0.6% active;
        ffi/notes/twell_ffn_blocked.md). Fitted with the down step as a union product too;
        where the down step runs with the weight stationary (:data:`STATIONARY_DOWN`, f up
        to 14,524, where :meth:`down_stationary` picks it at ``active_fraction``, the layer's
        known fraction or None) the up step's union rows are priced with the
        ``stationary_*`` constants and the down step per active pair instead."""
        union = None if union is None else jnp.asarray(union).astype(jnp.float32)
        return self._union_seconds(jnp.asarray(nnz).astype(jnp.float32), m, d, f, itemsize, union, transposed,
                                   active_fraction)

    def stationary_runs(self, m: int, d: int, f: int) -> bool:
        """Static: whether "blocked_union" can run its down step with the weight stationary
        (:data:`STATIONARY_DOWN` on and :func:`stationary_down_supported` at the default
        tile and capacity); :meth:`down_stationary` says whether it does."""
        return STATIONARY_DOWN and _stat.supported(m, d, f, blocked_max_entries(m, f, 256, 32))

    def down_stationary(self, m: int, d: int, f: int, itemsize: int, active_fraction: float | None = None,
                        transposed: bool = True) -> bool:
        """Static: True where "blocked_union" runs its down step with the weight stationary:
        where it can (:meth:`stationary_runs`) and its price is below the union product's at
        ``active_fraction`` (uniform rows; None: ``stationary_reference_fraction``). At
        (4096, 11008) the stationary step measured 5% faster at M=16,384 and 3-5% slower at
        M=4,096, where its price is 6-9% low and it is still picked
        (inference_stationary8_ab_c8wip.json, inference_stationary_final_dccf4a3.json)."""
        if not self.stationary_runs(m, d, f):
            return False
        p = self.stationary_reference_fraction if active_fraction is None else active_fraction
        nnz, union = p * m * f, _union.uniform_union(p)
        return (self._stationary_seconds(nnz, m, d, f, itemsize, union, transposed)
                <= self._union_model_seconds(nnz, m, d, f, itemsize, union, transposed))

    def _union_seconds(self, nnz, m: int, d: int, f: int, itemsize: int, union=None, transposed: bool = True,
                       active_fraction: float | None = None):
        if m < self.union_min_tokens:
            return nnz * 0.0 + math.inf  # a float or an array, as nnz
        if union is None:
            union = _union.uniform_union(nnz / float(max(1, m * f)))
        if self.down_stationary(m, d, f, itemsize, active_fraction, transposed):
            return self._stationary_seconds(nnz, m, d, f, itemsize, union, transposed)
        return self._union_model_seconds(nnz, m, d, f, itemsize, union, transposed)

    def _union_model_seconds(self, nnz, m: int, d: int, f: int, itemsize: int, union, transposed: bool):
        """Both steps as union products: the union rows of Wu^T and Wd, fixed, transpose."""
        transpose = 0.0 if transposed else 2.0 * d * f * itemsize / self.union_transpose_bandwidth
        return self.union_row_bytes(m, d, f, itemsize, union) / self.union_row_bandwidth + \
            self.union_fixed_overhead + transpose

    def _stationary_seconds(self, nnz, m: int, d: int, f: int, itemsize: int, union, transposed: bool):
        """The up step's union rows of Wu^T, the stationary walk's pairs per wave of CTAs,
        tokens, fixed, transpose."""
        cols = _stat.cols(f)
        waves = -(-d // (cols * self.stationary_sms))
        per_pair = self.stationary_pair_seconds if cols == 16 else self.stationary_pair_seconds_8
        transpose = 0.0 if transposed else 2.0 * d * f * itemsize / self.stationary_transpose_bandwidth
        return (0.5 * self.union_row_bytes(m, d, f, itemsize, union) / self.stationary_up_bandwidth
                + nnz * waves * per_pair + m * self.stationary_token_seconds + self.stationary_fixed_overhead
                + transpose)

    def union_row_bytes(self, m: int, d: int, f: int, itemsize: int, union):
        """Bytes of Wu^T and Wd rows the union products read for ``m`` tokens whose
        64-token blocks' mean union is ``union`` of f (Python float or array)."""
        return -(-m // _union.TOKENS) * union * 2.0 * f * d * itemsize

    def row_cost(
        self, nnz, n_overflow, d: int, f: int, itemsize: int, transposed: bool, m: int | None = None
    ) -> jax.Array:
        """Seconds for the row kernel (the ``sparse`` side of :meth:`use_sparse`); with ``m``
        (the call's tokens), its pair rate scaled down below :attr:`row_full_tokens`."""
        as_f32 = lambda v: jnp.asarray(v).astype(jnp.float32)
        return self._row_seconds(as_f32(nnz), as_f32(n_overflow), d, f, itemsize, transposed, m)

    def _row_seconds(self, nnz, n_overflow, d: int, f: int, itemsize: int, transposed: bool, m: int | None = None):
        rate = self.pair_bandwidth * (1.0 if m is None else min(1.0, m / self.row_full_tokens))
        sparse = nnz * (2.0 * d * itemsize / rate) + n_overflow * self.overflow_penalty
        return sparse + self.sparse_fixed_cost(d, f, itemsize, transposed)

    def dense_cost(self, m: int, d: int, f: int, itemsize: int) -> float:
        """Seconds of XLA's dense up + down for ``m`` tokens: the larger of the matmuls' FLOPs
        at ``matmul_rate`` and the two weights' bytes at ``hbm_bandwidth``."""
        return max(4.0 * m * d * f / self.matmul_rate, 2.0 * d * f * itemsize / self.hbm_bandwidth)

    def sparse_fixed_cost(self, d: int, f: int, itemsize: int, transposed: bool) -> float:
        """Seconds every sparse call pays whatever its entries: ``fixed_overhead``, plus the
        up weight's transpose when it is not given transposed."""
        transpose = 0.0 if transposed else 2.0 * d * f * itemsize / self.transpose_bandwidth
        return self.fixed_overhead + transpose

    def sparse_can_win(self, m: int, d: int, f: int, itemsize: int, transposed: bool = False) -> bool:
        """Static: False where even an all-zero activation would run faster dense."""
        if self.margin == float("inf"):
            return True
        return self.sparse_fixed_cost(d, f, itemsize, transposed) < self.margin * self.dense_cost(m, d, f, itemsize)

    def sparse_predicted(
        self, m: int, d: int, f: int, itemsize: int, active_fraction: float, transposed: bool = False,
        kernel: str = "row", union_fraction: float | None = None,
    ) -> bool:
        """Static: True where, at a known ``active_fraction`` of active (token, neuron) pairs
        (no overflow assumed), the row kernel (or, for a blocked ``kernel`` (one of
        :data:`KERNELS`) and at least ``BLOCKED_MIN_TOKENS`` tokens, the cheaper of the row
        and blocked kernels, "blocked_union" costed by :meth:`union_cost` with
        ``union_fraction``, a 64-token block's measured union of active neurons as a fraction
        of f, or the uniform pattern's where None) is predicted faster than dense up + down.
        What :func:`sparse_ffn` decides at trace time for calls past decode sizes when given
        ``active_fraction`` (passing "blocked_union" only where both union steps run)."""
        if not 0.0 <= active_fraction <= 1.0:
            raise ValueError(f"active_fraction must be in [0, 1], got {active_fraction}")
        if union_fraction is not None and not 0.0 <= union_fraction <= 1.0:
            raise ValueError(f"union_fraction must be in [0, 1], got {union_fraction}")
        if self.margin == float("inf"):
            return True
        if self.margin <= 0:
            return False
        nnz = active_fraction * m * f
        cost = self._row_seconds(nnz, 0.0, d, f, itemsize, transposed, m)  # Python floats: runs while tracing
        if kernel != "row" and m >= BLOCKED_MIN_TOKENS:
            cost = min(cost, self._kernel_seconds(nnz, m, d, f, itemsize, kernel, union_fraction, transposed))
        return cost < self.margin * self.dense_cost(m, d, f, itemsize)

    def _kernel_seconds(self, nnz, m: int, d: int, f: int, itemsize: int, kernel: str, union_fraction, transposed: bool):
        """The blocked ``kernel``'s cost: :meth:`union_cost` for "blocked_union", else
        :meth:`blocked_cost` (Python floats)."""
        if kernel == "blocked_union":
            p = nnz / float(max(1, m * f))
            return self._union_seconds(nnz, m, d, f, itemsize, union_fraction, transposed, p)
        return self._blocked_seconds(nnz, m, d, f, itemsize)

    def blocked_preferred(
        self, m: int, d: int, f: int, itemsize: int, active_fraction: float, transposed: bool = False,
        kernel: str = "blocked_union", union_fraction: float | None = None,
    ) -> bool:
        """Static: True where, at a known ``active_fraction`` (no overflow assumed), the
        blocked ``kernel`` (union products costed by :meth:`union_cost` with
        ``union_fraction``) is predicted faster than the row kernel for ``m`` tokens (at
        least ``BLOCKED_MIN_TOKENS``). Both are exact; :func:`sparse_ffn` makes this choice at
        trace time for a layer with a known fraction, so its sparse side has no device branch."""
        if not 0.0 <= active_fraction <= 1.0:
            raise ValueError(f"active_fraction must be in [0, 1], got {active_fraction}")
        if kernel == "row" or m < BLOCKED_MIN_TOKENS:
            return False
        nnz = active_fraction * m * f
        blocked = self._kernel_seconds(nnz, m, d, f, itemsize, kernel, union_fraction, transposed)
        return blocked < self._row_seconds(nnz, 0.0, d, f, itemsize, transposed, m)

    def use_sparse(self, nnz, n_overflow, m: int, d: int, f: int, itemsize: int, transposed: bool = False) -> jax.Array:
        """``[]`` bool on device: True where the fused sparse kernel should run."""
        if self.margin == float("inf"):
            return jnp.bool_(True)
        sparse = self.row_cost(nnz, n_overflow, d, f, itemsize, transposed, m)
        return sparse < self.margin * self.dense_cost(m, d, f, itemsize)


_crossover = RuleSlot(DenseCrossover())


def dense_crossover() -> DenseCrossover:
    """The rule :func:`sparse_ffn` uses now (inspectable)."""
    return _crossover.get()


def set_dense_crossover(rule: DenseCrossover) -> DenseCrossover:
    """Replaces the crossover rule for later traces; returns the previous rule."""
    return _crossover.set(rule)


def sparse_ffn(
    x,
    w_gate,
    w_up,
    w_down,
    *,
    tile: int,
    capacity: int,
    crossover: DenseCrossover | None = None,
    w_up_t=None,
    kernel: str = "auto",
    active_fraction: float | None = None,
    w_act_t=None,
    union_fraction: float | None = None,
):
    """Inference FFN: the gate (XLA's matmul then ``jax_twell_pack``, or the fused gate
    kernel), then the fused up + down kernel or dense.

    The fused gate kernel (:func:`gate_pack`, the TwELL pack in the gate matmul's
    epilogue) runs where the sparse side is expected (a forced rule, or a known
    ``active_fraction`` the rule sends to the kernels) and :func:`fused_gate_preferred`
    holds; a call that then turns out dense recomputes the FFN with XLA.

    ``kernel``: "auto" (default: "blocked_union" where the shape allows it, else "row"),
    "row", "blocked", "blocked_mma" (the blocked kernel with its up and down steps on
    tensor cores) or "blocked_union" (its up and down steps as dense products over each
    64-token block's union of active neurons; gated, where :func:`union_up_supported` and
    :func:`union_down_supported` hold at the default budget, else "blocked_mma"). With a blocked kernel, the call picks on the
    device, per call, among dense, the row kernel and the blocked kernel by the rule's
    costs (:meth:`DenseCrossover.blocked_cost`); with a known ``active_fraction`` only
    dense or sparse is decided per call, row or blocked at trace time
    (:meth:`DenseCrossover.blocked_preferred`). Where the call's entries overflow the
    blocked kernel's workspace, its handler runs the row kernel itself (exact, no device
    branch). M below ``BLOCKED_MIN_TOKENS`` (decode sizes) is
    decided at trace time as with "row" (a block would read all weights for few pairs).
    f32, or d/tile shapes the blocked kernel does not take, raise or run "row" as
    :func:`blocked_ffn` says. A margin of inf forces the blocked kernel (when it fits).

    Decode sizes: with ``decode_kernel_max_tokens`` set in the rule (off by default), calls
    of at most that many tokens run the gate matmul then the decode kernels
    (:func:`decode_ffn`; with ``decode_fused_gate``, the gate too: :func:`decode_ffn_gate`),
    reading only the weight rows of active neurons; give ``w_up_t`` there. With a known
    ``active_fraction`` (this layer's, a Python float), decode-sized calls choose at
    trace time instead, with no device check: the decode kernels where
    :meth:`DenseCrossover.decode_wins` and the up weight comes as ``w_up_t`` (or the FFN
    is non-gated), else the paths below. Past decode sizes a known ``active_fraction``
    where :meth:`DenseCrossover.sparse_predicted` says dense runs XLA's dense FFN with
    nothing added (no count, no device branch: exactly XLA's time); where it says sparse,
    the per-call device choice below still runs (it sees the true counts).

    x: ``[M, d]``; weights as in :func:`jax_twell.sparse_ffn`. Where ``crossover`` (default
    :func:`dense_crossover`) predicts the dense path is faster for this call's sparsity,
    the up and down projections run dense through XLA from the same gate activation.
    ``w_up_t``: optional ``[f, d]`` pre-transposed up weight (see :func:`twell_ffn`).
    ``union_fraction``: optional, this layer's measured 64-token union of active neurons as a
    fraction of f (a Python float; :func:`block_union_fraction`): with ``active_fraction``
    it prices the union products at trace time, and wherever the call has no sample of g
    (the fused gate) it replaces the uniform pattern's union in the per-call choice; a
    trained layer's union is about half the uniform pattern's at the same density.
    ``w_act_t``: optional ``[f, d]`` activation weight stored by neuron (``w_gate.T`` gated,
    ``w_up.T`` non-gated): where the decode kernels run without a device check and the call
    has at most ``decode_rows_max_tokens`` tokens, :func:`decode_ffn_rows` runs instead
    (gated, with ``w_up_t`` only).
    """
    _check_kernel(kernel, allow_auto=True)
    if union_fraction is not None and not 0.0 <= union_fraction <= 1.0:
        raise ValueError(f"union_fraction must be in [0, 1] or None, got {union_fraction!r}")
    rule = _crossover.get() if crossover is None else crossover
    gated = w_gate is not None
    w_act = w_gate if gated else w_up
    m, d = x.shape
    f = w_act.shape[1]
    if kernel == "auto":
        kernel = "blocked_union" if blocked_supported(d, tile) else "row"
    if kernel == "blocked_union" and not _union_runs(gated, m, d, f, tile, capacity):
        kernel = "blocked_mma"  # the same kernel without the union steps, costed as such
    if m == 0:  # no tokens: nothing to launch, whatever the rule
        return jnp.zeros((0, d), x.dtype)
    transposed = w_up_t is not None or not gated
    known = active_fraction is not None and transposed and rule.decode_wins(m, active_fraction)
    if (known or 0 < m <= rule.decode_kernel_max_tokens) and rule.margin > 0 and decode_supported(d, f, x.dtype):
        unchecked = known or rule.decode_dense_above is None or rule.margin == float("inf")
        rows = w_act_t is not None and transposed and m <= rule.decode_rows_max_tokens
        if unchecked and rows and decode_rows_supported(m, d, f, x.dtype):
            return decode_ffn_rows(x, w_act_t, w_down, w_up_t=w_up_t if gated else None)
        if unchecked and rule.decode_fused_gate and m <= rule.decode_fused_gate_max_tokens and decode_gate_supported(m, d, f):
            return decode_ffn_gate(x, w_act, w_up if gated else None, w_down, w_up_t=w_up_t)
        g = relu_matmul(x, w_act)
        run = lambda: decode_ffn(x, g, w_up if gated else None, w_down, w_up_t=w_up_t)
        if unchecked:
            return run()
        few = jnp.count_nonzero(g) <= rule.decode_dense_above * m * f
        return jax.lax.cond(few, run, lambda: xla.up_down(x, g, w_up if gated else None, w_down))
    decode_sized = 0 < m <= max((tokens for tokens, _ in rule.decode_active_below), default=0)
    if active_fraction is not None and transposed and decode_sized and 0 < rule.margin < float("inf"):
        # Decode-sized, the fraction known and past the decode kernels' bound: dense. The
        # per-call check below would run the row kernel here, which loses at these sizes
        # (0.16x measured at M=4, 2% active: decode_quick_fdfd87d.json).
        return xla.ffn(x, w_gate, w_up, w_down)
    if 0 < m <= rule.decode_gather_max_tokens and 0 < rule.margin < float("inf"):
        width = xla.gather_width(m, f, rule.decode_active_per_token)
        return xla.gather_ffn(x, w_gate, w_up, w_down, width=width, w_up_t=w_up_t)
    if not rule.sparse_can_win(m, d, f, x.dtype.itemsize, transposed):
        return xla.ffn(x, w_gate, w_up, w_down)
    if active_fraction is not None and not rule.sparse_predicted(
        m, d, f, x.dtype.itemsize, active_fraction, transposed, kernel, union_fraction
    ):
        return xla.ffn(x, w_gate, w_up, w_down)
    # Where the sparse side is expected (forced, or a known fraction the rule sends to it)
    # the fused gate kernel packs in the matmul's epilogue and gives exact counts; a call
    # that then runs dense recomputes the gate (XLA's FFN). Otherwise XLA's matmul writes g,
    # the decision reads a sample of its rows (one small XLA reduction) and a call that runs
    # dense pays neither a full count nor the pack.
    expect_sparse = rule.margin == float("inf") or active_fraction is not None
    if expect_sparse and fused_gate_preferred(m, d, f, tile, capacity, x.dtype):
        g = None
        gate = gate_pack(x, w_act, tile=tile, capacity=capacity)
        nnz = gate.counts.sum(dtype=jnp.int32).astype(jnp.float32)
        n_over = gate.overflowed.sum(dtype=jnp.int32).astype(jnp.float32)
    else:
        g = relu_matmul(x, w_act)
        sample_rows = rule.sample_rows(m)
        nnz, n_over = sampled_gate_counts(g, tile=tile, capacity=capacity, rows=sample_rows)
    use_sparse = rule.use_sparse(nnz, n_over, m, d, f, x.dtype.itemsize, transposed)

    def packed():
        return gate if g is None else pack_twell(g, tile=tile, capacity=capacity)

    def row_kernel(act):
        return _twell_ffn_call(x, act, w_act, w_up if gated else None, w_down, w_up_t)

    def sparse(_):
        return row_kernel(packed())

    def dense(_):
        if g is None:
            return xla.ffn(x, w_gate, w_up, w_down)
        return xla.up_down(x, g, w_up if gated else None, w_down)

    blocked = kernel != "row" and m >= BLOCKED_MIN_TOKENS and jnp.dtype(x.dtype) != jnp.float32
    if blocked:
        check_blocked_supported(d, tile)
        max_entries = blocked_max_entries(m, f, tile, capacity)
        if rule.margin == float("inf"):
            prefer_blocked, any_sparse = True, jnp.bool_(True)
        else:
            row_cost = rule.row_cost(nnz, n_over, d, f, x.dtype.itemsize, transposed, m)
            if kernel == "blocked_union":  # the union measured on a sample of g's blocks where g exists
                union = union_fraction if g is None else sampled_block_union(g, rows=sample_rows)
                blocked_cost = rule.union_cost(nnz, m, d, f, x.dtype.itemsize, union, transposed, active_fraction)
            else:
                blocked_cost = rule.blocked_cost(nnz, m, d, f, x.dtype.itemsize)
            any_sparse = use_sparse | (blocked_cost < rule.margin * rule.dense_cost(m, d, f, x.dtype.itemsize))
            if active_fraction is not None:  # row or blocked (both exact): at trace time, no second branch
                prefer_blocked = rule.blocked_preferred(
                    m, d, f, x.dtype.itemsize, active_fraction, transposed, kernel, union_fraction
                )
            else:
                prefer_blocked = blocked_cost < row_cost

        def sparse_branch(_):
            act = packed()
            # The blocked kernel falls back to the row kernel by itself where the call's
            # entries overflow its workspace (on the device, inside the handler).
            mma, union = kernel != "blocked", kernel == "blocked_union"
            run_blocked = lambda a: _blocked_call(
                x, a, w_act, w_up if gated else None, w_down, w_up_t, max_entries, mma, union, union, fallback=True,
                down_stationary=union and rule.down_stationary(
                    m, d, f, x.dtype.itemsize, active_fraction, transposed),
            )[0]
            if isinstance(prefer_blocked, bool):
                return run_blocked(act) if prefer_blocked else row_kernel(act)
            return jax.lax.cond(prefer_blocked, run_blocked, row_kernel, act)

        if rule.margin == float("inf"):
            return sparse_branch(None)
        return jax.lax.cond(any_sparse, sparse_branch, dense, None)
    if rule.margin == float("inf"):
        return sparse(None)
    return jax.lax.cond(use_sparse, sparse, dense, None)


# ---------------------------------------------------------------------------------------
# Decode-sized calls (ffi/twell_decode.cu): the dense gate activation straight to y.

DECODE_TILE = 256  # the decode kernel's column tile (its workspace layout)
_DECODE_MAX_D = 8192
_DECODE_MAX_F = 50000


def decode_supported(d: int, f: int, dtype) -> bool:
    """True when the decode kernel takes the shape: bf16 or f16, ``d`` a multiple of 8 and at
    most 8192, ``f`` at most 50,000 (one token's entries are listed in shared memory)."""
    return (
        jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and 0 < d <= _DECODE_MAX_D
        and d % 8 == 0
        and 0 < f <= _DECODE_MAX_F
    )


def _decode_out_types(m: int, d: int, f: int, dtype):
    """y ``[M, d]`` and the decode kernels' workspace: per (token, 256-column tile) counts
    and entry lists."""
    n_tiles = -(-f // DECODE_TILE)
    return (
        jax.ShapeDtypeStruct((m, d), dtype),
        jax.ShapeDtypeStruct((m, n_tiles), jnp.int32),
        jax.ShapeDtypeStruct((m, n_tiles * DECODE_TILE), jnp.uint32),
    )


def decode_ffn(x, g, w_up, w_down, *, w_up_t=None, workspace: bool = False):
    """FFN output from the dense gate activation by the decode kernels (``jax_twell_decode``).

    Gated (``w_up`` given): ``y = (g * (x @ w_up)) @ w_down`` with ``x @ w_up`` computed only
    where ``g != 0``; non-gated (``w_up=None``): ``y = g @ w_down``. Reads one row of
    ``w_up.T`` and one of ``w_down`` per active (token, neuron) pair and nothing else of the
    weights, so it suits decode-sized token counts (the whole FFN with the gate matmul is
    :func:`sparse_ffn` under a rule with ``decode_kernel_max_tokens``). Exact for every
    activation pattern (no capacity); deterministic.

    Args:
      x: ``[M, d]`` bf16 or f16 (see :func:`decode_supported`).
      g: ``[M, f]`` x's dtype: ``relu(x @ w_gate)`` (gated) or ``relu(x @ w_up)`` (non-gated).
      w_up: ``[d, f]`` or None.  w_down: ``[f, d]``.
      w_up_t: optional ``[f, d]`` copy of ``w_up.T`` (the layout the kernel reads); omitted,
        it is transposed here.
      workspace: also return the kernel's ``counts [M, ceil(f/256)]`` and ``entries`` (tests).
    Returns:
      ``y [M, d]`` x's dtype (and the workspace when asked).
    Raises:
      ValueError: shapes or dtype the kernel does not take.
    """
    m, f = g.shape
    d = w_down.shape[1]
    if not decode_supported(d, f, g.dtype):
        raise ValueError(
            f"the decode kernel needs bf16 or f16, d a multiple of 8 and at most {_DECODE_MAX_D}, "
            f"f at most {_DECODE_MAX_F}; got {jnp.dtype(g.dtype).name}, d={d}, f={f}"
        )
    out_types = _decode_out_types(m, d, f, g.dtype)
    if w_up is None:
        out = kernel_call("jax_twell_decode", out_types, vmap_method="sequential")(g, w_down)
    else:
        if w_up_t is None:
            w_up_t = w_up.T
        out = kernel_call("jax_twell_decode_gated", out_types, vmap_method="sequential")(x, g, w_up_t, w_down)
    return out if workspace else out[0]


_DECODE_GATE_MAX_TOKENS = 64
_GATE_COLS, _GATE_K, _GATE_MAX_SPLITS = 128, 64, 8  # the gate kernel's column block, rows per stage, cluster


def decode_gate_supported(m: int, d: int, f: int) -> bool:
    """True when the decode gate kernel takes the shape: at most 64 tokens, ``d`` a multiple
    of 16, ``f`` a multiple of 8 (plus :func:`decode_supported`)."""
    return 0 < m <= _DECODE_GATE_MAX_TOKENS and d % 16 == 0 and f % 8 == 0


def decode_gate_splits(m: int, d: int, f: int, sms: int | None = None) -> int:
    """K ranges of the decode gate kernel (at most 8, the portable cluster size): the
    ``ceil(f / 128)`` column blocks times the ranges fill at most the three CTAs per SM that
    fit (one wave: a second would double the time), and no more ranges than d has 64-row
    stages. Their f32 partial sums (``splits * M * f * 4`` bytes, through the workspace by
    default) are why the decode path keeps XLA's gate above 32 tokens; ``m`` does not
    change the count."""
    if sms is None:
        sms = getattr(jax.devices()[0], "core_count", None) or 132
    blocks = -(-f // _GATE_COLS)
    return max(1, min(_GATE_MAX_SPLITS, -(-d // _GATE_K), 3 * sms // blocks))


def decode_ffn_gate(
    x, w_act, w_up, w_down, *, w_up_t=None, workspace: bool = False, splits: int | None = None, cluster: bool = False
):
    """The whole decode FFN in our kernels: gate matmul (tensor cores, split-K over d, the
    gate weight read once), then :func:`decode_ffn`'s two steps on its result.

    Same math as :func:`decode_ffn` with ``g = relu(x @ w_act)``: f32 accumulation, the K
    ranges' partial sums added in a fixed order and rounded once to x's dtype (as XLA's
    matmul rounds), so g matches ``relu_matmul`` up to the order of the f32 additions, and
    is deterministic. ``w_act``: ``w_gate`` (gated, ``w_up`` given) or ``w_up`` (non-gated,
    ``w_up=None``), ``[d, f]``. ``workspace=True`` also returns ``(g [M, f], counts,
    entries)``. ``splits``: the K ranges, 1 to min(8, ceil(d / 64)) (default
    :func:`decode_gate_splits`; for tuning). ``cluster``: the ranges' partial sums are
    added in a thread-block cluster's shared memory (True) or written to an f32 workspace
    ``[splits, M, f]`` and added by the next step (False, the default: a cluster must fit
    one GPC, which left SMs idle; measured in ffi/notes/decode.md); same result, bit for
    bit.

    Raises:
      ValueError: shapes the kernels do not take (:func:`decode_supported`,
        :func:`decode_gate_supported`).
    """
    m, d = x.shape
    f = w_act.shape[1]
    if not (decode_supported(d, f, x.dtype) and decode_gate_supported(m, d, f)):
        raise ValueError(
            f"the decode gate kernel needs bf16 or f16, at most {_DECODE_GATE_MAX_TOKENS} tokens, d a multiple "
            f"of 16 and at most {_DECODE_MAX_D}, f a multiple of 8 and at most {_DECODE_MAX_F}; got "
            f"{jnp.dtype(x.dtype).name}, M={m}, d={d}, f={f}"
        )
    if splits is None:
        splits = decode_gate_splits(m, d, f)
    elif not 1 <= splits <= min(_GATE_MAX_SPLITS, -(-d // _GATE_K)):
        raise ValueError(f"splits must be in [1, min(8, ceil(d / 64))] = [1, {min(8, -(-d // 64))}], got {splits}")
    splits = np.int32(splits)
    y_type, *work = _decode_out_types(m, d, f, x.dtype)
    partial_shape = (0,) if cluster else (int(splits), m, f)
    out_types = (y_type, jax.ShapeDtypeStruct((m, f), x.dtype), jax.ShapeDtypeStruct(partial_shape, jnp.float32), *work)
    if w_up is None:
        out = kernel_call("jax_twell_decode_fused", out_types, vmap_method="sequential")(x, w_act, w_down, splits=splits)
    else:
        if w_up_t is None:
            w_up_t = w_up.T
        call = kernel_call("jax_twell_decode_fused_gated", out_types, vmap_method="sequential")
        out = call(x, w_act, w_up_t, w_down, splits=splits)
    return (out[0], out[1], *out[3:]) if workspace else out[0]


DECODE_ROWS_MAX_TOKENS = 4
DECODE_ROWS_NEURONS = 16  # neurons per CTA of the rows kernel (its workspace layout)
_DECODE_ROWS_MAX_F = 1 << 20


def decode_rows_supported(m: int, d: int, f: int, dtype) -> bool:
    """True when :func:`decode_ffn_rows` takes the shape: bf16 or f16, 1 to 4 tokens, ``d`` a
    multiple of 8 and at most 8192, ``f`` at most 2^20."""
    return (
        jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and 0 < m <= DECODE_ROWS_MAX_TOKENS
        and 0 < d <= _DECODE_MAX_D
        and d % 8 == 0
        and 0 < f <= _DECODE_ROWS_MAX_F
    )


def decode_ffn_rows(x, w_act_t, w_down, *, w_up_t=None, workspace: bool = False):
    """The whole FFN for 1-4 tokens from weights stored by neuron, in two launches
    (``jax_twell_decode_rows``, ffi/twell_decode_rows.cu).

    Gated (``w_up_t`` given): ``y = (relu(x @ w_act_t.T) * (x @ w_up_t.T)) @ w_down``;
    non-gated (``w_up_t=None``): ``y = relu(x @ w_act_t.T) @ w_down``. Each warp streams
    whole rows of ``w_act_t`` (the gate weight, read once, its rows contiguous), then reads
    one ``w_up_t`` row and one ``w_down`` row per neuron active for some token, and nothing
    else of the weights. f32 accumulation; the activation is rounded once to x's dtype (as
    XLA's matmul rounds), h as the reference rounds it, y summed over neurons in a fixed
    order and rounded once: deterministic, exact for every activation pattern.

    Args:
      x: ``[M, d]`` bf16 or f16, 1 <= M <= 4 (see :func:`decode_rows_supported`).
      w_act_t: ``[f, d]``: ``w_gate.T`` (gated) or ``w_up.T`` (non-gated).
      w_down: ``[f, d]``.
      w_up_t: ``[f, d]`` ``w_up.T`` for the gated FFN, or None.
      workspace: also return the activation ``g [M, f]`` and the per-CTA flags
        ``[ceil(f / 16), M]`` (active neurons of each 16-neuron group per token; tests).
    Returns:
      ``y [M, d]`` x's dtype (and the workspace when asked).
    Raises:
      ValueError: shapes or dtype the kernel does not take.
    """
    m, d = x.shape
    f = w_act_t.shape[0]
    if not decode_rows_supported(m, d, f, x.dtype):
        raise ValueError(
            f"the decode rows kernel needs bf16 or f16, 1 to {DECODE_ROWS_MAX_TOKENS} tokens, d a multiple of 8 "
            f"and at most {_DECODE_MAX_D}, f at most {_DECODE_ROWS_MAX_F}; got {jnp.dtype(x.dtype).name}, M={m}, "
            f"d={d}, f={f}"
        )
    for name, w in (("w_act_t", w_act_t), ("w_up_t", w_up_t), ("w_down", w_down)):
        if w is not None and (w.shape != (f, d) or w.dtype != x.dtype):
            raise ValueError(f"{name} must be [f, d] = [{f}, {d}] in x's dtype, got {w.shape} {w.dtype}")
    groups = -(-f // DECODE_ROWS_NEURONS)
    out_types = (
        jax.ShapeDtypeStruct((m, d), x.dtype),
        jax.ShapeDtypeStruct((m, f), x.dtype),
        jax.ShapeDtypeStruct((groups, m, d), jnp.float32),
        jax.ShapeDtypeStruct((groups, m), jnp.int32),
    )
    if w_up_t is None:
        out = kernel_call("jax_twell_decode_rows", out_types, vmap_method="sequential")(x, w_act_t, w_down)
    else:
        out = kernel_call("jax_twell_decode_rows_gated", out_types, vmap_method="sequential")(x, w_act_t, w_up_t, w_down)
    return (out[0], out[1], out[3]) if workspace else out[0]


def gate_counts(g: jax.Array, *, tile: int, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What the dispatch needs from ``g [M, f]``, without packing it (one XLA reduction).

    Returns ``[]`` int32 each: active pairs ``nnz`` (the pack's ``counts.sum()``), overflowed
    tiles (``overflowed.sum()``) and the entries the blocked kernel needs
    (:func:`blocked_needed_entries` of the packed ``g``).
    """
    m, f = g.shape
    n_tiles = -(-f // tile)
    active = g != 0
    if n_tiles * tile != f:
        active = jnp.pad(active, ((0, 0), (0, n_tiles * tile - f)))
    per_tile = active.reshape(m, n_tiles, tile).sum(axis=-1, dtype=jnp.int32)
    over = per_tile > capacity
    return (
        per_tile.sum(dtype=jnp.int32),
        over.sum(dtype=jnp.int32),
        jnp.where(over, _tile_widths(f, tile), per_tile).sum(dtype=jnp.int32),
    )


def _gate_sample(g: jax.Array, rows: int, block: int = _union.TOKENS) -> jax.Array:
    """The rows of ``g [M, f]`` the per-call choice reads: all of them below ``2 * rows``,
    else ``max(1, rows // block)`` whole ``block``-row blocks evenly spaced, as
    ``[n_blocks, block, f]`` (``[1, M, f]`` for all rows). One sample serves both
    :func:`sampled_gate_counts` and :func:`sampled_block_union`, so a call that takes both
    reads it once."""
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
    from about ``rows`` rows of ``g [M, f]`` (:func:`_gate_sample`: whole 64-row blocks
    evenly spaced), scaled to M (``[]`` float32 each). Exact when ``M < 2 * rows`` (every
    row is counted). The estimate steers only the speed choice of :func:`sparse_ffn`,
    never what is computed."""
    m, f = g.shape
    sample = _gate_sample(g, rows).reshape(-1, f)
    nnz, n_over, _ = gate_counts(sample, tile=tile, capacity=capacity)
    scale = m / max(sample.shape[0], 1)  # M = 0: nothing counted
    return nnz.astype(jnp.float32) * scale, n_over.astype(jnp.float32) * scale


def sampled_block_union(g: jax.Array, *, rows: int) -> jax.Array:
    """``[]`` float32: the mean fraction of the f neurons active for some token of a
    64-token block (what the union products read, per block), from the same rows as
    :func:`sampled_gate_counts` (every block below ``2 * rows`` rows; the rows themselves
    under one block). Like it, it only steers the speed choice of :func:`sparse_ffn`."""
    block = _union.TOKENS
    m, f = g.shape
    if m == 0 or f == 0:
        return jnp.float32(0.0)
    sample = _gate_sample(g, rows, block)
    if m < 2 * rows and m >= block:  # all rows sampled: their whole blocks
        sample = g[: m // block * block].reshape(m // block, block, f)
    return (sample > 0).any(axis=1).mean(dtype=jnp.float32)


def block_union_fraction(g: jax.Array) -> jax.Array:
    """``[]`` float32: the mean over the full 64-token blocks of ``g [M, f]`` (tokens in
    order; the one partial block where M < 64) of the fraction of the f neurons active
    (``g > 0``) for some token of the block: the ``union_fraction`` of :func:`sparse_ffn`,
    measured on a layer's gate activations (e.g. ``relu(x @ w_gate)`` for sample inputs).
    :func:`sampled_block_union` with every row in the sample."""
    return sampled_block_union(g, rows=max(g.shape[0], 1))


# The fused gate kernel (ffi/twell_gate.cu): a CUTLASS Hopper GEMM whose output tiles
# (64 or 128 tokens x 256 neurons, one TwELL tile) are packed as TwELL in its epilogue, so
# the M x f activation is never written.
FUSED_GATE_TILE = 256
FUSED_GATE_MAX_CAPACITY = 64
# Where the FFN paths use the fused gate instead of XLA's matmul + the pack kernel: from
# M=2048 up it measured 1.08-1.14x faster than those two at every benchmark shape (H200,
# bf16; ffi/notes/twell_gate.md). Below, its tiles no longer fill the GPU (no split over
# d). gate_pack itself takes any M.
FUSED_GATE_MIN_TOKENS = 2048
# The GEMM's configuration code (ffi/twell_gate.cu, attribute `variant`): configuration
# 0 cooperative 128 x 256 tiles, 1 ping-pong 64 x 256 tiles, 2 the same in clusters of 4;
# plus 4 x raster order and 16 x log2 swizzle of the tile scheduler. None: by d, as
# measured (:func:`fused_gate_variant`).
FUSED_GATE_VARIANT = None


def fused_gate_variant(d: int) -> int:
    """The fused gate GEMM's configuration for width ``d``: ping-pong below d=4096 (0.88-0.93x
    of XLA's matmul at d=2048, the cooperative one 0.84-0.89x), cooperative from 4096 (0.99x,
    ping-pong 0.87x), unless ``FUSED_GATE_VARIANT`` is set."""
    if FUSED_GATE_VARIANT is not None:
        return FUSED_GATE_VARIANT
    return 0 if d >= 4096 else 1


def fused_gate_supported(d: int, f: int, tile: int, capacity: int, dtype) -> bool:
    """True when :func:`gate_pack` takes this problem: bf16 or f16, ``tile == 256``,
    ``capacity`` in [1, 64], ``d`` and ``f`` positive multiples of 8."""
    return (
        jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and tile == FUSED_GATE_TILE
        and 1 <= capacity <= FUSED_GATE_MAX_CAPACITY
        and d > 0
        and d % 8 == 0
        and f > 0
        and f % 8 == 0
    )


def fused_gate_preferred(m: int, d: int, f: int, tile: int, capacity: int, dtype) -> bool:
    """True where the FFN paths pack the gate with the fused kernel: it takes the problem
    (:func:`fused_gate_supported`) and measured faster than XLA's matmul + the pack there
    (``FUSED_GATE_MIN_TOKENS`` <= M)."""
    return m >= FUSED_GATE_MIN_TOKENS and fused_gate_supported(d, f, tile, capacity, dtype)


def gate_pack(x: jax.Array, w: jax.Array, *, tile: int, capacity: int, variant: int | None = None) -> TwELL:
    """``relu(x @ w)`` as TwELL by the fused gate kernel: the matmul's epilogue packs each
    output tile (``jax_twell_gate_pack``); no ``[M, f]`` activation is written.

    x: ``[..., M, d]``, w: ``[d, f]``, one dtype; :func:`fused_gate_supported` must hold
    (the handler refuses anything else with an error naming the constraint). The result is
    what ``pack_twell(relu(x @ w))`` gives, up to the last bit of an element: the matmul
    accumulates in f32 in its own order over ``d`` and rounds once, as XLA's does, but
    XLA's order differs. ``variant``: the GEMM's configuration code (default
    :func:`fused_gate_variant`; see ffi/twell_gate.cu), the same result for every code.
    """
    d, f = w.shape
    variant = fused_gate_variant(d) if variant is None else variant
    lead = x.shape[:-1]
    rows = int(np.prod(lead)) if lead else 1
    n_tiles = -(-f // tile)
    out_types = (
        jax.ShapeDtypeStruct((rows, n_tiles, capacity), x.dtype),
        jax.ShapeDtypeStruct((rows, n_tiles, capacity), jnp.int16),
        jax.ShapeDtypeStruct((rows, n_tiles), jnp.int32),
    )
    if rows == 0:
        values, cols, counts = (jnp.zeros(t.shape, t.dtype) for t in out_types)
    else:
        call = kernel_call("jax_twell_gate_pack", out_types, vmap_method="sequential")
        values, cols, counts = call(
            x.reshape(rows, d), w, tile=np.int32(tile), capacity=np.int32(capacity), variant=np.int32(variant)
        )
    return TwELL(
        values.reshape(*lead, n_tiles, capacity),
        cols.reshape(*lead, n_tiles, capacity),
        counts.reshape(*lead, n_tiles),
        f=f,
        tile=tile,
    )


def gate_twell(x, w, *, tile: int, capacity: int) -> TwELL:
    """``relu(x @ w)`` as TwELL: the fused gate kernel (:func:`gate_pack`) where
    :func:`fused_gate_preferred` holds, as in the FFN paths, else XLA's matmul (f32
    accumulation) then ``jax_twell_pack``."""
    m = int(np.prod(x.shape[:-1])) if x.ndim > 1 else 1
    if fused_gate_preferred(m, w.shape[0], w.shape[1], tile, capacity, x.dtype):
        return gate_pack(x, w, tile=tile, capacity=capacity)
    return pack_twell(relu_matmul(x, w), tile=tile, capacity=capacity)
