"""Dense implementations through XLA: the baseline every kernel is measured against, and
the path the ops take where sparsity would not pay (no kernels, CPU, dense activations)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_twell.ops.stats import hidden_stats

__all__ = ["ffn", "ffn_unmerged", "dense_side", "UNMERGED_MAX_TOKENS", "ffn_with_aux", "ffn_with_aux_vjp", "backup_forward", "backup_vjp", "up_down", "gather_ffn", "gather_width"]


def _hidden(x, w_gate, w_up):
    """(h, active) for x [M, d]: gated h = relu(x Wg) * (x Wu), else relu(x Wu).

    Matmuls are in the operands' dtype: XLA accumulates bf16 products in f32 and rounds
    once, like ``preferred_element_type=f32`` followed by a cast, but autodiff then keeps
    the backward matmuls in bf16 too (with an f32 result type their transposes run as
    f32 x f32 matmuls, about twice as slow on tensor cores).
    """
    act_w = w_gate if w_gate is not None else w_up
    g = jax.nn.relu(jnp.matmul(x, act_w))
    if w_gate is None:
        return g, g != 0
    u = jnp.matmul(x, w_up)
    return g * u, g != 0


def up_down(x, g, w_up, w_down):
    """Dense up and down projections from the gate activation ``g = relu(x @ W) [M, f]``:
    ``(g * (x @ w_up)) @ w_down``, or ``g @ w_down`` when ``w_up`` is None (non-gated)."""
    h = g if w_up is None else g * jnp.matmul(x, w_up)
    return jnp.matmul(h, w_down)


def ffn(x, w_gate, w_up, w_down):
    """Dense ReLU FFN ``y [..., d]`` for ``x [..., d]`` (see jax_twell.sparse_ffn)."""
    h, _ = _hidden(x, w_gate, w_up)
    return jnp.matmul(h, w_down)


def ffn_unmerged(x, w_gate, w_up, w_down):
    """:func:`ffn`'s value with the gate and up products kept as two matmuls: the dense
    side the CUDA implementation runs at small M (:func:`dense_side`).

    Where the two products' outputs are small (M=2,048 at d=2,048, f=5,632), XLA's GPU
    pipeline merges the two matmuls of x into one over the concatenated ``[w_gate, w_up]``
    and writes that concatenation on every call: 29 us of a 236 us call on an H100, where
    the gate and up products apart (as the per-call form's dense side runs them: the
    ReLU in the gate GEMM's epilogue, g * u in the up GEMM's) took 219 us
    (``ffi/notes/limits.md``, "At 126f645"). An optimization barrier on x between the two
    keeps them apart; it adds no kernel. The same values as :func:`ffn`; non-gated, the
    FFN has one product of x and is :func:`ffn` itself."""
    if w_gate is None:
        return ffn(x, None, w_up, w_down)
    return jnp.matmul(_hidden_apart(x, w_gate, w_up)[3], w_down)


# Up to this many tokens the plan's dense side keeps the gate and up products apart
# (:func:`ffn_unmerged`); past it, XLA's own FFN. The concatenation XLA makes to merge the
# two products costs the same at every M (it copies both weights), so the crossover is a
# token count whatever d and f: on an H200 (d=2,048, f=5,632) the products apart took
# 1.09x / 1.27x / 1.05x of XLA's speed at M=64 / 512 / 2,048 and 0.95x / 0.99x at 4,096 /
# 8,192 (``lab/results/dense_side_sweep_ac5ab93_h200.json``); 1.08x at 2,048 on an H100.
UNMERGED_MAX_TOKENS = 2048


def dense_side(x, w_gate, w_up, w_down):
    """The dense FFN the CUDA implementation runs where sparsity would not pay: :func:`ffn`'s
    value, computed as :func:`ffn_unmerged` up to :data:`UNMERGED_MAX_TOKENS` tokens (x's
    leading dimension) and as :func:`ffn` past them."""
    if x.shape[0] <= UNMERGED_MAX_TOKENS:
        return ffn_unmerged(x, w_gate, w_up, w_down)
    return ffn(x, w_gate, w_up, w_down)


def ffn_with_aux(x, w_gate, w_up, w_down):
    """Dense ReLU FFN with its local statistics; differentiable by JAX's own autodiff.

    x: ``[M, d]``; returns ``(y [M, d], l1 [], counts [M] int32, fired [f] bool)``
    (see :func:`jax_twell.ops.stats.hidden_stats`).
    """
    h, active = _hidden(x, w_gate, w_up)
    y = jnp.matmul(h, w_down)
    return (y, *hidden_stats(h, active))


def ffn_with_aux_vjp(x, w_gate, w_up, w_down, dy, dl1):
    """Cotangents ``(dx, dw_gate, dw_up, dw_down)`` of :func:`ffn_with_aux`'s ``(y, l1)``
    for ``(dy [M, d], dl1 [])``, by XLA autodiff of the dense formula (recomputing g and u):
    the dense side of the sparse training ops' custom VJPs."""

    def loss_terms(x, w_gate, w_up, w_down):
        y, l1, _, _ = ffn_with_aux(x, w_gate, w_up, w_down)
        return y, l1

    _, vjp = jax.vjp(loss_terms, x, w_gate, w_up, w_down)
    return vjp((dy, dl1.astype(jnp.float32)))


def _hidden_apart(x, w_gate, w_up, g=None, u=None):
    """``(g, u, x_up, h)`` of :func:`_hidden`'s formula with the gate and up products kept
    apart (an optimization barrier on x between them; ``x_up`` is x after it): non-gated,
    ``u`` is None and ``h`` is ``g``. ``g`` (and ``u``) given: those products are not formed
    (nor the barrier, with no gate product to keep apart)."""
    x_up = x
    if g is None:
        g = jax.nn.relu(jnp.matmul(x, w_gate if w_gate is not None else w_up))
        if w_gate is not None:
            g, x_up = jax.lax.optimization_barrier((g, x))
    if w_gate is None:
        return g, None, x, g
    if u is None:
        u = jnp.matmul(x_up, w_up)
    return g, u, x_up, g * u


def backup_forward(x, w_gate, w_up, w_down, *, m: int, g=None, hidden: bool = False):
    """The training ops' dense backup over gathered rows ``x [S, d]``: ``(y [S, d], l1 [],
    fired [f] bool)``, ``l1`` being these rows' ``sum |h|`` over ``m`` (the whole call's
    token count, so it adds to the kernels' term). Zero rows contribute nothing.

    The same values as :func:`ffn_with_aux` on those rows, with the gate and up products
    kept apart: merged (XLA joins two products of one operand) they would copy both
    weights into one on every call, which on a few hundred rows costs more than either
    product (``ffi/notes/training.md``, "The backup's products"). ``g [S, f]``: these rows'
    ``relu(x @ w_act)`` where the caller has it (gathered from the whole call's gate), in
    place of the gate product over the rows. ``hidden``: also returns ``(g, u)`` (u None
    where not gated), which :func:`backup_vjp` takes in place of recomputing them."""
    g, u, _, h = _hidden_apart(x, w_gate, w_up, g=g)
    y = jnp.matmul(h, w_down)
    out = y, jnp.abs(h.astype(jnp.float32)).sum() / max(m, 1), (g != 0).any(axis=0)
    return (*out, (g, u)) if hidden else out


def backup_vjp(x, w_gate, w_up, w_down, dy, dl1, *, m: int, grads, transposed: bool = False, hidden=None):
    """Cotangents of :func:`backup_forward`'s ``(y, l1)`` for ``(dy [S, d], dl1 [])``, the
    weights' added to ``grads = (dw_gate, dw_up, dw_down)`` (the kernels' cotangents of the
    other rows; None where there is no such weight): ``(dx [S, d], dw_gate, dw_up,
    dw_down)``. g and u are recomputed (the gate and up products apart, as in the forward),
    or taken from ``hidden = (g, u)`` (:func:`backup_forward`'s, ``hidden=True``).
    ``transposed``: ``grads``' ``dw_gate`` and ``dw_up`` come as ``[f, d]`` (the training
    kernels' layout); the backup's products are then formed ``[f, d]`` too and the sum is
    transposed once, so that the add and the transpose are one pass over the weight
    (the results are in the weights' layout either way).

    Written out rather than by autodiff, so that every product stays in the operands'
    dtype and each weight's sum with ``grads`` is one add in that dtype: autodiff's L1 term
    and a sum with the kernels' gradients in f32 cost three weight-sized f32 passes and a
    concatenation, more than the products themselves on a few hundred rows. Values: the
    dense formula's gradients in the operands' dtype; each weight's sum is rounded twice
    (the product, then the sum) unless XLA takes the add into the product."""
    gated = w_gate is not None
    dtype = x.dtype
    g, u, x_up, h = _hidden_apart(x, w_gate, w_up, *(hidden or (None, None)))
    c = (dl1.astype(jnp.float32) / max(m, 1))
    dh = jnp.matmul(dy, w_down.T) + (jnp.sign(h.astype(jnp.float32)) * c).astype(dtype)
    dw_gate, dw_up, dw_down = grads
    dw_down = jnp.matmul(h.T, dy) + dw_down
    # a weight's product with the kernels' part: [d, f], or [f, d] summed and then transposed
    weight_grad = (lambda a, b, acc: (jnp.matmul(b.T, a) + acc).T) if transposed else \
        (lambda a, b, acc: jnp.matmul(a.T, b) + acc)
    if gated:
        d_pre = jnp.where(g > 0, dh * u, jnp.zeros((), dtype))
        du = dh * g
        dx = jnp.matmul(d_pre, w_gate.T) + jnp.matmul(du, w_up.T)
        dw_gate = weight_grad(x, d_pre, dw_gate)
        dw_up = weight_grad(x_up, du, dw_up)
    else:
        d_pre = jnp.where(g > 0, dh, jnp.zeros((), dtype))
        dx = jnp.matmul(d_pre, w_up.T)
        dw_up = weight_grad(x, d_pre, dw_up)
    return dx, dw_gate, dw_up, dw_down


def gather_width(m: int, f: int, active_per_token: float = 0.01) -> int:
    """Static width of :func:`gather_ffn`'s gathered neurons for ``m`` tokens: room for
    ``active_per_token`` of f per token (1% by default, twice the target density), rounded
    up to 128, at most f."""
    want = max(1.0, m * active_per_token * f)
    return min(f, -(-int(want) // 128) * 128)


def gather_ffn(x, w_gate, w_up, w_down, *, width: int, w_up_t=None):
    """Decode-sized FFN that reads only the weights of neurons active for some token.

    The gate matmul reads its weight once (``g = relu(x @ W)``, ``x [M, d]``); the neurons
    active for any of the M tokens (at most ``width``, see :func:`gather_width`) are
    gathered: their up-weight columns (rows of ``w_up_t [f, d]`` when given, the layout
    that makes them contiguous) and their ``w_down`` rows, and the up and down projections
    run on those alone. Where more than ``width`` neurons fire the call runs
    :func:`up_down` densely instead (``lax.cond``, on the device): exact either way (the
    sums run over the same products in another order, as in any matmul).
    """
    gated = w_gate is not None
    w_act = w_gate if gated else w_up
    f = w_act.shape[1]
    width = min(int(width), f)
    g = jax.nn.relu(jnp.matmul(x, w_act))
    fired = (g != 0).any(axis=0)
    n_fired = fired.sum(dtype=jnp.int32)

    def gathered(_):
        # The union of active neurons, in order, padded with neuron 0 (masked out below).
        idx = jnp.nonzero(fired, size=width, fill_value=0)[0]
        h = jnp.take(g, idx, axis=1)
        if gated:
            w_cols = jnp.take(w_up, idx, axis=1) if w_up_t is None else jnp.take(w_up_t, idx, axis=0).T
            h = h * jnp.matmul(x, w_cols)
        h = jnp.where(jnp.arange(width) < n_fired, h, jnp.zeros((), h.dtype))
        return jnp.matmul(h, jnp.take(w_down, idx, axis=0))

    def dense(_):
        return up_down(x, g, w_up if gated else None, w_down)

    return jax.lax.cond(n_fired <= width, gathered, dense, None)
