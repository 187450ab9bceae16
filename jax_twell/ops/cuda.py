"""CUDA implementations: thin ``jax.ffi.ffi_call`` wrappers over the registered handlers.

Each wrapper builds the call for operands already validated by the public API; the
handlers re-check shapes and fail with an InvalidArgument naming the constraint.
Attributes are numpy scalars of the declared type (a Python float would arrive as F64).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_twell.formats import TwELL, relu_matmul
from jax_twell.ops import xla

__all__ = [
    "pack_twell",
    "gate_twell",
    "twell_ffn",
    "sparse_ffn",
    "DenseCrossover",
    "supports",
    "check_supported",
    "dense_crossover",
    "set_dense_crossover",
]


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
    call = jax.ffi.ffi_call("jax_twell_pack", out_types, vmap_method="broadcast_all")
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
        call = jax.ffi.ffi_call("jax_twell_ffn", out_type, vmap_method="sequential")
        return call(x, act.values, act.cols, act.counts, w_act, w_down, tile=np.int32(act.tile))
    if w_up_t is None:
        w_up_t = w_up.T
    call = jax.ffi.ffi_call("jax_twell_ffn_gated", out_type, vmap_method="sequential")
    return call(x, act.values, act.cols, act.counts, w_act, w_up, w_up_t, w_down, tile=np.int32(act.tile))


def twell_ffn(x, act: TwELL, w_act, w_up, w_down, *, w_up_t=None):
    """FFN output from a packed activation by the fused ``jax_twell_ffn`` kernels.

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
    return _twell_ffn_call(x, act, w_act, w_up, w_down, w_up_t)


@dataclasses.dataclass(frozen=True)
class DenseCrossover:
    """When the sparse FFN runs the fused TwELL kernel, and when dense math through XLA.

    Both paths share the gate matmul and the pack (its counts give the true number of
    active (token, neuron) pairs ``nnz``); the rule compares what comes after, in seconds:

    - sparse: ``nnz * 2 * d * itemsize / pair_bandwidth`` (the kernel reads one row of
      Wu^T and one of Wd per pair, mostly from L2) + ``overflow_penalty`` per overflowed
      tile + ``2 * d * f * itemsize / transpose_bandwidth`` when the up weight is
      transposed in the call + ``fixed_overhead``;
    - dense up + down: ``max(4 * M * d * f / matmul_rate, 2 * d * f * itemsize / hbm_bandwidth)``.

    The kernel runs where the sparse estimate is below ``margin`` times the dense one.
    Where even ``nnz = 0`` can't win (decode-sized M) the choice is made at trace time
    (no device-side branch); otherwise on the device, per call, with ``lax.cond``.
    Constants fitted to H200 measurements of this kernel (ffi/notes/twell_ffn.md).
    Override with :func:`set_dense_crossover`: ``DenseCrossover(margin=inf)`` always runs
    sparse, ``margin=0`` always dense; or per call through :func:`sparse_ffn`.
    """

    pair_bandwidth: float = 3.3e12
    matmul_rate: float = 6.0e14
    hbm_bandwidth: float = 3.0e12
    transpose_bandwidth: float = 1.4e12
    overflow_penalty: float = 2.0e-6
    fixed_overhead: float = 1.0e-5
    margin: float = 1.0

    def dense_cost(self, m: int, d: int, f: int, itemsize: int) -> float:
        return max(4.0 * m * d * f / self.matmul_rate, 2.0 * d * f * itemsize / self.hbm_bandwidth)

    def sparse_fixed_cost(self, d: int, f: int, itemsize: int, transposed: bool) -> float:
        transpose = 0.0 if transposed else 2.0 * d * f * itemsize / self.transpose_bandwidth
        return self.fixed_overhead + transpose

    def sparse_can_win(self, m: int, d: int, f: int, itemsize: int, transposed: bool = False) -> bool:
        """Static: False where even an all-zero activation would run faster dense."""
        if self.margin == float("inf"):
            return True
        return self.sparse_fixed_cost(d, f, itemsize, transposed) < self.margin * self.dense_cost(m, d, f, itemsize)

    def use_sparse(self, nnz, n_overflow, m: int, d: int, f: int, itemsize: int, transposed: bool = False) -> jax.Array:
        """``[]`` bool on device: True where the fused sparse kernel should run."""
        if self.margin == float("inf"):
            return jnp.bool_(True)
        sparse = jnp.asarray(nnz).astype(jnp.float32) * (2.0 * d * itemsize / self.pair_bandwidth)
        sparse = sparse + jnp.asarray(n_overflow).astype(jnp.float32) * self.overflow_penalty
        sparse = sparse + self.sparse_fixed_cost(d, f, itemsize, transposed)
        return sparse < self.margin * self.dense_cost(m, d, f, itemsize)


_crossover = DenseCrossover()


def dense_crossover() -> DenseCrossover:
    """The rule :func:`sparse_ffn` uses now (inspectable)."""
    return _crossover


def set_dense_crossover(rule: DenseCrossover) -> DenseCrossover:
    """Replaces the crossover rule for later traces; returns the previous rule."""
    global _crossover
    if not isinstance(rule, DenseCrossover):
        raise TypeError(f"rule must be a DenseCrossover, got {type(rule).__name__}")
    previous, _crossover = _crossover, rule
    return previous


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
):
    """Inference FFN: XLA gate matmul, ``jax_twell_pack``, then the fused kernel or dense.

    x: ``[M, d]``; weights as in :func:`jax_twell.sparse_ffn`. Where ``crossover`` (default
    :func:`dense_crossover`) predicts the dense path is faster for this call's sparsity,
    the up and down projections run dense through XLA from the same gate activation.
    ``w_up_t``: optional ``[f, d]`` pre-transposed up weight (see :func:`twell_ffn`).
    """
    rule = _crossover if crossover is None else crossover
    gated = w_gate is not None
    w_act = w_gate if gated else w_up
    m, d = x.shape
    f = w_act.shape[1]
    transposed = w_up_t is not None or not gated
    if not rule.sparse_can_win(m, d, f, x.dtype.itemsize, transposed):
        return xla.ffn(x, w_gate, w_up, w_down)
    g = relu_matmul(x, w_act)
    act = pack_twell(g, tile=tile, capacity=capacity)
    nnz = act.counts.sum(dtype=jnp.int32)
    n_over = act.overflowed.sum(dtype=jnp.int32)
    use_sparse = rule.use_sparse(nnz, n_over, m, d, f, x.dtype.itemsize, transposed)

    def sparse(_):
        return _twell_ffn_call(x, act, w_act, w_up if gated else None, w_down, w_up_t)

    def dense(_):
        h = g
        if gated:
            h = h * jnp.matmul(x, w_up, preferred_element_type=jnp.float32).astype(x.dtype)
        return jnp.matmul(h, w_down, preferred_element_type=jnp.float32).astype(x.dtype)

    if rule.margin == float("inf"):
        return sparse(None)
    return jax.lax.cond(use_sparse, sparse, dense, None)


def gate_twell(x, w, *, tile: int, capacity: int) -> TwELL:
    """``relu(x @ w)`` as TwELL: XLA matmul (f32 accumulation) then ``jax_twell_pack``."""
    return pack_twell(relu_matmul(x, w), tile=tile, capacity=capacity)
