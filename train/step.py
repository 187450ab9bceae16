"""The jitted train and eval steps, with explicit shardings and gradient accumulation.

One optimizer step consumes a [grad_accum, micro_batch, T + 1] int32 batch (batch axis
sharded over (data, fsdp)); micro-batches run in a `lax.scan`, their gradients averaged
in float32, so accumulation changes memory, not the result. Per-step metrics (all
device arrays, fetched by the caller only when it logs):

    loss, ce, l1, l1_term, l1_coef, lr, grad_norm          [] f32
    update_norm                                             [] f32, of the optimizer's update
    finite                                                  [] bool: loss, gradient and update
                                                            finite (else the state is unchanged)
    nnz_mean [L] f32, nnz_max [L] int32                     non-zeros per token per layer
    l1_weight [L] f32                                       each layer's L1 weight (1 unless
                                                            cfg.l1_target: train/loss.py)
    rows_over_capacity [L] int32                            summed over micro-batches
    fired_fraction [L] f32                                  neurons that fired this step
    dead_fraction [L] f32                                   silent for >= dead_window steps
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jax_twell.train import sharding
from jax_twell.train.config import TrainConfig
from jax_twell.train.dead_neurons import reinit_dead_gates, update_since_fired
from jax_twell.train.loss import l1_coefficient, lm_loss
from jax_twell.train.state import ModelSetup, TrainState

DEAD_REINIT_SALT = 0x6465_6164  # separates the re-init noise stream from other uses of the seed


def make_train_step(cfg: TrainConfig, setup: ModelSetup, tx: optax.GradientTransformation, schedule: optax.Schedule):
    """Returns jitted `train_step(state, batch) -> (state, metrics)`.

    state: TrainState sharded as `setup.state_shardings` (donated); batch: [grad_accum,
    batch_size / grad_accum, T + 1] int32. Trace inside `sharding.mesh_context(setup.mesh)`.
    """
    base_key = jax.random.fold_in(jax.random.PRNGKey(cfg.seed), DEAD_REINIT_SALT)

    def micro_step(params, l1_coef, tokens):
        def loss_fn(p):
            return lm_loss(setup.bind(p), tokens, l1_coef, cfg.l1_target)

        (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return grads, aux

    def train_step(state: TrainState, batch: jax.Array):
        l1_coef = l1_coefficient(cfg.l1_coef, cfg.l1_warmup_steps, state.step)
        zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)

        def body(grads_sum, tokens):
            grads, aux = micro_step(state.params, l1_coef, tokens)
            grads_sum = jax.tree.map(lambda s, g: s + g.astype(jnp.float32), grads_sum, grads)
            return grads_sum, aux

        grads_sum, aux = jax.lax.scan(body, zero_grads, batch)
        accum = batch.shape[0]
        grads = jax.tree.map(lambda g, p: (g / accum).astype(p.dtype), grads_sum, state.params)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)

        fired = aux.stats.neuron_fired.any(axis=0)
        since_fired = update_since_fired(state.since_fired, fired)
        dead = since_fired >= cfg.dead_window
        if cfg.dead_reinit:
            params = reinit_dead_gates(params, dead, jax.random.fold_in(base_key, state.step))

        ce, l1, l1_weighted = aux.ce.mean(), aux.l1.mean(), aux.l1_weighted.mean()
        loss = ce + l1_coef * l1_weighted
        # The non-finite guard: a step whose loss, gradient or update is not finite keeps
        # the state it started from (the loop then stops or skips, cfg.nonfinite).
        update_norm = optax.tree.norm(updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(update_norm)
        params, opt_state, since_fired = jax.tree.map(
            lambda new, old: jnp.where(finite, new, old),
            (params, opt_state, since_fired),
            (state.params, state.opt_state, state.since_fired),
        )
        nnz_mean = aux.stats.nnz_mean.mean(axis=0)
        metrics = dict(
            loss=loss,
            finite=finite,
            ce=ce,
            l1=l1,
            l1_term=l1_coef * l1_weighted,
            l1_coef=l1_coef,
            l1_weight=aux.l1_weight.mean(axis=0),
            lr=jnp.asarray(schedule(state.step), jnp.float32),
            grad_norm=grad_norm,
            update_norm=update_norm,
            nnz_mean=nnz_mean,
            nnz_max=aux.stats.nnz_max.max(axis=0),
            rows_over_capacity=aux.stats.rows_over_capacity.sum(axis=0),
            fired_fraction=fired.mean(axis=-1, dtype=jnp.float32),
            dead_fraction=dead.mean(axis=-1, dtype=jnp.float32),
        )
        # ffn_sparse, the layers' sides, changes at log steps in the loop (train/ffn_paths.py)
        return TrainState(state.step + 1, params, opt_state, since_fired, state.ffn_sparse), metrics

    batch_sharding = sharding.batch_sharding(setup.mesh, 3)
    return jax.jit(
        train_step,
        in_shardings=(setup.state_shardings, batch_sharding),
        out_shardings=(setup.state_shardings, sharding.replicated(setup.mesh)),
        donate_argnums=0,
    )


def make_eval_step(setup: ModelSetup):
    """Returns jitted `eval_step(params, batch) -> (ce_sum [] f32, count [] int32)`.

    batch: [B, T + 1] int32; ce_sum is the summed next-token cross-entropy in nats.
    """

    def eval_step(params: dict, batch: jax.Array):
        _, aux = lm_loss(setup.bind(params), batch, jnp.float32(0.0))
        count = batch.shape[0] * (batch.shape[1] - 1)
        return aux.ce * count, jnp.int32(count)

    return jax.jit(
        eval_step,
        in_shardings=(setup.state_shardings.params, sharding.batch_sharding(setup.mesh, 2)),
        out_shardings=sharding.replicated(setup.mesh),
    )
