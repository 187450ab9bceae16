"""Pure-JAX reference of the inference ops on TwELL.

They define the semantics the CUDA kernels are tested against and run on any backend.
They are written for clarity, not speed: gathers of weight rows per stored entry cost
``O(nnz_slots * d)`` memory, fine for tests, slow for production sizes (use "xla" or
"cuda" there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_twell.formats import TwELL, pack_twell_reference, relu_matmul

__all__ = ["twell_ffn", "ffn"]


def twell_ffn(x: jax.Array, act: TwELL, w_act: jax.Array, w_up: jax.Array | None, w_down: jax.Array) -> jax.Array:
    """FFN output from a packed activation ``act = relu(x @ w_act)``.

    Gated (``w_up`` given): ``y = (act * (x @ w_up)) @ w_down``; non-gated: ``y = act @ w_down``.
    Overflowed tiles are recomputed from ``(x, w_act)``. x: ``[M, d]``; y: ``[M, d]``.
    """
    a = act.to_dense(x, w_act)
    if w_up is not None:
        u = jnp.matmul(x, w_up, preferred_element_type=jnp.float32).astype(x.dtype)
        a = a * u
    return jnp.matmul(a, w_down, preferred_element_type=jnp.float32).astype(x.dtype)


def ffn(x, w_gate, w_up, w_down, *, tile: int, capacity: int):
    """Inference FFN through the TwELL reference (pack, then :func:`twell_ffn`). x: ``[M, d]``."""
    w_act = w_gate if w_gate is not None else w_up
    act = pack_twell_reference(relu_matmul(x, w_act), tile=tile, capacity=capacity)
    return twell_ffn(x, act, w_act, w_up if w_gate is not None else None, w_down)
