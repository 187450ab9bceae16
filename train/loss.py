"""Language-model loss: next-token cross-entropy plus the L1 activation penalty.

    loss = CE + l1_coef * mean_over_layers(l1)

where a layer's l1 is the per-token SUM over the f hidden units of |h|, averaged over
tokens: docs/design.md, section 1 (The job); the public training code's convention, f
times stronger than a per-element mean.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class LossAux(NamedTuple):
    """Side outputs of `lm_loss`: ce, l1 [] f32 (l1 before the coefficient); stats: FFNStats."""

    ce: jax.Array
    l1: jax.Array
    stats: Any


def l1_coefficient(l1_coef: float, warmup_steps: int, step: jax.Array) -> jax.Array:
    """[] f32: l1_coef, ramped linearly from 0 over the first `warmup_steps` steps."""
    if warmup_steps <= 0:
        return jnp.float32(l1_coef)
    return jnp.float32(l1_coef) * jnp.minimum(1.0, step.astype(jnp.float32) / warmup_steps)


def lm_loss(model, tokens: jax.Array, l1_coef: jax.Array) -> tuple[jax.Array, LossAux]:
    """Loss of `model` on `tokens`: [B, T + 1] int32 (inputs [:, :-1], targets [:, 1:]).

    Returns (loss [] f32, LossAux).
    """
    logits, stats = model(tokens[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()
    l1 = stats.l1.mean()
    return ce + l1_coef * l1, LossAux(ce, l1, stats)
