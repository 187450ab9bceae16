"""Transformer++ language models on jax-twell's sparse FFN (installed as ``jax_twell.models``).

Interface::

    from jax_twell.models import ModelConfig, TransformerLM, PRESETS, generate
    cfg = PRESETS["tiny"]                     # frozen dataclass; dataclasses.replace(cfg, ...)
    model = TransformerLM(cfg, rngs=nnx.Rngs(0))
    logits, stats = model(tokens)             # [B, T] int32 -> [B, T, V] f32, FFNStats
    loss = cross_entropy + l1_coef * stats.l1.mean()
    new_tokens = generate(model, prompt, 64, temperature=0.8, top_k=40, rng=key)

``stats`` is ``jax_twell.modules.FFNStats``: per-layer ``l1 [L]`` f32, ``nnz_mean [L]``
f32, ``nnz_max [L]`` int32, ``rows_over_capacity [L]`` int32, ``neuron_fired [L, f]`` bool;
``jax_twell.modules.summarize_stats`` turns it into Python floats for logging.
``model.layers[i].ffn`` is the ``SparseFFN`` (or ``DenseFFN`` for the ``dense_*``
baselines) with ``nnx.Param`` attributes ``w_gate [d, f]`` (None when non-gated),
``w_up [d, f]``, ``w_down [f, d]``.

Presets: "0.5b", "1b", "1.5b", "2b" (the paper's models, bf16) and the byte-level CPU
models "tiny" and "small" (vocabulary 256, no special tokens). Parameters carry logical
axis names; ``LOGICAL_AXIS_RULES`` and ``param_shardings`` map them onto a
("data", "fsdp", "tensor") mesh. Hugging Face Llama checkpoints load and save through
``from_hf_checkpoint`` / ``save_hf_checkpoint`` and friends (see ``checkpoint_io``).
"""

from jax_twell.models.checkpoint_io import (
    CheckpointError,
    config_from_hf,
    config_to_hf,
    from_hf_checkpoint,
    load_hf_tensors,
    load_safetensors,
    save_hf_checkpoint,
    save_safetensors,
    to_hf_tensors,
)
from jax_twell.models.config import FFN_KINDS, PRESETS, ModelConfig
from jax_twell.models.generate import generate
from jax_twell.models.sharding import LOGICAL_AXIS_RULES, param_shardings
from jax_twell.models.transformer import KVCache, TransformerLM

__all__ = [
    "CheckpointError",
    "FFN_KINDS",
    "KVCache",
    "LOGICAL_AXIS_RULES",
    "ModelConfig",
    "PRESETS",
    "TransformerLM",
    "config_from_hf",
    "config_to_hf",
    "from_hf_checkpoint",
    "generate",
    "load_hf_tensors",
    "load_safetensors",
    "param_shardings",
    "save_hf_checkpoint",
    "save_safetensors",
    "to_hf_tensors",
]
