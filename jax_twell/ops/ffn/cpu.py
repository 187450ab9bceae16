"""The CPU implementation of the inference FFN: XLA's gate matmul, then the sparse up and
down products of cpu/twell_cpu.cc (registered by :mod:`jax_twell._cpu`).

Decoding a token with the dense formula reads every FFN weight once; with 0.5% of the
neurons active the up and down products need only the active neurons' rows (the gate stays
dense: a third of the bytes). Each call counts g's non-zero entries on the device and runs
the kernel only where that count is small enough to win (:data:`SPARSE_MAX_FRACTION`), else
XLA's dense up and down products from the same g (``lax.cond``: a call pays one side).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_twell import _cpu
from jax_twell.formats import relu_matmul
from jax_twell.ops import xla
from jax_twell.ops.common import as_dense_nonfinite, finite_columns

__all__ = ["DTYPES", "SPARSE_MAX_FRACTION", "COLUMNS_MAX_M", "COLUMNS_MAX_FRACTION", "GATE_MAX_M",
           "UNCHECKED_DENSE_BELOW_M", "sparse_max_fraction", "gate", "up_down", "sparse_ffn"]

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))  # what the kernel takes; f16 runs dense

# The largest fraction of g's entries (non-zero / (M f)) at which the kernel runs, by number
# of tokens: (up to M, fraction), first match. Measured (benchmarks/bench_cpu.py --sweep:
# d=2048, f=5632, f32, on a 2-core AMD EPYC (Zen 4) VM shared with other work): the kernel
# (gate included) against XLA's dense FFN was 1.1x at M=1 fully active; 1.6x at 5% and 0.8x
# at 25% for M=8; 1.03x at 5% for M=512. The bounds sit below those crossovers, so the
# kernel runs only where it is the faster side (M=1 at 50% active measured 0.9x in
# benchmarks/results/cpu_6c426aea.json: its bound is 25%).
SPARSE_MAX_FRACTION = ((1, 0.25), (16, 0.12), (128, 0.05), (None, 0.03))

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

# Without the weights' finite columns kept (weights_finite), the call checks both weights for
# NaN and Inf: a full read of them, about what the kernel saves below this many tokens, where
# such calls run XLA's dense FFN instead (never slower than it).
UNCHECKED_DENSE_BELOW_M = 64


def sparse_max_fraction(m: int) -> float:
    """The largest active fraction of g at which ``m`` tokens run the kernel (see
    :data:`SPARSE_MAX_FRACTION`)."""
    for upto, fraction in SPARSE_MAX_FRACTION:
        if upto is None or m <= upto:
            return fraction
    raise AssertionError("SPARSE_MAX_FRACTION ends with an open bound")


def gate(x: jax.Array, w: jax.Array) -> jax.Array:
    """The kernel's gate ``relu(x @ w)`` ``[M, f]`` for ``x [M, d]``, ``w [d, f]`` (f32 or
    bf16): f32 sums rounded to the dtype, as :func:`jax_twell.formats.relu_matmul` (the sums
    run in another order: an element may differ in its last bit). Reads w once; for few
    tokens (:data:`GATE_MAX_M`)."""
    return _cpu.cpu_kernel_call("jax_twell_cpu_gate", jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype))(x, w)


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

    ``g = relu(x @ w_act)`` (XLA's matmul, or :func:`gate`); if g's non-zero count is at most
    :func:`sparse_max_fraction` of its entries, :func:`up_down` runs on it, else XLA's dense
    up and down products (:func:`jax_twell.ops.xla.up_down`). The kernel's y gets the dense
    formula's NaN by :func:`~jax_twell.ops.common.as_dense_nonfinite` with
    ``weights_finite`` (the ``[d]`` bool :func:`~jax_twell.ops.common.finite_columns` of
    the up and down weights, where the caller keeps it) or, without it, a check of both
    weights in the call: a full read of them, which at decode sizes costs about what the
    kernel saves (the module keeps it: :meth:`jax_twell.modules.SparseFFN.cache_transposed_up_weight`).

    ``w_up_t``: optional ``w_up.T`` (gated). Without it, up to :data:`COLUMNS_MAX_M` tokens
    read w_up's columns (up to :data:`COLUMNS_MAX_FRACTION` active), more transpose it in the
    call (on the sparse side only). Without ``weights_finite``, calls of fewer than
    :data:`UNCHECKED_DENSE_BELOW_M` tokens run XLA's dense FFN (the check would cost what
    the kernel saves). bf16 gates of up to :data:`GATE_MAX_M` tokens are :func:`gate`,
    others XLA's matmul. f16 (not a kernel dtype) runs XLA's dense FFN.
    """
    gated = w_gate is not None
    w_act = w_gate if gated else w_up
    w_up_k = w_up if gated else None
    m, d = x.shape
    f = w_act.shape[1]
    if m == 0 or x.dtype not in DTYPES or (weights_finite is None and m < UNCHECKED_DENSE_BELOW_M):
        return xla.ffn(x, w_gate, w_up, w_down)
    g = gate(x, w_act) if x.dtype == jnp.bfloat16 and m <= GATE_MAX_M else relu_matmul(x, w_act)
    columns_layout = gated and w_up_t is None and m <= COLUMNS_MAX_M
    fraction = min(sparse_max_fraction(m), COLUMNS_MAX_FRACTION) if columns_layout else sparse_max_fraction(m)
    # Counted as an f32 sum: XLA's integer count over g ran at a fraction of the memory's
    # speed on the CPU (5% of a dense call at M=512, f32); every partial sum is an integer,
    # exact up to 2**24, and beyond that off by far less than the bound's own margin.
    few = jnp.sum(g != 0, dtype=jnp.float32) <= np.float32(fraction * m * f)

    def sparse():
        up_t = w_up_t
        if gated and up_t is None and not columns_layout:
            up_t = w_up.T
        y = up_down(x, g, w_up_k, w_down, w_up_t=up_t)
        columns = finite_columns(w_up_k, w_down) if weights_finite is None else weights_finite
        return as_dense_nonfinite(y, x, columns)

    return jax.lax.cond(few, sparse, lambda: xla.up_down(x, g, w_up_k, w_down))
