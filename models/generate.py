"""Autoregressive generation with a fixed-size KV cache."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jax_twell.models.transformer import TransformerLM

__all__ = ["generate"]


def generate(
    model: TransformerLM,
    prompt_tokens: jax.Array,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    rng: jax.Array | None = None,
) -> jax.Array:
    """Samples ``max_new_tokens`` continuations of a batch of equal-length prompts.

    One jitted program: ``model.prefill`` on the prompts into a cache of
    ``T + max_new_tokens - 1`` positions, then ``model.decode_step`` one token at a time
    (a ``lax.scan``), every FFN on its inference path (``SparseFFN.infer``). The sparse
    FFNs' decode layout (``TransformerLM.cache_for_decode``: ``w_up.T`` and the weights'
    finite check; for one row on a GPU also ``w_gate.T``, so each step's FFN runs the
    rows kernel) is made once per call inside the program where the model does not keep
    one, so no step transposes a weight; the model passed in is not changed. It compiles
    once per (prompt shape, ``max_new_tokens``, ``top_k``, greedy or not).

    Args:
      model: ``TransformerLM``.
      prompt_tokens: ``[B, T]`` int32, ``T >= 1``; ``T + max_new_tokens`` must not
        exceed ``model.cfg.max_seq_len``.
      max_new_tokens: tokens to generate, ``>= 1``.
      temperature: softmax temperature, finite and ``>= 0``; ``0`` means greedy (argmax).
      top_k: sample among the ``top_k`` most likely tokens only (None: all).
      rng: ``jax.random`` key; required when ``temperature > 0``.
    Returns:
      ``[B, max_new_tokens]`` int32, the generated tokens (prompt not included).
    """
    prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
    if prompt_tokens.ndim != 2 or prompt_tokens.shape[1] < 1:
        raise ValueError(f"prompt_tokens must have shape [B, T] with T >= 1, got {prompt_tokens.shape}")
    context, prompt_len = model.cfg.max_seq_len, prompt_tokens.shape[1]
    if prompt_len >= context:
        raise ValueError(
            f"the prompt is {prompt_len} tokens, which leaves no room in the model's context of "
            f"max_seq_len={context} tokens (a prompt can have at most {context - 1})"
        )
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    total = prompt_len + max_new_tokens
    if total > context:
        raise ValueError(
            f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) = {total} exceeds the model's "
            f"max_seq_len={context}: ask for at most {context - prompt_len} new tokens"
        )
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature}")
    if top_k is not None and not 1 <= top_k <= model.cfg.vocab_size:
        raise ValueError(f"top_k must be in [1, vocab_size={model.cfg.vocab_size}], got {top_k}")
    greedy = temperature == 0
    if rng is None:
        if not greedy:
            raise ValueError("rng is required when sampling (temperature > 0)")
        rng = jax.random.key(0)
    graphdef, state = nnx.split(model)
    return _generate(
        graphdef,
        state,
        prompt_tokens,
        jnp.float32(temperature if not greedy else 1.0),
        rng,
        max_new_tokens=max_new_tokens,
        top_k=top_k,
        greedy=greedy,
    )


def _sample(logits: jax.Array, key: jax.Array, temperature, top_k: int | None, greedy: bool) -> jax.Array:
    """Next token ``[B]`` int32 from ``logits [B, V]`` f32."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth_largest = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
    return jax.random.categorical(key, logits).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "top_k", "greedy"))
def _generate(graphdef, state, prompt_tokens, temperature, rng, *, max_new_tokens, top_k, greedy):
    model = nnx.merge(graphdef, state)
    # One row a step on a GPU: the rows kernel, which reads the gate weight by neuron.
    rows = prompt_tokens.shape[0] == 1 and jax.default_backend() == "gpu"
    if not model.decode_layout_kept(activation_weight=rows):  # this program's copy only: the caller's model is unchanged
        model.cache_for_decode(activation_weight=rows)
    sample = functools.partial(_sample, temperature=temperature, top_k=top_k, greedy=greedy)
    keys = jax.random.split(rng, max_new_tokens)
    logits, cache = model.prefill(prompt_tokens, prompt_tokens.shape[1] + max_new_tokens - 1, last_only=True)
    first = sample(logits[:, 0], keys[0])

    def step(carry, key):
        token, cache = carry
        logits, cache = model.decode_step(token[:, None], cache)
        token = sample(logits[:, 0], key)
        return (token, cache), token

    _, rest = jax.lax.scan(step, (first, cache), keys[1:])
    return jnp.concatenate([first[:, None], rest.T], axis=1)
