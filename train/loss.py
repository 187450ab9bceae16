"""Language-model loss: next-token cross-entropy plus the L1 activation penalty.

    loss = CE + l1_coef * mean_over_layers(weight * l1)

where a layer's l1 is the per-token SUM over the f hidden units of |h|, averaged over
tokens: docs/design.md, section 1 (The job); the public training code's convention, f
times stronger than a per-element mean. weight is 1, or with an `l1_target` (a ceiling on
a layer's fraction of active neurons) max(1, active fraction / l1_target) of that layer
on the batch, held constant in the gradient.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class LossAux(NamedTuple):
    """Side outputs of `lm_loss`: ce, l1 [] f32 (l1 before the coefficient and the layers'
    weights); stats: FFNStats; l1_weighted [] f32 (what the coefficient multiplies);
    l1_weight [L] f32 (each layer's weight)."""

    ce: jax.Array
    l1: jax.Array
    stats: Any
    l1_weighted: jax.Array
    l1_weight: jax.Array


def l1_coefficient(l1_coef: float, warmup_steps: int, step: jax.Array) -> jax.Array:
    """[] f32: l1_coef, ramped linearly from 0 over the first `warmup_steps` steps."""
    if warmup_steps <= 0:
        return jnp.float32(l1_coef)
    return jnp.float32(l1_coef) * jnp.minimum(1.0, step.astype(jnp.float32) / warmup_steps)


def layer_l1_weights(stats, l1_target: float) -> jax.Array:
    """[L] f32: each layer's L1 weight, max(1, active fraction / l1_target) on this batch
    (all 1 where l1_target is 0), outside the gradient."""
    if l1_target <= 0:
        return jnp.ones(stats.l1.shape, jnp.float32)
    f = stats.neuron_fired.shape[-1]
    active = stats.nnz_mean.astype(jnp.float32) / f
    return jax.lax.stop_gradient(jnp.maximum(1.0, active / jnp.float32(l1_target)))


def lm_loss(model, tokens: jax.Array, l1_coef: jax.Array, l1_target: float = 0.0) -> tuple[jax.Array, LossAux]:
    """Loss of `model` on `tokens`: [B, T + 1] int32 (inputs [:, :-1], targets [:, 1:]).
    l1_target: the layers' active-fraction ceiling (module docstring; 0: off).

    Returns (loss [] f32, LossAux).
    """
    logits, stats = model(tokens[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()
    l1 = stats.l1.mean()
    weight = layer_l1_weights(stats, l1_target)
    weighted = (weight * stats.l1).mean() if l1_target > 0 else l1
    return ce + l1_coef * weighted, LossAux(ce, l1, stats, weighted, weight)
