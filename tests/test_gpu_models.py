"""On a GPU with the kernels: the compiled model's inference HLO holds the sparse FFN
custom calls, and its outputs match the reference (pure-JAX TwELL) path."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_twell.models import PRESETS, TransformerLM, generate
from specs import assert_close
from jax_twell.ops.plan import Side

pytestmark = pytest.mark.gpu


def tiny_model(implementation):
    """The tiny model is too small for the kernels to win, so the default rule runs it
    dense; each layer's side is set sparse to check the kernels inside the model."""
    cfg = dataclasses.replace(PRESETS["tiny"], dtype=jnp.bfloat16, ffn_implementation=implementation)
    model = TransformerLM(cfg, rngs=nnx.Rngs(0))
    for layer in model.layers:
        layer.ffn.side = Side.SPARSE
    return model


def test_model_hlo_has_sparse_ffn_calls_and_matches_reference():
    tokens = jax.random.randint(jax.random.key(1), (2, 48), 0, 256)
    auto, ref = tiny_model(None), tiny_model("reference")

    @nnx.jit
    def prefill(model, tokens):
        return model.prefill(tokens, 64)[0]

    hlo = prefill.lower(auto, tokens).compile().as_text()
    calls = {name for name in ("jax_twell_pack", "jax_twell_ffn") if name in hlo}
    assert calls, "no jax-twell custom call in the compiled prefill"
    logits_auto = np.asarray(prefill(auto, tokens), np.float32)
    logits_ref = np.asarray(prefill(ref, tokens), np.float32)
    assert_close(logits_auto, logits_ref, 0.05, "prefill logits, kernels vs reference")
    # Greedy decode agrees token for token on most positions (bf16 ties may differ late).
    out_auto = generate(auto, tokens[:, :8], 16, temperature=0.0, rng=jax.random.key(2))
    out_ref = generate(ref, tokens[:, :8], 16, temperature=0.0, rng=jax.random.key(2))
    assert np.mean(np.asarray(out_auto) == np.asarray(out_ref)) > 0.9


def test_prefill_attention_runs_fused_and_matches_the_masked_cache():
    """A prompt into an empty cache attends over itself with cuDNN's fused causal kernel
    (bf16, head size 32): the same logits as a decode step of the same tokens into the same
    empty cache, which masks the whole cache in XLA's attention."""
    cfg = dataclasses.replace(PRESETS["tiny"], dtype=jnp.bfloat16, ffn="dense_relu")
    model = TransformerLM(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(3), (2, 40), 0, 256)

    @nnx.jit
    def prefill(model, tokens):
        return model.prefill(tokens, 64)[0]

    @nnx.jit
    def masked(model, tokens):
        return model.decode_step(tokens, model.init_cache(2, 64))[0]

    hlo = prefill.lower(model, tokens).compile().as_text()
    assert "cudnn" in hlo.lower(), "prefill's attention is not the fused kernel"
    assert "cudnn" not in masked.lower(model, tokens).compile().as_text().lower()
    assert_close(np.asarray(prefill(model, tokens), np.float32), np.asarray(masked(model, tokens), np.float32), 0.05,
                 "prefill (fused) vs decode step (masked)")
