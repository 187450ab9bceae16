"""The CUDA inference FFN's VJP: exact gradients from XLA's dense formula.

The inference kernels have no JAX derivative rules; :func:`dense_formula_gradients` gives
a forward they compute a backward at the dense backward's cost, keeping only the inputs.
To train on sparse kernels, use :func:`jax_twell.sparse_ffn_train`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_twell.ops import xla

__all__ = ["dense_formula_gradients"]


def dense_formula_gradients(ffn):
    """``ffn(x, w_gate, w_up, w_down, w_up_t, w_act_t, weights_finite)`` with a custom VJP
    from XLA's dense formula: exact gradients, only the inputs kept as residuals. The
    transposed weight copies get zero cotangents (y depends on them only through the
    weights they copy); ``weights_finite`` (a bool or None) gets none."""

    @jax.custom_vjp
    def fn(x, w_gate, w_up, w_down, w_up_t, w_act_t, weights_finite):
        return ffn(x, w_gate, w_up, w_down, w_up_t, w_act_t, weights_finite)

    def fwd(x, w_gate, w_up, w_down, w_up_t, w_act_t, weights_finite):
        out = ffn(x, w_gate, w_up, w_down, w_up_t, w_act_t, weights_finite)
        return out, (x, w_gate, w_up, w_down, w_up_t, w_act_t)

    def bwd(res, g):
        x, w_gate, w_up, w_down, w_up_t, w_act_t = res
        _, vjp = jax.vjp(xla.ffn, x, w_gate, w_up, w_down)
        zero = lambda a: None if a is None else jnp.zeros_like(a)
        return (*vjp(g), zero(w_up_t), zero(w_act_t), None)

    fn.defvjp(fwd, bwd)
    return fn
