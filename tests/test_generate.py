"""KV-cache prefill / decode and generate."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from specs import assert_close
from test_models import LOGITS_TOL, TINY, forward, tokens_for

from jax_twell.models import TransformerLM, generate

CFG = dataclasses.replace(TINY, n_kv_heads=2, max_seq_len=16)


@pytest.fixture(scope="module")
def model():
    return TransformerLM(CFG, rngs=nnx.Rngs(0))


@nnx.jit(static_argnames="max_len")
def prefill(model, tokens, max_len):
    return model.prefill(tokens, max_len)


@nnx.jit
def decode_step(model, tokens, cache):
    return model.decode_step(tokens, cache)


def test_prefill_equals_forward_and_stepwise_decode(model):
    tokens = tokens_for(CFG, length=9)
    full, _ = forward(model, tokens)
    logits, cache = prefill(model, tokens, 12)
    assert logits.shape == (2, 9, CFG.vocab_size) and int(cache.length) == 9
    assert len(cache.k) == CFG.n_layers and cache.k[0].shape == (2, 12, CFG.kv_heads, CFG.head_dim)
    assert_close(logits, full, LOGITS_TOL, "prefill vs forward")
    last, _ = model.prefill(tokens, 12, last_only=True)
    assert_close(last, logits[:, -1:], LOGITS_TOL, "prefill last_only")

    # First token by prefill, the rest one at a time through the jitted decode step.
    step_logits, cache = prefill(model, tokens[:, :1], 12)
    steps = [step_logits[:, 0]]
    for t in range(1, 9):
        step_logits, cache = decode_step(model, tokens[:, t : t + 1], cache)
        steps.append(step_logits[:, 0])
    assert int(cache.length) == 9
    assert_close(jnp.stack(steps, axis=1), logits, LOGITS_TOL, "stepwise decode vs prefill")


def test_prefill_attends_like_a_decode_step_over_the_empty_cache(model):
    """prefill's prompt attends to itself only (causal attention over its own keys, fused
    where the platform allows); a decode step of the same tokens into the same empty cache
    masks the whole cache instead: the same logits and the same cache."""
    tokens = tokens_for(CFG, length=7)
    logits, cache = prefill(model, tokens, 12)
    masked, masked_cache = decode_step(model, tokens, model.init_cache(2, 12))
    assert_close(logits, masked, LOGITS_TOL, "prefill vs decode step on an empty cache")
    # the first layer's keys and values come before any attention: the same bits there
    np.testing.assert_array_equal(np.asarray(cache.k[0], np.float32), np.asarray(masked_cache.k[0], np.float32))
    for k, k_ref in zip(cache.k + cache.v, masked_cache.k + masked_cache.v):
        assert_close(k, k_ref, LOGITS_TOL, "cache")
    assert int(cache.length) == int(masked_cache.length) == 7


def test_chunked_decode(model):
    tokens = tokens_for(CFG, length=9)
    logits, _ = prefill(model, tokens, 9)
    first, cache = prefill(model, tokens[:, :4], 9)
    rest, cache = decode_step(model, tokens[:, 4:], cache)
    assert_close(jnp.concatenate([first, rest], axis=1), logits, LOGITS_TOL, "chunked decode")


def test_cache_overflow_gives_nan(model):
    tokens = tokens_for(CFG, length=4)
    _, cache = prefill(model, tokens, 5)
    ok, cache = decode_step(model, tokens[:, :1], cache)
    assert np.isfinite(ok).all()
    past_end, _ = decode_step(model, tokens[:, :1], cache)
    assert np.isnan(past_end).all()
    with pytest.raises(ValueError, match="does not fit a cache"):
        model.prefill(tokens, 3)


def greedy_by_full_forward(model, prompt, n):
    """Greedy continuation by re-running the full causal forward (one fixed length, so one
    compile: positions past the current token cannot affect its logits)."""
    length = prompt.shape[1]
    tokens = jnp.zeros((prompt.shape[0], length + n), jnp.int32).at[:, :length].set(prompt)
    for i in range(length, length + n):
        logits, _ = forward(model, tokens)
        tokens = tokens.at[:, i].set(jnp.argmax(logits[:, i - 1], -1).astype(jnp.int32))
    return tokens[:, length:]


def test_greedy_generate_matches_full_forward(model):
    prompt = tokens_for(CFG, length=5, seed=3)
    out = generate(model, prompt, 6, temperature=0.0)
    assert out.shape == (2, 6) and out.dtype == jnp.int32
    np.testing.assert_array_equal(out, greedy_by_full_forward(model, prompt, 6))


def test_sampling(model):
    prompt = jnp.tile(tokens_for(CFG, length=5, seed=3)[:1], (16, 1))
    key = jax.random.key(7)
    a = generate(model, prompt, 4, temperature=1.0, top_k=3, rng=key)
    np.testing.assert_array_equal(a, generate(model, prompt, 4, temperature=1.0, top_k=3, rng=key))
    assert ((a >= 0) & (a < CFG.vocab_size)).all()
    assert 1 < len(np.unique(a[:, 0])) <= 3  # identical prompts, first tokens among the top 3
    top1 = generate(model, prompt, 4, temperature=0.7, top_k=1, rng=key)
    np.testing.assert_array_equal(top1, generate(model, prompt, 4, temperature=0.0))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=12), "exceeds the model's max_seq_len=16"),
        (dict(max_new_tokens=0), "max_new_tokens must be a positive int"),
        (dict(temperature=1.0), "rng is required"),
        (dict(temperature=-1.0), "temperature must be a finite number >= 0"),
        (dict(temperature=float("nan"), rng=jax.random.key(0)), "temperature must be a finite number >= 0"),
        (dict(temperature=float("inf"), rng=jax.random.key(0)), "temperature must be a finite number >= 0"),
        (dict(temperature=0.0, top_k=0), "top_k must be in"),
        (dict(length=16), "the prompt is 16 tokens, which leaves no room .* at most 15"),
        (dict(length=20, max_new_tokens=1), "the prompt is 20 tokens"),
    ],
)
def test_generate_rejects_bad_arguments(model, kwargs, message):
    args = dict(max_new_tokens=2, temperature=0.0, length=5) | kwargs
    with pytest.raises(ValueError, match=message):
        generate(model, tokens_for(CFG, length=args.pop("length")), args.pop("max_new_tokens"), **args)


def test_generate_nongated_dense_baseline():
    cfg = dataclasses.replace(CFG, gated=False, ffn="dense_silu")
    model = TransformerLM(cfg, rngs=nnx.Rngs(1))
    prompt = tokens_for(cfg, length=3)
    np.testing.assert_array_equal(generate(model, prompt, 3, temperature=0.0), greedy_by_full_forward(model, prompt, 3))


def test_generate_makes_the_decode_layout_in_its_own_copy(model):
    """generate keeps w_up.T and the weights' check for its steps (the model's own decode
    layout where it keeps one): same tokens either way, and the model passed in unchanged."""
    fresh = TransformerLM(CFG, rngs=nnx.Rngs(0))
    assert not fresh.decode_layout_kept()
    prompt = tokens_for(CFG, length=5, seed=4)
    out = generate(fresh, prompt, 6, temperature=0.0)
    assert not fresh.decode_layout_kept()  # the caller's model was not touched
    fresh.cache_for_decode()
    assert fresh.decode_layout_kept() and not fresh.decode_layout_kept(activation_weight=True)
    fresh.cache_for_decode(activation_weight=True)
    assert fresh.decode_layout_kept(activation_weight=True)
    np.testing.assert_array_equal(generate(fresh, prompt, 6, temperature=0.0), out)
    np.testing.assert_array_equal(out, greedy_by_full_forward(fresh, prompt, 6))
