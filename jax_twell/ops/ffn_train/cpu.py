"""The CPU implementation of the training op: XLA's gate matmul, then the forward's up and
down products and the whole backward over the active entries only (cpu/twell_cpu.cc).

Forward: ``g = relu(x @ w_act)`` (XLA), then ``jax_twell_cpu_up_down_train``: y from each
token's active neurons' rows of ``w_up.T`` and ``w_down``, and u at those entries (a
residual). Backward: ``jax_twell_cpu_backward`` visits the same entries: ``dh = dy .
w_down[n] + c sign(h)`` (c: the L1 term's cotangent over M), dx from the active neurons'
rows of ``w_act.T`` and ``w_up.T``, and the three weight gradients' rows of the active
neurons. Gradients are those of :mod:`jax_twell.ops.ffn_train.reference` (f32 sums).

Each call counts g's non-zero entries and runs the kernels only up to
:func:`train_max_fraction` of them (by M and the layer's size: small calls and layers
never do), and only where x and the weights are finite (and, in
the backward, dy and the L1 cotangent): otherwise XLA's dense forward and its autodiff
(``lax.cond``), so a dense layer costs what XLA's step costs, plus the count.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_twell import _cpu
from jax_twell.formats import relu_matmul
from jax_twell.ops import xla
from jax_twell.ops.common import all_finite, as_varying, mesh_axes, sum_over_shards
from jax_twell.ops.ffn.cpu import DTYPES, up_down
from jax_twell.ops.plan import LayerInfo, Side

__all__ = ["TRAIN_MAX_FRACTION", "TRAIN_FIXED_TOKENS", "TRAIN_MIN_TOKENS", "TRAIN_MIN_WEIGHT", "train_max_fraction", "forward", "backward", "ffn_with_aux"]

# The largest fraction of g's entries (non-zero / (M f)) at which a step runs the kernels is
# TRAIN_MAX_FRACTION less TRAIN_FIXED_TOKENS / M: the kernel side's fixed costs (the weights
# transposed for the kernels, the three weight gradients zeroed, written in f32 and
# transposed back) are about as many passes over the weights as the dense step's matmuls
# cost for that many tokens. Calls of fewer than TRAIN_MIN_TOKENS tokens, or layers of
# fewer than TRAIN_MIN_WEIGHT weights (d f), are XLA's own step, with no count and no
# branch: there the per-call choice costs more than the kernels save (XLA's CPU runtime runs
# a conditional's branches slower than the same ops unbranched: the dense side measured
# 0.68x of XLA's step at d=128, f=352, M=4,096, and 0.87-0.92x at d=2048, f=5632, M=128).
# Measured (value_and_grad of a step, d=2048, f=5632, on the 2-core VM of
# jax_twell.ops.ffn.cpu; ratio to XLA's step): M=512 f32 2.09x at 0.5%, 1.36x at 2%, the
# dense side at 5% 0.98x; bf16 2.38x, 1.74x, 0.96x.
TRAIN_MAX_FRACTION = 0.03
TRAIN_FIXED_TOKENS = 3.1
TRAIN_MIN_TOKENS = 512
TRAIN_MIN_WEIGHT = 1 << 22


def train_max_fraction(m: int, d: int, f: int) -> float:
    """The largest active fraction of g at which ``m`` tokens through a ``[d, f]`` layer
    run the kernels (at or below zero: never; see :data:`TRAIN_MAX_FRACTION`)."""
    if m < TRAIN_MIN_TOKENS or d * f < TRAIN_MIN_WEIGHT:
        return 0.0
    return TRAIN_MAX_FRACTION - TRAIN_FIXED_TOKENS / m


def forward(x, g, w_up_t, w_down):
    """``jax_twell_cpu_up_down_train``: ``(y [M, d], u [M, f])`` for the gated FFN (u at
    the active entries of g, rounded to the dtype; zero elsewhere)."""
    m, d = x.shape
    f = g.shape[1]
    out = (jax.ShapeDtypeStruct((m, d), x.dtype), jax.ShapeDtypeStruct((m, f), x.dtype))
    return _cpu.cpu_kernel_call("jax_twell_cpu_up_down_train", out)(x, g, w_up_t, w_down)


def backward(x, g, u, dy, w_up_t, w_act_t, w_down, c):
    """``jax_twell_cpu_backward``: ``(dx [M, d], dw_act_t, dw_up_t, dw_down [f, d] f32)``.
    Non-gated: ``u`` and ``w_up_t`` None (dw_up_t comes back zero)."""
    m, d = x.shape
    f = g.shape[1]
    gated = u is not None
    out = (jax.ShapeDtypeStruct((m, d), x.dtype),) + tuple(jax.ShapeDtypeStruct((f, d), jnp.float32) for _ in range(3))
    u = u if gated else g
    w_up_t = w_up_t if gated else w_act_t
    c = jnp.asarray(c, jnp.float32).reshape(1)
    return _cpu.cpu_kernel_call("jax_twell_cpu_backward", out)(
        x, g, u, dy.astype(x.dtype), w_up_t, w_act_t, w_down, c, gated=np.int32(gated))


def _placeholder(like, axes):
    return as_varying(jnp.zeros(like.shape, like.dtype), axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _train(x, w_gate, w_up, w_down, forced):
    out, _ = _train_fwd(x, w_gate, w_up, w_down, forced)
    return out


def _train_fwd(x, w_gate, w_up, w_down, forced):
    gated = w_gate is not None
    w_act = w_gate if gated else w_up
    m, f = x.shape[0], w_act.shape[1]
    g = relu_matmul(x, w_act)
    active = g != 0
    counts, fired = active.sum(axis=-1, dtype=jnp.int32), active.any(axis=0)
    few = forced or jnp.sum(active, dtype=jnp.float32) <= np.float32(train_max_fraction(m, x.shape[1], f) * m * f)
    finite = _finite_by_sums(x, w_gate, w_up, w_down)
    use = few & finite
    axes = mesh_axes(x, w_gate, w_up, w_down)

    def sparse():
        if gated:
            y, u = forward(x, g, w_up.T, w_down)
            h = g * u
        else:
            y, u, h = up_down(x, g, None, w_down), _placeholder(g, axes), g
        return as_varying((y, _l1(h, m), u), axes)

    def dense():  # the dense formula from the same g; u kept for the backward
        u = jnp.matmul(x, w_up) if gated else _placeholder(g, axes)
        h = g * u if gated else g
        return as_varying((jnp.matmul(h, w_down), _l1(h, m), u), axes)

    y, l1, u = jax.lax.cond(use, sparse, dense)
    return (y, l1, counts, fired), (x, w_gate, w_up, w_down, g, u, use, finite)


def _finite_by_sums(*arrays):
    """``[]`` bool: the f32 sum of every element of ``arrays`` (None skipped) is finite,
    which a NaN or Inf anywhere prevents. Finite operands whose sums overflow read as not
    finite, which only sends the step to the dense side (exact either way); on the CPU the
    sums cost a fifth of an elementwise check."""
    total = jnp.zeros((), jnp.float32)
    for a in arrays:
        if a is not None and a.size:
            total = total + jnp.sum(a, dtype=jnp.float32)
    return jnp.isfinite(total)


def _l1(h, m: int):
    return jnp.abs(h.astype(jnp.float32)).sum() / max(m, 1)


def _dense_backward(x, w_gate, w_up, w_down, g, u, dy, dl1):
    """The dense formula's gradients from the forward's g and u (XLA's matmuls in the
    operands' dtype, as its autodiff of :func:`jax_twell.ops.xla.ffn_with_aux` runs them;
    nothing recomputed)."""
    gated = w_gate is not None
    w_act = w_gate if gated else w_up
    m = x.shape[0]
    dt = x.dtype
    h = g * u if gated else g
    dy = dy.astype(dt)
    dh = jnp.matmul(dy, w_down.T) + ((dl1 / max(m, 1)) * jnp.sign(h.astype(jnp.float32))).astype(dt)
    dw_down = jnp.matmul(h.T, dy)
    d_pre = jnp.where(g > 0, dh * u if gated else dh, jnp.zeros((), dt))
    dx = jnp.matmul(d_pre, w_act.T)
    dw_act = jnp.matmul(x.T, d_pre)
    if not gated:
        return dx, None, dw_act, dw_down
    du = dh * g
    return dx + jnp.matmul(du, w_up.T), dw_act, jnp.matmul(x.T, du), dw_down


def _train_bwd(forced, res, cotangents):
    x, w_gate, w_up, w_down, g, u, use, finite = res
    dy, dl1, _, _ = cotangents
    dl1 = dl1.astype(jnp.float32)
    ok = all_finite(dy, dl1)
    gated = w_gate is not None
    w_act = w_gate if gated else w_up
    m = x.shape[0]
    primals = (x, w_gate, w_up, w_down)

    def sparse():
        dx, dwa_t, dwu_t, dwd = backward(x, g, u if gated else None, dy, w_up.T if gated else None, w_act.T, w_down,
                                         dl1 / max(m, 1))
        if gated:
            grads = (dx, dwa_t.T.astype(w_gate.dtype), dwu_t.T.astype(w_up.dtype), dwd.astype(w_down.dtype))
        else:
            grads = (dx, None, dwa_t.T.astype(w_up.dtype), dwd.astype(w_down.dtype))
        return tuple(sum_over_shards(gr, p) for gr, p in zip(grads, primals))

    def dense():
        grads = _dense_backward(x, w_gate, w_up, w_down, g, u, dy, dl1)
        return tuple(sum_over_shards(gr, p) for gr, p in zip(grads, primals))

    def autodiff():  # a NaN or Inf anywhere: XLA's autodiff of the dense formula, as the reference
        return xla.ffn_with_aux_vjp(x, w_gate, w_up, w_down, dy, dl1)

    which = jnp.where(~(finite & ok), 2, jnp.where(use, 0, 1)).astype(jnp.int32)
    return jax.lax.switch(which, [sparse, dense, autodiff])


_train.defvjp(_train_fwd, _train_bwd)


def ffn_with_aux(x, w_gate, w_up, w_down, *, layer: LayerInfo = LayerInfo()):
    """Training FFN on the CPU kernels where g is sparse enough, else XLA's dense step.

    ``layer.side``: SPARSE runs the kernels whatever the count (finite operands only),
    DENSE XLA's step; AUTO (default) decides per call as above.

    x: ``[M, d]`` f32 or bf16 (other dtypes, M = 0 and calls too small for the kernels'
    fixed costs, :func:`train_max_fraction`, run :func:`jax_twell.ops.xla.ffn_with_aux`
    unless ``layer.side`` forces them).
    Returns ``(y [M, d], l1 [], counts [M] int32, fired [f] bool)`` like
    :func:`jax_twell.ops.xla.ffn_with_aux`; differentiable in x and the weights (custom_vjp),
    with the gradients of the dense formula plus the L1 term's.
    """
    forced = layer.side == Side.SPARSE
    f = (w_gate if w_gate is not None else w_up).shape[1]
    if x.shape[0] == 0 or x.dtype not in DTYPES or layer.side == Side.DENSE or \
            (not forced and train_max_fraction(x.shape[0], x.shape[1], f) <= 0):
        return xla.ffn_with_aux(x, w_gate, w_up, w_down)
    return _train(x, w_gate, w_up, w_down, forced)
