"""Loss, train step, gradient accumulation and dead-neuron re-initialisation (one device)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jax_twell.models import PRESETS as MODEL_PRESETS
from jax_twell.models import TransformerLM
from jax_twell.train import config, data, optimizer, sharding
from jax_twell.train.dead_neurons import REINIT_KEEP, reinit_dead_gates, update_since_fired
from jax_twell.train.loss import l1_coefficient, layer_l1_weights, lm_loss
from jax_twell.train.state import setup_model
from jax_twell.train.step import make_eval_step, make_train_step

MODEL = dataclasses.replace(MODEL_PRESETS["tiny"], d_model=32, d_ff=64, n_layers=2, n_heads=2, head_dim=16, max_seq_len=32)
CFG = dataclasses.replace(
    config.PRESETS["tiny"], model=MODEL, batch_size=8, seq_len=32, steps=30, l1_coef=1e-2,
    optim=config.OptimConfig(lr=1e-2, warmup_steps=5),
)
TOKENS = np.frombuffer(b"def f(x):\n    return x + 1\n" * 400, np.uint8).astype(np.uint16)


def _batch(step, cfg=CFG):
    b = data.batch_at(TOKENS, step, seed=0, batch_size=cfg.batch_size, seq_len=cfg.seq_len)
    return b.reshape(cfg.grad_accum, -1, cfg.seq_len + 1)


def _trainer(cfg):
    mesh = sharding.make_mesh(config.MeshConfig(data=1), jax.devices()[:1])
    tx = optimizer.make_optimizer(cfg.optim, cfg.steps)
    with sharding.mesh_context(mesh):
        setup = setup_model(cfg.model, cfg.seed, tx, mesh)
        state = setup.init()
        step = make_train_step(cfg, setup, tx, optimizer.learning_rate_schedule(cfg.optim, cfg.steps))
        step = step.lower(state, _batch(0, cfg)).compile()
    return setup, state, step


def test_loss_is_cross_entropy_plus_scaled_mean_layer_l1():
    model = TransformerLM(MODEL, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(_batch(0)[0])
    loss, aux = nnx.jit(lm_loss)(model, tokens, jnp.float32(0.5))
    logits, stats = nnx.jit(lambda m, t: m(t))(model, tokens[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    np.testing.assert_allclose(aux.ce, ce, rtol=1e-6)
    np.testing.assert_allclose(aux.l1, stats.l1.mean(), rtol=1e-6)
    np.testing.assert_allclose(loss, ce + 0.5 * stats.l1.mean(), rtol=1e-6)
    assert aux.l1 > 1.0, "per-token sum over f, not a per-element mean"


def test_l1_target_weighs_only_the_layers_above_it():
    """With an active-fraction ceiling, a layer above it has its L1 term multiplied by
    fraction / ceiling, the others by 1; without one the loss is unchanged; the weights are
    outside the gradient."""
    model = TransformerLM(MODEL, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(_batch(0)[0])
    _, stats = nnx.jit(lambda m, t: m(t))(model, tokens[:, :-1])
    active = np.asarray(stats.nnz_mean, np.float64) / MODEL.d_ff
    target = float(np.sort(active)[0] * 1.01)  # between the layers: one weight stays 1
    assert active.max() > target
    base, aux0 = nnx.jit(lm_loss)(model, tokens, jnp.float32(0.5))
    loss, aux = nnx.jit(lm_loss, static_argnums=3)(model, tokens, jnp.float32(0.5), target)
    weight = np.maximum(1.0, active / target)
    np.testing.assert_allclose(aux.l1_weight, weight, rtol=1e-5)
    assert weight.min() == 1.0 and weight.max() > 1.0
    np.testing.assert_allclose(loss, aux.ce + 0.5 * np.mean(weight * np.asarray(stats.l1)), rtol=1e-5)
    np.testing.assert_allclose(aux.l1, aux0.l1, rtol=1e-6)  # the logged l1 stays unweighted
    np.testing.assert_allclose(aux0.l1_weight, np.ones_like(weight))
    np.testing.assert_allclose(base, aux0.ce + 0.5 * aux0.l1, rtol=1e-6)
    grad = jax.grad(lambda n: layer_l1_weights(stats._replace(nnz_mean=n), target).sum())(stats.nnz_mean)
    assert not np.asarray(grad).any()


def test_l1_target_in_the_train_step():
    cfg = dataclasses.replace(CFG, l1_target=0.01, steps=3)
    _, state, step = _trainer(cfg)
    state, metrics = step(state, _batch(0, cfg))
    weight = np.asarray(metrics["l1_weight"])
    assert weight.shape == (MODEL.n_layers,) and np.all(weight >= 1.0)
    active = np.asarray(metrics["nnz_mean"]) / MODEL.d_ff
    np.testing.assert_allclose(weight, np.maximum(1.0, active / 0.01), rtol=1e-5)
    with pytest.raises(config.ConfigError, match="l1_target"):
        config.validate(dataclasses.replace(CFG, l1_target=1.0))


def test_l1_warmup():
    assert float(l1_coefficient(1e-3, 0, jnp.int32(0))) == pytest.approx(1e-3)
    np.testing.assert_allclose([l1_coefficient(1e-3, 100, jnp.int32(s)) for s in (0, 50, 100, 500)],
                               [0.0, 5e-4, 1e-3, 1e-3], rtol=1e-6)


def test_training_lowers_the_loss_and_sparsifies():
    setup, state, step = _trainer(CFG)
    losses, nnz = [], []
    for k in range(CFG.steps):
        state, metrics = step(state, _batch(k))
        losses.append(float(metrics["loss"]))
        nnz.append(float(metrics["nnz_mean"].mean()))
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:3])
    assert nnz[-1] < 0.5 * nnz[0]
    assert int(state.step) == CFG.steps
    with sharding.mesh_context(setup.mesh):
        ce_sum, count = make_eval_step(setup)(state.params, _batch(0)[0])
    assert int(count) == CFG.batch_size * CFG.seq_len and np.isfinite(float(ce_sum))


@pytest.mark.slow
def test_gradient_accumulation_matches_the_full_batch():
    full_cfg = dataclasses.replace(CFG, dead_reinit=True, dead_window=1)
    accum_cfg = dataclasses.replace(full_cfg, grad_accum=4)
    _, full_state, full_step = _trainer(full_cfg)
    _, accum_state, accum_step = _trainer(accum_cfg)
    for k in range(2):
        full_state, full_metrics = full_step(full_state, _batch(k, full_cfg))
        accum_state, accum_metrics = accum_step(accum_state, _batch(k, accum_cfg))
        for key in ("loss", "ce", "l1", "grad_norm", "nnz_mean", "fired_fraction", "dead_fraction"):
            np.testing.assert_allclose(accum_metrics[key], full_metrics[key], rtol=1e-4, atol=1e-6, err_msg=key)
        np.testing.assert_array_equal(accum_metrics["nnz_max"], full_metrics["nnz_max"])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), accum_state.params, full_state.params)


def test_dead_gate_columns_are_nudged_towards_fresh_init():
    rng = np.random.default_rng(0)
    params = {"layers": {i: {"ffn": {"w_gate": jnp.asarray(rng.normal(size=(8, 6)), jnp.float32),
                                     "w_up": jnp.ones((8, 6))}, "other": jnp.ones(3)} for i in range(2)}}
    dead = jnp.asarray([[1, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0]], bool)
    new = reinit_dead_gates(params, dead, jax.random.PRNGKey(0))
    w, w_new = params["layers"][0]["ffn"]["w_gate"], new["layers"][0]["ffn"]["w_gate"]
    np.testing.assert_array_equal(w_new[:, 1:5], w[:, 1:5])
    noise = (w_new[:, [0, 5]] - REINIT_KEEP * w[:, [0, 5]]) / (1 - REINIT_KEEP)
    assert 0.005 < float(jnp.std(noise)) < 0.05, "0.1 * N(0, 0.02^2) added"
    np.testing.assert_array_equal(new["layers"][1]["ffn"]["w_gate"], params["layers"][1]["ffn"]["w_gate"])
    np.testing.assert_array_equal(new["layers"][0]["ffn"]["w_up"], 1.0)
    np.testing.assert_array_equal(new["layers"][0]["other"], 1.0)
    # Non-gated FFN: the ReLU sits on w_up, which is re-initialised instead.
    non_gated = {"layers": {0: {"ffn": {"w_up": jnp.ones((8, 6)), "w_down": jnp.ones((6, 8))}}}}
    changed = reinit_dead_gates(non_gated, dead[:1], jax.random.PRNGKey(0))["layers"][0]["ffn"]
    assert not np.array_equal(changed["w_up"][:, 0], np.ones(8)) and np.array_equal(changed["w_up"][:, 1], np.ones(8))
    np.testing.assert_array_equal(changed["w_down"], 1.0)


def test_since_fired_counter():
    counts = update_since_fired(jnp.asarray([[0, 3, 7]], jnp.int32), jnp.asarray([[False, True, False]]))
    np.testing.assert_array_equal(counts, [[1, 0, 8]])


def test_a_non_finite_step_keeps_the_state_it_started_from():
    cfg = dataclasses.replace(CFG, optim=config.OptimConfig(lr=1e30, warmup_steps=0))
    _, state, step = _trainer(cfg)
    before = jax.tree.map(np.asarray, state)
    new_state, metrics = step(state, _batch(0, cfg))
    assert not bool(metrics["finite"]) and not np.isfinite(float(metrics["update_norm"]))
    assert np.isfinite(float(metrics["loss"])), "the loss of the step itself was finite: the update was not"
    assert int(new_state.step) == 1, "the step is consumed (skipped), not repeated"
    for got, want in zip(jax.tree.leaves((new_state.params, new_state.opt_state, new_state.since_fired)),
                         jax.tree.leaves((before.params, before.opt_state, before.since_fired))):
        np.testing.assert_array_equal(got, want)
