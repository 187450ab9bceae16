"""Dense implementations through XLA: the baseline every kernel is measured against, and
the path the ops take where sparsity would not pay (no kernels, CPU, dense activations)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_twell.ops.common import hidden_stats

__all__ = ["ffn", "ffn_with_aux", "up_down"]


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


def ffn_with_aux(x, w_gate, w_up, w_down):
    """Dense ReLU FFN with its local statistics; differentiable by JAX's own autodiff.

    x: ``[M, d]``; returns ``(y [M, d], l1 [], counts [M] int32, fired [f] bool)``
    (see :func:`jax_twell.ops.common.hidden_stats`).
    """
    h, active = _hidden(x, w_gate, w_up)
    y = jnp.matmul(h, w_down)
    return (y, *hidden_stats(h, active))
