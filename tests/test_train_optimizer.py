"""Optimizer: warm-up + cosine schedule, AdamW without decay on 1-D params, gradient clipping."""

import jax.numpy as jnp
import numpy as np
import optax

from jax_twell.train.config import OptimConfig
from jax_twell.train.optimizer import learning_rate_schedule, make_optimizer


def test_schedule_warms_up_linearly_then_decays_to_the_floor():
    cfg = OptimConfig(lr=1e-3, warmup_steps=10, final_lr_ratio=0.1)
    lr = learning_rate_schedule(cfg, 100)
    np.testing.assert_allclose([lr(0), lr(5), lr(10)], [0.0, 5e-4, 1e-3], rtol=1e-6)
    values = [float(lr(s)) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    np.testing.assert_allclose(lr(100), 1e-4, rtol=1e-5)


def test_schedule_with_warmup_longer_than_the_run():
    lr = learning_rate_schedule(OptimConfig(lr=1e-3, warmup_steps=600), 50)
    assert 0 < float(lr(25)) < 1e-3 and np.isfinite(float(lr(50)))


def test_weight_decay_skips_vectors_and_clipping_bounds_the_update():
    cfg = OptimConfig(lr=1e-2, warmup_steps=0, weight_decay=0.5, grad_clip=1.0)
    tx = make_optimizer(cfg, 10)
    params = {"w": jnp.ones((2, 2)), "scale": jnp.ones((2,))}
    zero = {"w": jnp.zeros((2, 2)), "scale": jnp.zeros((2,))}
    updates, _ = tx.update(zero, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -1e-2 * 0.5 * np.ones((2, 2)), rtol=1e-5)
    np.testing.assert_array_equal(updates["scale"], 0.0)

    # Clipping happens before AdamW: feeding clipped gradients to an unclipped AdamW
    # gives the same updates, over steps whose gradient norms differ wildly.
    no_clip = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0, weight_decay=0.5, grad_clip=1e12), 10)
    state, ref_state = tx.init(params), no_clip.init(params)
    for scale in (1e6, 0.3):
        grads = {"w": jnp.full((2, 2), scale), "scale": jnp.full((2,), scale)}
        norm = float(optax.tree.norm(grads))
        clipped = {k: v * min(1.0, 1.0 / norm) for k, v in grads.items()}
        updates, state = tx.update(grads, state, params)
        expected, ref_state = no_clip.update(clipped, ref_state, params)
        for k in params:
            np.testing.assert_allclose(updates[k], expected[k], rtol=1e-5)
