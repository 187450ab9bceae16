"""The CPU implementation of the inference FFN: the gate (XLA's matmul, or for a few bf16
tokens the kernel's own, packed to TwELL in the same pass), then the sparse up and down
products of cpu/twell_cpu.cc (registered by :mod:`jax_twell._cpu`).

Decoding a token with the dense formula reads every FFN weight once; with 0.5% of the
neurons active the up and down products need only the active neurons' rows (the gate stays
dense: a third of the bytes). Each call counts g's non-zero entries (on a sample of its
rows) and runs the kernel only where that count is small enough to win
(:data:`SPARSE_MAX_FRACTION`), else the dense up and down products from the same gate
product (``lax.cond``: a call pays one side). The dense products of bf16 operands are XLA's
with f32 results rounded once (:func:`dense_ffn`): XLA's bf16 matmul with a bf16 result is
3-6x slower on the CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_twell import _cpu
from jax_twell.formats import TwELL
from jax_twell.ops import xla
from jax_twell.ops.common import as_dense_nonfinite, as_varying, finite_columns, mesh_axes
from jax_twell.ops.ffn.warp import sample_row_indices

__all__ = ["DTYPES", "SPARSE_MAX_FRACTION", "UNION_MAX_TOKENS", "UNION_MAX_FRACTION", "COLUMNS_MAX_M", "COLUMNS_MAX_FRACTION", "GATE_MAX_M", "TWELL_TILE",
           "TWELL_CAPACITY", "WEIGHT_PASS_ENTRIES", "COUNT_SAMPLE_ROWS", "DENSE_GATE_MIN_M",
           "BF16_SPARSE_MAX_FRACTION", "sampled_nonzeros", "dense_ffn", "finite_columns_by_sums", "sparse_max_fraction", "gate", "gate_twell", "up_down",
           "up_down_twell", "sparse_ffn"]

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))  # what the kernel takes; f16 runs dense

# The largest fraction of g's entries (non-zero / (M f)) at which the kernel runs, by number
# of tokens: (up to M, fraction), first match. Measured (benchmarks/bench_cpu.py --sweep:
# d=2048, f=5632, f32, on a 2-core AMD EPYC (Zen 4) VM shared with other work): the kernel
# (gate included) against XLA's dense FFN was 1.1x at M=1 fully active; 1.6x at 5% and 0.8x
# at 25% for M=8; 1.03x at 5% for M=512. The bounds sit below those crossovers, so the
# kernel runs only where it is the faster side (M=1 at 50% active measured 0.9x in
# benchmarks/results/cpu_6c426aea.json: its bound is 25%).
SPARSE_MAX_FRACTION = ((1, 0.25), (16, 0.12), (128, 0.05), (None, 0.03))

# SPARSE_MAX_FRACTION's part for bf16 calls past GATE_MAX_M tokens, whose dense side runs its products
# with f32 results (dense_ffn: 3-4x XLA's bf16 FFN), before the weights' passes are taken
# off (WEIGHT_PASS_ENTRIES). Measured (lab/cpu_bf16_bounds.py, the kernel forced against
# that dense side, lab/results/cpu_bf16_bounds_0d2592c.json; two runs agreed within ~10%):
# with the caches kept the kernel took 0.53 / 0.66 / 1.00x the dense side's time at 0.5 / 1 /
# 2% active (M=512, d=2,048), 0.83 / 1.00 / 1.20x (d=512), 0.55 / 1.03 / 1.00x (M=2,048,
# d=512), 0.40x / 0.99-1.33x at M=64 (d=2,048 / 512, 0.5-2%); plain calls 0.83 / 1.01 / 1.30x
# (M=512, d=2,048), 0.64 / 0.96 / 1.13x (M=2,048, d=512). SPARSE_MAX_FRACTION's bounds (3-5%)
# had been measured against XLA's bf16-result products.
BF16_SPARSE_MAX_FRACTION = ((128, 0.008), (None, 0.015))

# Up to UNION_MAX_TOKENS tokens (kUnionMaxTokens in cpu/twell_cpu.cc) the kernel on g runs
# neuron by neuron: each weight row of the tokens' union is read once for all of them, so
# a call of a few dense tokens reads each weight once, as XLA's dense products do, where
# the token-by-token form read it once per token; its products are blocked over the tokens
# (a row chunk loaded once for up to 4 of them, their sums in registers). Measured (the
# same sweep, d=2048, f=5632, the kernel on g against XLA's up and down products,
# benchmarks/results/cpu_sweep_blocked_57cb07c.json): f32 2.9x / 1.9x / 1.7x / 1.6x at
# M=8 for 0.5% / 25% / 50% / 100% active, 2.8x / 1.7x / 1.6x / 1.4x at M=16 (before the
# blocking 0.99x and 0.81x fully active); bf16 1.8x and 1.6x fully active. So every call up
# to 16 tokens with the caches holds no count and no conditional. The TwELL path (bf16 up
# to GATE_MAX_M tokens) stays token by token, under SPARSE_MAX_FRACTION.
UNION_MAX_TOKENS = 16
UNION_MAX_FRACTION = ((16, 1.0),)

# Without a kept w_up.T ([f, d]) the kernel reads the active neurons' columns of w_up
# ([d, f]: d strided loads of a cache line each) up to this many tokens, and only up to
# COLUMNS_MAX_FRACTION active (a column costs 16 (f32) to 32 (bf16) times its bytes); above
# COLUMNS_MAX_M the call transposes w_up (a read and a write of the weight) and reads rows.
COLUMNS_MAX_M = 16
COLUMNS_MAX_FRACTION = 0.02

# bf16 gates by the kernel's own loop (jax_twell_cpu_gate: w read once) up to this many
# tokens; XLA's matmul above, and for f32. Measured (d=2048, f=5632, same VM): bf16 2.5 /
# 5.1 / 12 ms at M=1 / 8 / 16 against XLA's 27 / 29 / 36 ms; f32 3.0 / 6.7 ms against XLA's
# 2.2 / 5.7 ms (XLA's f32 matmul is the faster there).
GATE_MAX_M = 16

# The bf16 dense side's gate: the kernel's own loop (gate) below this many tokens, XLA's
# product with f32 results (_matmul) from it. d=2,048, f=5,632: 0.95 / 1.42 / 2.50 ms (the
# kernel) against 1.87 / 1.73 / 1.79 ms at M = 2 / 4 / 8; d=512, f=1,408: XLA's from M=2.
# At one token XLA's product is a slow matrix-vector path either way (12.7 against 0.72 ms).
DENSE_GATE_MIN_M = 6

# The TwELL those bf16 gates pack to (tile, capacity): 128 of 256 columns, so a tile
# overflows (and its gate is recomputed in the up and down kernel) only past 50% active,
# above every bound of SPARSE_MAX_FRACTION (with 64, tiles of 20%-active calls overflowed
# and the recomputes cost 5-7% there; lab/cpu_twell_ab.py).
TWELL_TILE = 256
TWELL_CAPACITY = 128

# What a call does to the weights beyond the kernel, priced in f32: without the weights'
# finite columns kept (weights_finite) it checks both weights for NaN and Inf (a pass over
# each), and without a kept w_up.T above COLUMNS_MAX_M tokens it transposes w_up (a read and
# a write). Each such pass over a [d, f] weight costs about what WEIGHT_PASS_ENTRIES * f
# active entries cost the kernel, so an f32 call's bound drops by passes * WEIGHT_PASS_ENTRIES
# / M (at or below zero it runs the dense FFN, :func:`dense_ffn`). Measured (bench_cpu.py,
# f32, d=2048, f=5632, same VM): the plain call's extra time was ~25 ms at M=128-512, the
# kernel's ~1.06 us an entry; the plain call lost at M=64 (0.83x at 0.5%) and M=128 at 2.5%
# (0.88x) with the bound alone. bf16 calls past GATE_MAX_M tokens pay it too: their dense
# side's products (_matmul) run at the f32 rate or faster, and a plain bf16 call of 64
# tokens on the kernel took 1.4-1.8x the dense side's time (d=512-2,048, 0.5-2% active).
# Up to GATE_MAX_M tokens the bf16 dense side's products are matrix-vector-like and slow
# in XLA (29 ms at one token, d=2,048), and the passes are not priced.
WEIGHT_PASS_ENTRIES = 1.05


# The per-call choice counts g's non-zero entries on M // 8 of its rows, at least
# COUNT_SAMPLE_ROWS[0] (all of them below) and at most COUNT_SAMPLE_ROWS[1]
# (:func:`sampled_nonzeros`). XLA's count over the whole of g ran at 1-7 GB/s on the CPU:
# 0.1 ms of a 0.85 ms dense FFN at M=512, d=128, f=352 and 1.8 ms of 15 ms at M=4,096,
# d=256, f=704 (f32), so a call that ended dense measured 0.85-0.90x of XLA's FFN there.
COUNT_SAMPLE_ROWS = (64, 256)


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a @ b`` with f32 sums rounded once to ``a.dtype``. XLA's CPU matmul of two bf16
    operands with a bf16 result ran 3-6x slower than the same product with an f32
    result rounded after it (d=128-2,048, f=352-5,632, M=64-512, two cores; jax 0.10.2),
    and rounded its sums more than once (0.1-0.8% of the elements a unit in the last place
    away); f32 operands are unchanged."""
    return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(a.dtype)


def dense_ffn(x: jax.Array, w_gate: jax.Array | None, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """The CPU's dense FFN: XLA's (:func:`jax_twell.ops.xla.ffn`) in f32, and in bf16 the
    same formula with :func:`_matmul`'s products (f32 sums rounded once), 3-4x faster there
    than XLA's bf16 FFN from 8 tokens on (d=512-2,048; ``lab/results/cpu_dense_side_ab_*.json``)."""
    if x.dtype != jnp.bfloat16:
        return xla.ffn(x, w_gate, w_up, w_down)
    return _dense_up_down(x, jax.nn.relu(_matmul(x, w_up if w_gate is None else w_gate)),
                          None if w_gate is None else w_up, w_down)


def _dense_up_down(x: jax.Array, g: jax.Array, w_up: jax.Array | None, w_down: jax.Array) -> jax.Array:
    """``(g * (x @ w_up)) @ w_down`` (``g @ w_down`` where ``w_up`` is None) by :func:`_matmul`."""
    return _matmul(g if w_up is None else g * _matmul(x, w_up), w_down)


def sampled_nonzeros(g: jax.Array) -> jax.Array:
    """``[]`` float32: the non-zero entries of ``g = relu(x @ w)`` ``[M, f]`` estimated
    from :data:`COUNT_SAMPLE_ROWS` of its rows (``warp.sample_row_indices``: one in each
    of equal blocks, at hashed offsets), scaled to M; exact where they are all of g's rows.
    Summed as ``sign(g)`` (1 where g > 0, 0 at zero; g has no negative entry): twice as
    fast as a count of ``g != 0`` on the CPU. A NaN in the sample makes the estimate NaN,
    which no bound admits (the dense side: exact either way). Only how fast: both sides
    are exact."""
    m = g.shape[0]
    lo, hi = COUNT_SAMPLE_ROWS
    rows = min(m, max(lo, min(hi, m // 8)))
    sample = g if rows >= m else jnp.take(g, jnp.asarray(sample_row_indices(m, rows)), axis=0)
    return jnp.sum(jnp.sign(sample), dtype=jnp.float32) * np.float32(m / max(rows, 1))


def finite_columns_by_sums(w_up: jax.Array | None, w_down: jax.Array) -> jax.Array:
    """:func:`~jax_twell.ops.common.finite_columns` of the up and down weights, read at
    the speed of a sum: the f32 sums of each column of ``w_down`` (and of all of ``w_up``)
    are finite where every term is, and a NaN or Inf term makes them NaN or Inf whatever
    the order. A sum of finite terms can still overflow, so where any sum is not finite
    the exact check decides (``lax.cond``: only such weights pay for it). On the CPU the
    elementwise check of two bf16 weights (d=2048, f=5632) took 14 ms, the sums 2.6 ms."""
    sums = jnp.sum(w_down, axis=0, dtype=jnp.float32)
    if w_up is not None:
        sums = sums + jnp.sum(w_up, dtype=jnp.float32)
    axes = mesh_axes(w_up, w_down)  # both sides typed alike under shard_map
    return jax.lax.cond(jnp.isfinite(sums).all(), lambda: as_varying(jnp.ones(sums.shape, bool), axes),
                        lambda: as_varying(finite_columns(w_up, w_down), axes))


def sparse_max_fraction(m: int, union: bool = False, bf16: bool = False) -> float:
    """The largest active fraction of g at which ``m`` tokens run the kernel (see
    :data:`SPARSE_MAX_FRACTION`; ``union``: the kernel on g, which runs neuron by neuron up
    to :data:`UNION_MAX_TOKENS` tokens, :data:`UNION_MAX_FRACTION`; ``bf16``: a bf16 call
    past :data:`GATE_MAX_M` tokens, :data:`BF16_SPARSE_MAX_FRACTION`). 1.0: at every density."""
    if bf16 and m > GATE_MAX_M:
        table = BF16_SPARSE_MAX_FRACTION
    else:
        table = UNION_MAX_FRACTION if union and m <= UNION_MAX_TOKENS else SPARSE_MAX_FRACTION
    for upto, fraction in table:
        if upto is None or m <= upto:
            return fraction
    return SPARSE_MAX_FRACTION[-1][1]  # past UNION_MAX_FRACTION's last bound: unreachable


def gate(x: jax.Array, w: jax.Array) -> jax.Array:
    """The kernel's gate ``relu(x @ w)`` ``[M, f]`` for ``x [M, d]``, ``w [d, f]`` (f32 or
    bf16): f32 sums rounded to the dtype, as :func:`jax_twell.formats.relu_matmul` (the sums
    run in another order: an element may differ in its last bit). Reads w once; for few
    tokens (:data:`GATE_MAX_M`)."""
    return _cpu.cpu_kernel_call("jax_twell_cpu_gate", jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype))(x, w)


def gate_twell(x: jax.Array, w: jax.Array, *, tile: int = TWELL_TILE, capacity: int = TWELL_CAPACITY) -> TwELL:
    """The kernel's gate packed to TwELL in one pass: ``relu(x @ w)`` for ``x [M, d]``,
    ``w [d, f]`` (f32 or bf16), each (token, tile) keeping its first ``capacity``
    non-zeros (NaN included) in column order and its true count; the ``[M, f]``
    activation is never written. The values are :func:`gate`'s (f32 sums rounded to the
    dtype), so the result is ``pack_twell_reference(relu_matmul(x, w))`` up to the last
    bit of an element. Reads w once; for few tokens (:data:`GATE_MAX_M`)."""
    m, f = x.shape[0], w.shape[1]
    n_tiles = -(-f // tile)
    out = (jax.ShapeDtypeStruct((m, n_tiles, capacity), x.dtype), jax.ShapeDtypeStruct((m, n_tiles, capacity), jnp.int16),
           jax.ShapeDtypeStruct((m, n_tiles), jnp.int32))
    values, cols, counts = _cpu.cpu_kernel_call("jax_twell_cpu_gate_twell", out)(
        x, w, tile=np.int32(tile), capacity=np.int32(capacity))
    return TwELL(values, cols, counts, f=f, tile=tile)


def up_down_twell(x: jax.Array, act: TwELL, w_act: jax.Array, w_up: jax.Array | None, w_down: jax.Array, *,
                  w_up_t: jax.Array | None = None) -> jax.Array:
    """:func:`up_down` from the gate as TwELL (``act``, of ``relu(x @ w_act)``): each token
    reads its tiles' stored entries; a tile past capacity is recomputed in the kernel from
    x and ``w_act`` ``[d, f]`` (so no entry is lost). Rounding and NaN as :func:`up_down`;
    the result is :func:`jax_twell.ops.ffn.reference.twell_ffn`'s up to the last bit of an
    element. x: ``[M, d]`` f32 or bf16; ``w_up`` None: non-gated. Returns y ``[M, d]``."""
    m, d = x.shape
    gated = w_up is not None
    rows = gated and w_up_t is not None
    w_up_k = (w_up_t if rows else w_up) if gated else w_down  # non-gated: any [f, d], unread
    return _cpu.cpu_kernel_call("jax_twell_cpu_up_down_twell", jax.ShapeDtypeStruct((m, d), x.dtype))(
        x, act.values, act.cols, act.counts, w_act, w_up_k, w_down, tile=np.int32(act.tile),
        up_transposed=np.int32(rows), gated=np.int32(gated))


def up_down(x: jax.Array, g: jax.Array, w_up: jax.Array | None, w_down: jax.Array, *,
            w_up_t: jax.Array | None = None) -> jax.Array:
    """The kernel: ``(g * (x @ w_up)) @ w_down`` (gated) or ``g @ w_down`` (``w_up`` None)
    over the non-zero entries of ``g`` only (NaN counts as non-zero).

    Rounding as :func:`jax_twell.ops.ffn.reference.twell_ffn`: u in f32 sums rounded to the
    dtype, h = g * u in the dtype, y in f32 sums rounded once. NaN and Inf that only the
    skipped (zero) entries' products would carry are not in y (see :func:`sparse_ffn`).

    Args:
      x: ``[M, d]`` f32 or bf16.  g: ``[M, f]`` (``relu(x @ w_act)``).  w_up: ``[d, f]``
      or None (non-gated).  w_down: ``[f, d]``.  w_up_t: optional ``w_up.T`` ``[f, d]``: the
      kernel then reads contiguous rows instead of strided columns of w_up.
    Returns:
      y: ``[M, d]`` x's dtype.
    """
    m, d = x.shape
    out = jax.ShapeDtypeStruct((m, d), x.dtype)
    if w_up is None:
        return _cpu.cpu_kernel_call("jax_twell_cpu_down", out)(g, w_down)
    rows = w_up_t is not None
    return _cpu.cpu_kernel_call("jax_twell_cpu_up_down", out)(
        x, g, w_up_t if rows else w_up, w_down, up_transposed=np.int32(rows))


def sparse_ffn(x, w_gate, w_up, w_down, *, w_up_t=None, weights_finite=None) -> jax.Array:
    """Inference FFN ``y [M, d]`` for ``x [M, d]`` on the CPU kernel where sparsity pays.

    ``g = relu(x @ w_act)`` (XLA's matmul, or :func:`gate`); if g's non-zero count (on a
    sample of rows, :func:`sampled_nonzeros`) is at most :func:`sparse_max_fraction` of its
    entries, :func:`up_down` runs on it, else the dense up and down products (:func:`dense_ffn`'s
    rounding); where that bound is 1 (f32 calls of up to 4 tokens with the caches kept) the
    kernel runs with no count and no conditional. The kernel's y gets the dense
    formula's NaN by :func:`~jax_twell.ops.common.as_dense_nonfinite` with
    ``weights_finite`` (the ``[d]`` bool :func:`~jax_twell.ops.common.finite_columns` of
    the up and down weights, where the caller keeps it) or, without it, a check of both
    weights in the call: a full read of them, which at decode sizes costs about what the
    kernel saves (the module keeps it: :meth:`jax_twell.modules.SparseFFN.cache_transposed_up_weight`).

    ``w_up_t``: optional ``w_up.T`` (gated). Without it, up to :data:`COLUMNS_MAX_M` tokens
    read w_up's columns (up to :data:`COLUMNS_MAX_FRACTION` active), more transpose it in the
    call (on the sparse side only). In f32, and in bf16 past :data:`GATE_MAX_M` tokens, each
    pass over a weight that the call makes itself (the check, the transpose) lowers the
    bound (:data:`WEIGHT_PASS_ENTRIES`): a plain f32 call of few tokens runs XLA's dense FFN.
    bf16 calls of up to :data:`GATE_MAX_M` tokens pack the gate to TwELL in its own pass
    (:func:`gate_twell`; g is never written) and run :func:`up_down_twell` on it (their
    dense side computes g again, :data:`DENSE_GATE_MIN_M`); others take XLA's gate product
    and :func:`up_down`. f16 (not a kernel dtype) runs XLA's dense FFN.
    """
    gated = w_gate is not None
    w_act = w_gate if gated else w_up
    w_up_k = w_up if gated else None
    m, d = x.shape
    f = w_act.shape[1]
    if m == 0 or x.dtype not in DTYPES:
        return xla.ffn(x, w_gate, w_up, w_down)
    columns_layout = gated and w_up_t is None and m <= COLUMNS_MAX_M
    twell = x.dtype == jnp.bfloat16 and m <= GATE_MAX_M  # our gate, packed in its pass
    fraction = sparse_max_fraction(m, union=not twell, bf16=x.dtype == jnp.bfloat16)
    if columns_layout:
        fraction = min(fraction, COLUMNS_MAX_FRACTION)
    if x.dtype == jnp.float32 or not twell:  # bf16 past GATE_MAX_M: products at the f32 rate or faster
        passes = 2 * (weights_finite is None) + 2 * (gated and w_up_t is None and not columns_layout)
        fraction -= passes * WEIGHT_PASS_ENTRIES / m
        if fraction <= 0:  # the passes cost more than the kernel could save
            return dense_ffn(x, w_gate, w_up, w_down)
    if twell:
        act = gate_twell(x, w_act)
        nnz = jnp.sum(act.counts, dtype=jnp.float32)
    else:
        g = jax.nn.relu(_matmul(x, w_act))
        nnz = sampled_nonzeros(g)
    few = nnz <= np.float32(fraction * m * f)

    def sparse():
        up_t = w_up_t
        if gated and up_t is None and not columns_layout:
            up_t = w_up.T
        if twell:
            y = up_down_twell(x, act, w_act, w_up_k, w_down, w_up_t=up_t)
        else:
            y = up_down(x, g, w_up_k, w_down, w_up_t=up_t)
        columns = finite_columns_by_sums(w_up_k, w_down) if weights_finite is None else weights_finite
        return as_dense_nonfinite(y, x, columns)

    def dense():  # the TwELL side wrote no g: the gate again (the kernel's below DENSE_GATE_MIN_M tokens)
        if twell:
            return _dense_up_down(x, jax.nn.relu(_matmul(x, w_act)) if m >= DENSE_GATE_MIN_M else gate(x, w_act),
                                  w_up_k, w_down)
        return _dense_up_down(x, g, w_up_k, w_down)

    if fraction >= 1.0:  # the kernel is the faster side at every density: no conditional
        return sparse()
    return jax.lax.cond(few, sparse, dense)
