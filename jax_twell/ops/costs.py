"""Fitted cost models: what a plan compares to choose between the kernels and dense XLA.

Both are frozen dataclasses of constants fitted to H200 measurements
(``benchmarks/fit_inference_rule.py``, ``benchmarks/fit_train_rule.py``; the fits and
their residuals are in ffi/notes/twell_ffn_blocked.md and ffi/notes/training_kernels.md).
Their methods are plain arithmetic, on Python floats at trace time or on device arrays
for a per-call choice. A plan takes a rule as an option (:class:`jax_twell.ops.plan.FFNOptions`,
:class:`~jax_twell.ops.plan.TrainOptions`); nothing here is process-wide state.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jax_twell.ops import layout

__all__ = ["DenseCrossover", "TrainCrossover", "UNION_STEPS_CONSTANTS", "poisson_tail", "train_crossover_for"]


def poisson_tail(mean: float, k: int) -> float:
    """P(X > k) for X Poisson of ``mean`` (a Python float; the fraction of tokens with more
    than ``k`` active neurons where each token's count is Poisson at the layer's mean)."""
    if mean <= 0.0:
        return 0.0
    log_term, below = -mean, 0.0  # log P(X = 0)
    for i in range(k + 1):
        below += math.exp(log_term)
        log_term += math.log(mean) - math.log(i + 1)
    return min(1.0, max(0.0, 1.0 - below))


def _check_fraction(name: str, value) -> None:
    if value is not None and not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


@dataclasses.dataclass(frozen=True)
class DenseCrossover:
    """When the inference FFN runs the TwELL kernels, and when dense math through XLA.

    Every side shares the gate matmul; the rule prices what comes after, in seconds:

    - dense up + down: ``max(4 M d f / matmul_rate, 2 d f itemsize / hbm_bandwidth)``;
    - the row kernel: one row of Wu^T and one of Wd per active pair, plus fixed costs
      (:meth:`row_cost`);
    - the blocked kernel: weight slabs once per 1024-token block plus per-pair work
      (:meth:`blocked_cost`); with union products, each 64-token block's union rows
      (:meth:`union_cost`), or the down step on the stationary weight.

    - the warp path (one warp a token row, its overflow on the device backup): the pack,
      its kept entries, its backed-up rows' dense products and fixed costs
      (:meth:`warp_cost`, :meth:`warp_seconds`).

    A sparse side runs where its price is below ``margin`` times dense's. The decode
    fields say which decode-sized paths run (ffi/notes/decode.md).
    """

    pair_bandwidth: float = 3.3e12  # row kernel: bytes/s of the Wu^T and Wd rows it reads per pair
    row_full_tokens: int = 512  # tokens from which the row kernel reaches pair_bandwidth (scaled by M/this below)
    matmul_rate: float = 6.9e14  # XLA's dense up + down: FLOP/s
    hbm_bandwidth: float = 3.0e12  # bytes/s of the dense side's weight reads
    transpose_bandwidth: float = 1.4e12  # row kernel: bytes/s of an in-call transpose of w_up
    overflow_penalty: float = 2.0e-6  # row kernel: seconds per overflowed tile
    fixed_overhead: float = 1.0e-5  # row kernel: seconds every sparse call pays
    margin: float = 0.95  # sparse runs where predicted below this fraction of dense's time
    blocked_weight_bandwidth: float = 1.68e12  # blocked kernel: bytes/s of its per-block weight slabs
    blocked_pair_rate: float = 3.22e12  # blocked kernel: pair-columns/s of its up and down steps
    blocked_fixed_overhead: float = 3.2e-4  # blocked kernel: seconds of pack, layout and finish
    # blocked kernels: seconds per overflowed tile (its recompute from x and the [d, f] weights,
    # and its tile-wide entries): the union kernel took 17.35 ms at M=8,192 with 2% of the
    # tokens at 10-50% of f (~2,900 overflowed tiles; 0.70 ms on uniform rows), one H200,
    # benchmarks/results/patterns_extra_806b553.json
    blocked_overflow_penalty: float = 5.7e-6
    union_row_bandwidth: float = 5.39e12  # union products: bytes/s of the union rows of Wu^T and Wd
    union_fixed_overhead: float = 6.8e-5  # union products: fixed seconds after the gate
    union_transpose_bandwidth: float = 3.1e12  # union products: bytes/s of an in-call transpose of w_up
    union_min_tokens: int = 1024  # tokens below which the union products are priced as never winning
    stationary_down: bool = True  # "blocked_union" may run its down step on the weight stationary in shared memory
    stationary_up_bandwidth: float = 5.73e12  # stationary down: bytes/s of the up product's union rows of Wu^T
    stationary_pair_seconds: float = 3.05e-10  # stationary down: seconds per pair and wave of 16-column CTAs
    stationary_pair_seconds_8: float = 2.53e-10  # ... of 8-column CTAs (f > 7,264)
    stationary_token_seconds: float = 3.57e-9  # stationary down: seconds per token (layout, finish)
    stationary_fixed_overhead: float = 9.10e-5  # stationary down: fixed seconds after the gate
    stationary_transpose_bandwidth: float = 2.59e12  # stationary down: bytes/s of an in-call transpose of w_up
    stationary_sms: int = 132  # CTAs of one wave of the walk (one a SM)
    stationary_reference_fraction: float = 0.005  # active fraction the down steps are compared at when unknown
    # A call with nothing known of its layer runs dense below these: its per-call choice (XLA's
    # gate written out, the pack, the operand checks, a transposed w_up, one conditional)
    # costs more than sparsity saves there. H200, bf16, f=5632, 0.5% active, the default
    # call against XLA dense (benchmarks/results/patterns_extra_fe2aa08.json,
    # patterns_788f04d.json): d=2048: 0.96x at M=1, 0.91x at 64, 0.98x at 512, 0.87x at
    # 2,048 (0.82x with a tail), 1.22x at 16,384; d=512, f=1408, M=16,384: 0.74x, with
    # every sparse path below 1x there (0.90x at best). 8,192 leaves a margin below the
    # unmeasured crossover between 2,048 and 16,384.
    per_call_min_tokens: int = 8192
    # The same floor where the per-call choice holds no conditional: the sample's choice is
    # a device flag to the wgmma backup (ffi/twell_backup_gemm.cu), whose dense side is
    # the backup over every row, with the pack and the warp kernel skipped. None (the
    # default): no such form; the per-call choice is a lax.cond whose dense side runs on
    # cuBLAS. Setting it turns the form on where the bound backup takes the flag. Measured
    # on an H100 (ffi/notes/twell_backup.md): that dense side took 1.35x XLA's time on a
    # fully active call at M=8,192 (its grouped GEMMs at 1.7x cuBLAS's), so it stays off.
    per_call_min_tokens_no_conditional: int | None = None
    per_call_min_d: int = 1024
    # A layer whose fraction is known runs dense below this many tokens past the decode
    # sizes too: in a whole model its sparse path keeps the backup's conditional (a host
    # round trip) and meets real activations' tails. The 0.5b shape trained sparse
    # (0.12-0.40% active in the layers the rule priced sparse) prefilled one 2,048-token
    # sequence at 0.95x the dense models' tokens/s, and 8 x 2,048 at 1.03x
    # (benchmarks/results/bench_0.5b_51eb2d1.json).
    layer_min_tokens: int = 8192
    # The same floor where no conditional is left: the known layer's backup reads its row
    # count on the device (ffi/twell_backup.cu) and its up weight is kept transposed, as a
    # serving model keeps it. One layer at M=2,048, 0.5% active, against XLA's dense FFN in
    # the same process: 1.28x on uniform rows, 1.07x with 2% of the tokens at 10-50% of f
    # (lab/results/device_backup_ee16371.json, known_device_kept); without the transposed
    # copy 1.07x and 0.92x, so that form keeps layer_min_tokens.
    layer_min_tokens_no_conditional: int = 2048
    # The warp path of a known layer (ffi/twell_ffn_warp.cu, ffi/twell_backup.cu): its
    # kernel reads a d-row of Wu^T and one of Wd per kept entry at warp_entry_bandwidth
    # (H200, bf16, 0.5% active: 6.1 TB/s at M=2,048, 7.9 TB/s at 16,384); the rows past its
    # layout (more than WARP_ROW_BUDGET entries, or a tile past its capacity) go to the
    # device backup's tensor-core products at warp_backup_flops (every row backed up at
    # M=16,384: about 1.3e14; a few hundred rows about 0.9e14); warp_fixed_overhead: the
    # pack, the backup's list and launches and the pass for NaN (twell_backup.md).
    # The pack reads g ([M, f]) at warp_pack_bandwidth (XLA's gate plus the pack measured
    # within 2% of the fused gate, ~47 us over XLA's gate at M=16,384: lab/results/nocond_056f859.json).
    warp_entry_bandwidth: float = 6.0e12
    warp_backup_flops: float = 9.0e13
    # The same from layout.GEMM_BACKUP_MIN_TOKENS tokens, where the backup runs on wgmma
    # (ffi/twell_backup_gemm.cu). One H100, M=16,384, 2% of the tokens at 10-50% of f (319
    # rows): 71 us less than the mma.sync backup, ~1.6e14 with its launches; every row
    # backed up ~4.4e14 (ffi/notes/twell_backup.md).
    warp_backup_gemm_flops: float = 1.6e14
    warp_fixed_overhead: float = 2.0e-5
    warp_pack_bandwidth: float = 3.5e12
    count_sample_rows: int = 1024  # rows of g the per-call choice counts, at most
    count_sample_min_rows: int = 256  # ... and at least (else M / 8)
    decode_gather_max_tokens: int = 0  # tokens up to which xla.gather_ffn runs (0: off; measured slower)
    decode_active_per_token: float = 0.01  # gather_ffn's room per token, as a fraction of f
    decode_kernel_max_tokens: int = 0  # tokens up to which the decode kernels run unasked (0: off)
    decode_dense_above: float | None = None  # with the above, a device check runs dense past this active fraction
    decode_fused_gate: bool = True  # decode path: the gate matmul on our split-K kernel where it takes the shape
    decode_fused_gate_max_tokens: int = 32  # ... for calls of at most this many tokens
    decode_active_below: tuple[tuple[int, float], ...] = ((1, 0.025), (16, 0.015), (64, 0.004))  # (tokens, fraction): decode kernels win below
    decode_rows_max_tokens: int = 1  # tokens up to which the rows kernel runs given w_act_t
    decode_rows_unasked: bool = True  # ... with nothing known of the layer too (no fraction: exact at any density)

    def sample_rows(self, m: int) -> int:
        """Rows of g the per-call choice reads for ``m`` tokens: ``m // 8``, within
        ``[count_sample_min_rows, count_sample_rows]``."""
        return min(self.count_sample_rows, max(self.count_sample_min_rows, m // 8))

    def decode_wins(self, m: int, active_fraction: float) -> bool:
        """Static: True where the decode kernels beat dense for ``m`` tokens at this
        active fraction (:attr:`decode_active_below`)."""
        _check_fraction("active_fraction", active_fraction)
        if m <= 0:
            return False
        for tokens, bound in sorted(self.decode_active_below):
            if m <= tokens:
                return active_fraction < bound
        return False

    def decode_sized(self, m: int) -> bool:
        """Whether ``m`` tokens is a decode size (up to the last of :attr:`decode_active_below`)."""
        return 0 < m <= max((tokens for tokens, _ in self.decode_active_below), default=0)

    def dense_cost(self, m: int, d: int, f: int, itemsize: int) -> float:
        """Seconds of XLA's dense up + down for ``m`` tokens."""
        return max(4.0 * m * d * f / self.matmul_rate, 2.0 * d * f * itemsize / self.hbm_bandwidth)

    def sparse_fixed_cost(self, d: int, f: int, itemsize: int, transposed: bool) -> float:
        """Seconds every row-kernel call pays: ``fixed_overhead`` plus w_up's transpose
        where it is not given transposed."""
        transpose = 0.0 if transposed else 2.0 * d * f * itemsize / self.transpose_bandwidth
        return self.fixed_overhead + transpose

    def sparse_can_win(self, m: int, d: int, f: int, itemsize: int, transposed: bool = False) -> bool:
        """Static: False where even an all-zero activation would run faster dense."""
        return self.sparse_fixed_cost(d, f, itemsize, transposed) < self.margin * self.dense_cost(m, d, f, itemsize)

    def row_cost(self, nnz, n_overflow, d: int, f: int, itemsize: int, transposed: bool, m: int | None = None):
        """Seconds of the row kernel (device arrays or floats); with ``m``, its pair rate
        scaled down below :attr:`row_full_tokens`."""
        rate = self.pair_bandwidth * (1.0 if m is None else min(1.0, m / self.row_full_tokens))
        sparse = nnz * (2.0 * d * itemsize / rate) + n_overflow * self.overflow_penalty
        return sparse + self.sparse_fixed_cost(d, f, itemsize, transposed)

    def blocked_cost(self, nnz, m: int, d: int, f: int, itemsize: int):
        """Seconds of the blocked kernel: weight slabs once per block, plus per-pair work."""
        n_blocks = -(-m // layout.BLOCK_TOKENS)
        weights = n_blocks * 2.0 * d * f * itemsize / self.blocked_weight_bandwidth
        return weights + nnz * (2.0 * d / self.blocked_pair_rate) + self.blocked_fixed_overhead

    def union_row_bytes(self, m: int, d: int, f: int, itemsize: int, union):
        """Bytes of Wu^T and Wd rows the union products read for ``m`` tokens whose
        64-token blocks' mean union is ``union`` of f."""
        return -(-m // layout.UNION_TOKENS) * union * 2.0 * f * d * itemsize

    def stationary_runs(self, m: int, d: int, f: int) -> bool:
        """Static: whether "blocked_union" can run its down step with the weight stationary
        (:attr:`stationary_down`, and the shape at the default tile and capacity)."""
        return self.stationary_down and layout.stationary_down_supported(
            m, d, f, layout.blocked_max_entries(m, f, 256, 32))

    def down_stationary(self, m: int, d: int, f: int, itemsize: int, active_fraction: float | None = None,
                        transposed: bool = True) -> bool:
        """Static: True where "blocked_union" runs its down step with the weight stationary:
        where it can and its price is below the union product's at ``active_fraction``
        (uniform rows; None: :attr:`stationary_reference_fraction`)."""
        if not self.stationary_runs(m, d, f):
            return False
        p = self.stationary_reference_fraction if active_fraction is None else active_fraction
        nnz, union = p * m * f, layout.uniform_union(p)
        return (self._stationary_seconds(nnz, m, d, f, itemsize, union, transposed)
                <= self._union_model_seconds(nnz, m, d, f, itemsize, union, transposed))

    def union_cost(self, nnz, m: int, d: int, f: int, itemsize: int, union=None, transposed: bool = True,
                   active_fraction: float | None = None):
        """Seconds of "blocked_union": the union rows per 64-token block, fixed, the
        transpose where not ``transposed``; its down step priced as the one that runs
        (:meth:`down_stationary` at ``active_fraction``). ``union``: the blocks' measured
        mean union as a fraction of f, else the uniform pattern's at ``nnz / (M f)``."""
        if m < self.union_min_tokens:
            return nnz * 0.0 + math.inf  # a float or an array, as nnz
        if union is None:
            union = layout.uniform_union(nnz / float(max(1, m * f)))
        if self.down_stationary(m, d, f, itemsize, active_fraction, transposed):
            return self._stationary_seconds(nnz, m, d, f, itemsize, union, transposed)
        return self._union_model_seconds(nnz, m, d, f, itemsize, union, transposed)

    def _union_model_seconds(self, nnz, m: int, d: int, f: int, itemsize: int, union, transposed: bool):
        """Both steps as union products (their price does not depend on ``nnz``)."""
        del nnz
        transpose = 0.0 if transposed else 2.0 * d * f * itemsize / self.union_transpose_bandwidth
        return (self.union_row_bytes(m, d, f, itemsize, union) / self.union_row_bandwidth
                + self.union_fixed_overhead + transpose)

    def _stationary_seconds(self, nnz, m: int, d: int, f: int, itemsize: int, union, transposed: bool):
        cols = layout.walk_cols(f)
        waves = -(-d // (cols * self.stationary_sms))
        per_pair = self.stationary_pair_seconds if cols == 16 else self.stationary_pair_seconds_8
        transpose = 0.0 if transposed else 2.0 * d * f * itemsize / self.stationary_transpose_bandwidth
        return (0.5 * self.union_row_bytes(m, d, f, itemsize, union) / self.stationary_up_bandwidth
                + nnz * waves * per_pair + m * self.stationary_token_seconds + self.stationary_fixed_overhead
                + transpose)

    def kernel_cost(self, nnz, m: int, d: int, f: int, itemsize: int, union_products: bool, union=None,
                    transposed: bool = True, active_fraction: float | None = None, n_overflow=0.0):
        """The blocked kernel's price: :meth:`union_cost` with union products, else
        :meth:`blocked_cost`; plus :attr:`blocked_overflow_penalty` for each of
        ``n_overflow`` overflowed tiles (a device value, or a float)."""
        if union_products:
            cost = self.union_cost(nnz, m, d, f, itemsize, union, transposed, active_fraction)
        else:
            cost = self.blocked_cost(nnz, m, d, f, itemsize)
        return cost + n_overflow * self.blocked_overflow_penalty

    def sparse_predicted(self, m: int, d: int, f: int, itemsize: int, active_fraction: float,
                         transposed: bool = False, kernel: str = "row", union_fraction: float | None = None) -> bool:
        """Static: True where, at a known ``active_fraction`` (no overflow assumed), the row
        kernel, or for a blocked ``kernel`` (a :class:`jax_twell.ops.plan.Kernel` value) from
        ``BLOCKED_MIN_TOKENS`` tokens the cheaper of it and the row kernel, is predicted
        faster than dense up + down."""
        _check_fraction("active_fraction", active_fraction)
        _check_fraction("union_fraction", union_fraction)
        nnz = active_fraction * m * f
        cost = self.row_cost(nnz, 0.0, d, f, itemsize, transposed, m)  # Python floats: runs while tracing
        if kernel != "row" and m >= layout.BLOCKED_MIN_TOKENS:
            p = nnz / float(max(1, m * f))
            cost = min(cost, self.kernel_cost(nnz, m, d, f, itemsize, kernel == "blocked_union", union_fraction,
                                              transposed, p))
        return cost < self.margin * self.dense_cost(m, d, f, itemsize)

    def warp_cost(self, m: int, d: int, f: int, itemsize: int, active_fraction: float,
                  overflow_fraction: float | None = None, kept_fraction: float | None = None,
                  transposed: bool = True, gated: bool = True) -> float:
        """Seconds of the warp path past the gate for ``m`` tokens of a layer at
        ``active_fraction``: its kept entries, the backed-up rows' dense products and its
        fixed costs. ``overflow_fraction``: the measured fraction of tokens past the warp
        layout, ``kept_fraction``: of (token, neuron) pairs in the rows that fit it
        (``LayerInfo``; ``TransformerLM.calibrate_ffn`` measures both). Unmeasured: a
        Poisson count of active neurons a token at the layer's mean (:func:`poisson_tail`;
        real layers' tails exceed it) and the backed-up rows at the mean's density (an
        upper bound of the kept pairs). Not ``transposed``: w_up's transpose in the call;
        not ``gated``: the non-gated FFN (:meth:`warp_seconds`)."""
        for name, value in (("active_fraction", active_fraction), ("overflow_fraction", overflow_fraction),
                            ("kept_fraction", kept_fraction)):
            _check_fraction(name, value)
        if overflow_fraction is None:
            overflow_fraction = poisson_tail(active_fraction * f, layout.WARP_ROW_BUDGET)
        if kept_fraction is None:
            kept_fraction = active_fraction * (1.0 - overflow_fraction)
        return self.warp_seconds(kept_fraction * m * f, overflow_fraction * m, m, d, f, itemsize, transposed, gated)

    def warp_seconds(self, kept_entries, backed_rows, m: int, d: int, f: int, itemsize: int, transposed: bool = True,
                     gated: bool = True):
        """Seconds of the warp path past the gate for ``m`` tokens (floats, or device arrays
        for a per-call choice): the pack of g, ``kept_entries`` on its kernel,
        ``backed_rows`` on the device backup's products (at ``warp_backup_gemm_flops`` from
        ``layout.GEMM_BACKUP_MIN_TOKENS`` tokens, where the backup runs on wgmma, else
        ``warp_backup_flops``), its fixed costs, and w_up's transpose where not
        ``transposed``. Not ``gated``: the non-gated FFN, whose entries
        read a row of Wd only and whose backed-up rows do the down product only (half the
        gated one's, as its dense side past the gate: :meth:`dense_side_cost`)."""
        half = 1.0 if gated else 0.5
        backup_flops = self.warp_backup_gemm_flops if m >= layout.GEMM_BACKUP_MIN_TOKENS else self.warp_backup_flops
        return (m * f * itemsize / self.warp_pack_bandwidth
                + half * (kept_entries * (2.0 * d * itemsize / self.warp_entry_bandwidth)
                          + backed_rows * (4.0 * d * f / backup_flops)) + self.warp_fixed_overhead
                + (0.0 if transposed or not gated else 2.0 * d * f * itemsize / self.transpose_bandwidth))

    def dense_side_cost(self, m: int, d: int, f: int, itemsize: int, gated: bool = True) -> float:
        """Seconds of XLA's dense products past the gate: :meth:`dense_cost` (up + down) for
        the gated FFN, half of it (the down product) for the non-gated one."""
        return self.dense_cost(m, d, f, itemsize) * (1.0 if gated else 0.5)

    def warp_predicted(self, m: int, d: int, f: int, itemsize: int, active_fraction: float,
                       overflow_fraction: float | None = None, kept_fraction: float | None = None,
                       transposed: bool = True, gated: bool = True) -> bool:
        """Static: True where the warp path (:meth:`warp_cost`) is predicted below
        ``margin`` times the dense products past the gate (:meth:`dense_side_cost`) for a
        layer at ``active_fraction``."""
        cost = self.warp_cost(m, d, f, itemsize, active_fraction, overflow_fraction, kept_fraction, transposed, gated)
        return cost < self.margin * self.dense_side_cost(m, d, f, itemsize, gated)

    def blocked_preferred(self, m: int, d: int, f: int, itemsize: int, active_fraction: float,
                          transposed: bool = False, kernel: str = "blocked_union",
                          union_fraction: float | None = None) -> bool:
        """Static: True where, at a known ``active_fraction``, the blocked ``kernel`` is
        predicted faster than the row kernel for ``m`` tokens (at least ``BLOCKED_MIN_TOKENS``)."""
        _check_fraction("active_fraction", active_fraction)
        if kernel == "row" or m < layout.BLOCKED_MIN_TOKENS:
            return False
        nnz = active_fraction * m * f
        p = nnz / float(max(1, m * f))
        blocked = self.kernel_cost(nnz, m, d, f, itemsize, kernel == "blocked_union", union_fraction, transposed, p)
        return blocked < self.row_cost(nnz, 0.0, d, f, itemsize, transposed, m)

    def use_sparse(self, nnz, n_overflow, m: int, d: int, f: int, itemsize: int, transposed: bool = False) -> jax.Array:
        """``[]`` bool on device: True where the row kernel should run rather than dense."""
        sparse = self.row_cost(jnp.asarray(nnz).astype(jnp.float32), jnp.asarray(n_overflow).astype(jnp.float32),
                               d, f, itemsize, transposed, m)
        return sparse < self.margin * self.dense_cost(m, d, f, itemsize)


@dataclasses.dataclass(frozen=True)
class TrainCrossover:
    """When the training FFN runs the sparse kernels, and when XLA autodiff.

    Both sides share the forward gate matmul; the rule prices what follows, in seconds:
    dense, eight matmuls of ``M d f`` at ``matmul_rate``; sparse, the pack, the per-call
    transposes, per-pair work and the weight gradients' x/dy slices (slowed as x and dy
    outgrow L2), the union products' rows per 64-token block (the layer's measured union,
    else the uniform pattern's, the largest a density has), per-overflow and fixed costs.
    Sparse runs where its entries fit and its price is below ``margin`` times dense's.
    """

    matmul_rate: float = 7.397e14  # XLA's dense step past the gate: FLOP/s
    hbm_bandwidth: float = 3.0e12  # bytes/s of the pack's read of the M x f activation
    union_bandwidth: float = 2.28e13  # bytes/s of the union products' table rows
    transpose_bandwidth: float = 1.4e12  # bytes/s of the per-call weight transposes (5 d f elements)
    pair_rate: float = 2.167e13  # FMA/s of the up, down and backward steps (8 d per pair)
    grad_stream_bandwidth: float = 7.0e12  # bytes/s of the weight gradients' x/dy slices (2 d per pair)
    grad_stream_spill: float = 7.716e8  # bytes of x and dy at which those slices run at half speed
    overflow_penalty: float = 2.0e-6  # seconds per overflowed tile
    fixed_overhead: float = 0.2491e-3  # seconds every sparse step pays
    margin: float = 1.0  # sparse runs where predicted below this fraction of dense's time
    min_tokens: int = 256  # tokens below which the kernels are never traced
    # The dense backup of rows past the hybrid width (XLA's step over the gathered rows,
    # its g and u recomputed in the backward: 11 products of the dense step's 9, on few
    # rows) and its fixed cost (the bucket's switch, the row list, gathers and scatters).
    # Not fitted yet: set from the products' count and a small-product rate.
    backup_factor: float = 1.6
    backup_fixed: float = 40e-6

    def dense_cost(self, m: int, d: int, f: int) -> float:
        """Seconds of XLA's dense forward + backward past the gate matmul."""
        return 16.0 * m * d * f / self.matmul_rate

    def sparse_fixed_cost(self, m: int, d: int, f: int, itemsize: int) -> float:
        """Seconds the kernels' step pays whatever its entries: fixed, pack, transposes."""
        pack = m * f * itemsize / self.hbm_bandwidth
        return self.fixed_overhead + pack + 5.0 * d * f * itemsize / self.transpose_bandwidth

    def pair_cost(self, m: int, d: int, itemsize: int) -> float:
        """Seconds per active pair in a call of ``m`` tokens."""
        spill = 1.0 + 2.0 * m * d * itemsize / self.grad_stream_spill
        return 8.0 * d / self.pair_rate + 2.0 * d * itemsize / self.grad_stream_bandwidth * spill

    @staticmethod
    def uniform_union(active_fraction):
        """The uniform pattern's mean 64-token union at ``active_fraction`` (float or array)."""
        return layout.uniform_union(active_fraction)

    def union_bytes(self, m: int, d: int, f: int, itemsize: int, union_fraction) -> float:
        """Bytes of table rows the union products read for ``m`` tokens."""
        blocks = -(-m // layout.UNION_TOKENS)
        return blocks * union_fraction * f * 5.0 * d * itemsize

    def sparse_cost(self, nnz, n_overflow, m: int, d: int, f: int, itemsize: int, union=None) -> jax.Array:
        """``[]`` f32 seconds of the kernels for ``nnz`` active pairs and ``n_overflow``
        overflowed tiles (device values); ``union`` measured, else the uniform pattern's."""
        nnz = jnp.asarray(nnz).astype(jnp.float32)
        union = self.uniform_union(nnz / max(m * f, 1)) if union is None else jnp.asarray(union, jnp.float32)
        cost = self._estimate(nnz, union, m, d, f, itemsize)
        return cost + jnp.asarray(n_overflow).astype(jnp.float32) * self.overflow_penalty

    def _estimate(self, nnz, union, m: int, d: int, f: int, itemsize: int):
        return (nnz * self.pair_cost(m, d, itemsize) + self.sparse_fixed_cost(m, d, f, itemsize)
                + self.union_bytes(m, d, f, itemsize, union) / self.union_bandwidth)

    def prefers_sparse(self, m: int, d: int, f: int, itemsize: int, active_fraction: float,
                       union_fraction: float | None = None) -> bool:
        """Static: True where the kernels are predicted faster at a known ``active_fraction``
        and, where measured, mean 64-token union ``union_fraction`` (no overflow assumed)."""
        _check_fraction("active_fraction", active_fraction)
        _check_fraction("union_fraction", union_fraction)
        if not self.sparse_can_win(m, d, f, itemsize):
            return False
        union = self.uniform_union(active_fraction) if union_fraction is None else union_fraction
        # in Python floats: this runs while tracing, where jnp would stage it
        return self._estimate(active_fraction * m * f, union, m, d, f, itemsize) < self.margin * self.dense_cost(m, d, f)

    def sparse_can_win(self, m: int, d: int, f: int, itemsize: int) -> bool:
        """Static: False where the kernels should not even be traced (tiny M, fixed costs)."""
        if m < self.min_tokens:
            return False
        return self.sparse_fixed_cost(m, d, f, itemsize) < self.margin * self.dense_cost(m, d, f)

    def backup_cost(self, rows, m: int, d: int, f: int) -> jax.Array:
        """``[]`` f32 seconds of the dense backup over ``rows`` (a device value: the static
        bucket the call's rows past the width fill; 0 costs nothing) of ``m`` tokens."""
        rows = jnp.asarray(rows).astype(jnp.float32)
        return jnp.where(rows > 0, rows / max(m, 1) * self.backup_factor * self.dense_cost(m, d, f)
                         + self.backup_fixed, 0.0)

    def use_sparse(self, nnz, n_overflow, m: int, d: int, f: int, itemsize: int, backup_rows=0) -> jax.Array:
        """``[]`` bool on the device: True where the sparse kernels (and the dense backup
        over ``backup_rows`` rows) should run."""
        cost = self.sparse_cost(nnz, n_overflow, m, d, f, itemsize) + self.backup_cost(backup_rows, m, d, f)
        return cost < self.margin * self.dense_cost(m, d, f)


# The fit of the steps the stationary walks replace (the forward's down step and dx as union
# products): a call where the walks do not run is priced with these, as it was measured.
UNION_STEPS_CONSTANTS = dict(union_bandwidth=8.86e12, pair_rate=3.07e13, grad_stream_spill=7.24e8,
                             fixed_overhead=0.370e-3, matmul_rate=8.58e14)


def train_crossover_for(walks: bool, rule: TrainCrossover | None = None) -> TrainCrossover:
    """The training rule for a call: ``rule`` as given, else the default, with
    :data:`UNION_STEPS_CONSTANTS` where the stationary walks do not run."""
    if rule is not None:
        return rule
    return TrainCrossover() if walks else TrainCrossover(**UNION_STEPS_CONSTANTS)
