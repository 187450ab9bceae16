"""Held-out evaluation (cross-entropy, bits per byte) and sample generation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_twell.models import generate
from jax_twell.train import sharding
from jax_twell.train.data import Corpus, eval_batch
from jax_twell.train.metrics import bits_per_byte
from jax_twell.train.state import ModelSetup
from jax_twell.train.tokenizer import Tokenizer


def evaluate(eval_step, params: dict, corpus: Corpus, *, num_batches: int, batch_size: int, seq_len: int, mesh) -> dict:
    """Mean next-token cross-entropy over `num_batches` fixed held-out batches.

    eval_step: from `step.make_eval_step`. Returns {"ce": nats/token, "bits_per_byte":
    float or None, "tokens": int}. The batches are the same at every call, so numbers
    from different steps and runs compare directly.
    """
    rows = sharding.process_rows(batch_size, mesh)
    batch_sharding = sharding.batch_sharding(mesh, 2)
    ce_sum, count = 0.0, 0
    for i in range(num_batches):
        batch = eval_batch(corpus.eval, i, num_batches=num_batches, batch_size=batch_size, seq_len=seq_len, rows=rows)
        s, n = eval_step(params, sharding.put_batch(batch, batch_sharding))
        ce_sum += float(s)
        count += int(n)
    ce = ce_sum / count
    # Bytes behind the evaluated tokens, estimated from the split's bytes-per-token ratio.
    eval_bytes = round(corpus.eval_bytes * count / len(corpus.eval)) if corpus.eval_bytes else 0
    return {"ce": ce, "bits_per_byte": bits_per_byte(ce, count, eval_bytes), "tokens": count}


def sample(
    setup: ModelSetup,
    params: dict,
    tokenizer: Tokenizer,
    prompt: str,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    seed: int,
) -> str:
    """Text continuing `prompt` (the prompt included), sampled from the model with `params`.

    temperature 0 is greedy; top_k 0 samples from the whole vocabulary.
    """
    prompt_tokens = tokenizer.encode(prompt.encode("utf-8"))
    if len(prompt_tokens) == 0:
        raise ValueError("the prompt must not be empty")
    new_tokens = generate(
        setup.bind(params),
        jnp.asarray(prompt_tokens, jnp.int32)[None, :],
        max_new_tokens,
        temperature=temperature,
        top_k=top_k or None,
        rng=jax.random.PRNGKey(seed),
    )
    return tokenizer.decode(prompt_tokens.tolist() + np.asarray(jax.device_get(new_tokens))[0].tolist())
