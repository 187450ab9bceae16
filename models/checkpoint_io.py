"""Llama-architecture checkpoints in Hugging Face layout (safetensors) <-> ``TransformerLM``.

Tensor names and layouts (torch ``Linear`` weights are ``[out, in]``; ours are
``[in..., out...]``, so they are transposed and reshaped on the way in and out)::

    model.embed_tokens.weight                      [V, d]       embed
    model.layers.{i}.input_layernorm.weight        [d]          layers[i].attn_norm.scale
    model.layers.{i}.self_attn.q_proj.weight       [N*H, d]     layers[i].attn.wq [d, N, H]
    model.layers.{i}.self_attn.k_proj.weight       [K*H, d]     layers[i].attn.wk [d, K, H]
    model.layers.{i}.self_attn.v_proj.weight       [K*H, d]     layers[i].attn.wv [d, K, H]
    model.layers.{i}.self_attn.o_proj.weight       [d, N*H]     layers[i].attn.wo [N, H, d]
    model.layers.{i}.post_attention_layernorm.weight [d]        layers[i].ffn_norm.scale
    model.layers.{i}.mlp.gate_proj.weight          [f, d]       layers[i].ffn.w_gate [d, f] (gated only)
    model.layers.{i}.mlp.up_proj.weight            [f, d]       layers[i].ffn.w_up [d, f]
    model.layers.{i}.mlp.down_proj.weight          [d, f]       layers[i].ffn.w_down [f, d]
    model.norm.weight                              [d]          final_norm.scale
    lm_head.weight                                 [V, d]       lm_head [d, V] (untied only)

Rotary embeddings: ``TransformerLM`` uses Hugging Face's rotate_half layout, so q/k
projections load unpermuted. ``rotary_emb.inv_freq`` buffers of older checkpoints are
ignored. A tied model accepts a checkpoint with ``lm_head.weight`` only when it equals
the embedding.

Sparsification fine-tuning: ``config_from_hf`` builds a ``"sparse_relu"`` model by
default, i.e. the checkpoint's (SiLU-trained) gate weights run behind a ReLU; fine-tune
with the L1 penalty to recover quality and reach sparsity. Pass ``ffn="dense_silu"`` to
keep the original SwiGLU. Export writes the same names, so a round trip is exact.
The non-gated FFN has no Hugging Face Llama counterpart: its tensors export (without
``gate_proj``) but ``config_to_hf`` refuses it.

Problems (missing, unexpected or mis-shaped tensors, other architectures, unsupported
config options) raise ``CheckpointError`` naming each offending tensor or field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
import warnings
from typing import Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx

from jax_twell.models.config import ModelConfig
from jax_twell.models.transformer import TransformerLM

__all__ = [
    "CheckpointError",
    "to_hf_tensors",
    "load_hf_tensors",
    "save_safetensors",
    "load_safetensors",
    "config_from_hf",
    "config_to_hf",
    "from_hf_checkpoint",
    "save_hf_checkpoint",
]

_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_MAX_LISTED = 8


class CheckpointError(ValueError):
    """A checkpoint or config that does not fit the model; the message names each problem."""


class _Entry(NamedTuple):
    param: nnx.Param
    hf_shape: tuple[int, ...]
    to_hf: Callable[[np.ndarray], np.ndarray]
    from_hf: Callable[[np.ndarray], np.ndarray]


def _linear(param: nnx.Param, in_ndim: int) -> _Entry:
    """Entry of a projection whose first ``in_ndim`` axes are inputs (torch: ``[out, in]``)."""
    shape = tuple(param.shape)
    n_in = math.prod(shape[:in_ndim])
    n_out = math.prod(shape[in_ndim:])
    return _Entry(
        param,
        (n_out, n_in),
        lambda w: w.reshape(n_in, n_out).T,
        lambda t: t.T.reshape(shape),
    )


def _same(param: nnx.Param) -> _Entry:
    return _Entry(param, tuple(param.shape), lambda w: w, lambda t: t)


def _entries(model: TransformerLM) -> dict[str, _Entry]:
    """Hugging Face name -> entry, for every parameter of ``model``."""
    entries = {"model.embed_tokens.weight": _same(model.embed), "model.norm.weight": _same(model.final_norm.scale)}
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        entries[prefix + "input_layernorm.weight"] = _same(layer.attn_norm.scale)
        entries[prefix + "post_attention_layernorm.weight"] = _same(layer.ffn_norm.scale)
        for name in ("q", "k", "v"):
            entries[prefix + f"self_attn.{name}_proj.weight"] = _linear(getattr(layer.attn, f"w{name}"), 1)
        entries[prefix + "self_attn.o_proj.weight"] = _linear(layer.attn.wo, 2)
        if layer.ffn.w_gate is not None:
            entries[prefix + "mlp.gate_proj.weight"] = _linear(layer.ffn.w_gate, 1)
        entries[prefix + "mlp.up_proj.weight"] = _linear(layer.ffn.w_up, 1)
        entries[prefix + "mlp.down_proj.weight"] = _linear(layer.ffn.w_down, 1)
    if model.lm_head is not None:
        entries["lm_head.weight"] = _linear(model.lm_head, 1)
    return entries


def to_hf_tensors(model: TransformerLM) -> dict[str, np.ndarray]:
    """All parameters under Hugging Face Llama names, in torch layout, ``param_dtype``."""
    return {
        name: np.ascontiguousarray(entry.to_hf(np.asarray(jax.device_get(entry.param[...]))))
        for name, entry in _entries(model).items()
    }


def _listing(names) -> str:
    names = sorted(names)
    more = f" (and {len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else ""
    return ", ".join(names[:_MAX_LISTED]) + more


def load_hf_tensors(model: TransformerLM, tensors: Mapping[str, np.ndarray]) -> None:
    """Sets every parameter of ``model`` from Hugging Face-named ``tensors``, in place.

    Everything is validated before any parameter changes. Tensors are cast to
    ``model.cfg.param_dtype``, with a ``UserWarning`` naming both dtypes when they differ
    (a bfloat16 checkpoint loads as float32 unless the model keeps bfloat16).

    Args:
      model: ``TransformerLM`` (concrete, or abstract from ``nnx.eval_shape``).
      tensors: name -> array in torch layout (any dtype numpy converts).
    Raises:
      CheckpointError: not a Llama checkpoint, layer count mismatch, missing tensors,
        unexpected tensors, wrong shapes, or a separate ``lm_head`` for a tied model.
    """
    names = {n for n in tensors if not _IGNORED.fullmatch(n)}
    if not any(n.startswith(("model.layers.", "model.embed_tokens.")) for n in names):
        raise CheckpointError(
            "not a Llama-architecture checkpoint: expected Hugging Face Llama names such as "
            f"model.embed_tokens.weight and model.layers.0.self_attn.q_proj.weight, found {_listing(names)}"
        )
    layers_found = {int(m.group(1)) for n in names if (m := _LAYER.match(n))}
    n_layers = model.cfg.n_layers
    if layers_found and max(layers_found) + 1 != n_layers:
        raise CheckpointError(f"checkpoint has {max(layers_found) + 1} layers, the model has n_layers={n_layers}")
    entries = _entries(model)
    problems = []
    if model.lm_head is None and "lm_head.weight" in names:
        names.discard("lm_head.weight")
        embedding = tensors.get("model.embed_tokens.weight")
        if not np.array_equal(np.asarray(tensors["lm_head.weight"]), np.asarray(embedding)):
            problems.append(
                "lm_head.weight differs from model.embed_tokens.weight but the model ties embeddings "
                "(use tie_embeddings=False)"
            )
    missing = entries.keys() - names
    if missing:
        hint = ""
        if "lm_head.weight" in missing:
            hint = " (lm_head.weight absent: a tied checkpoint needs tie_embeddings=True)"
        if any(n.endswith("gate_proj.weight") for n in missing):
            hint += " (gate_proj absent: a non-gated checkpoint needs gated=False)"
        problems.append(f"missing tensors: {_listing(missing)}{hint}")
    unexpected = names - entries.keys()
    if unexpected:
        hint = ""
        if any(n.endswith(".bias") for n in unexpected):
            hint = " (biases are not part of the Llama architecture supported here)"
        elif any(n.endswith("gate_proj.weight") for n in unexpected):
            hint = " (gate_proj present: a gated checkpoint needs gated=True)"
        problems.append(f"unexpected tensors: {_listing(unexpected)}{hint}")
    wrong = [
        f"{n} has shape {tuple(np.shape(tensors[n]))}, expected {entries[n].hf_shape}"
        for n in sorted(entries.keys() & names)
        if tuple(np.shape(tensors[n])) != entries[n].hf_shape
    ]
    if wrong:
        problems.append("wrong shapes: " + "; ".join(wrong[:_MAX_LISTED]))
    if problems:
        raise CheckpointError("checkpoint does not fit the model: " + " | ".join(problems))
    dtype = jnp.dtype(model.cfg.param_dtype)
    stored = sorted({str(np.asarray(tensors[name]).dtype) for name in entries} - {str(dtype)})
    if stored:
        warnings.warn(
            f"checkpoint tensors stored as {', '.join(stored)} are cast to {dtype} (the model's param_dtype); "
            f"build the model with param_dtype={stored[0]!r} to keep them as stored",
            UserWarning,
            stacklevel=2,
        )
    for name, entry in entries.items():
        entry.param.set_value(jnp.asarray(entry.from_hf(np.asarray(tensors[name])), dtype))


def save_safetensors(model: TransformerLM, path: str | pathlib.Path) -> None:
    """Writes ``to_hf_tensors(model)`` to one safetensors file (metadata format "pt")."""
    safetensors.numpy.save_file(to_hf_tensors(model), str(path), metadata={"format": "pt"})


def load_safetensors(model: TransformerLM, path: str | pathlib.Path) -> None:
    """Loads a safetensors file, or every ``*.safetensors`` shard of a folder, into ``model``.

    Raises:
      CheckpointError: no files, a file that is not safetensors (empty, truncated,
        garbage; named in the message), a tensor name in two shards, or see
        ``load_hf_tensors``.
    """
    path = pathlib.Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise CheckpointError(f"no .safetensors files in {path}")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        try:
            shard = safetensors.numpy.load_file(str(file))
        except Exception as e:  # noqa: BLE001  (the parser's errors do not name the file)
            raise CheckpointError(f"{file}: not a readable safetensors file ({type(e).__name__}: {e})") from None
        repeated = shard.keys() & tensors.keys()
        if repeated:
            raise CheckpointError(f"tensors stored in more than one shard: {_listing(repeated)}")
        tensors.update(shard)
    load_hf_tensors(model, tensors)


def _required(hf_config: Mapping, key: str):
    if key not in hf_config:
        raise CheckpointError(f"config is missing {key!r}")
    return hf_config[key]


def config_from_hf(hf_config: Mapping, **overrides) -> ModelConfig:
    """``ModelConfig`` from a Hugging Face Llama ``config.json`` dict.

    The FFN becomes ``"sparse_relu"`` (gated) unless ``overrides`` say otherwise; dtypes
    default to f32 compute and storage. ``overrides`` are ``ModelConfig`` fields.

    Raises:
      CheckpointError: a model type other than Llama, rope scaling, attention or MLP
        biases, or a missing field.
    """
    model_type = hf_config.get("model_type")
    architectures = hf_config.get("architectures") or ["LlamaForCausalLM"]
    if model_type != "llama" or architectures != ["LlamaForCausalLM"]:
        raise CheckpointError(
            f"unsupported architecture model_type={model_type!r}, architectures={architectures}: "
            "only Llama (LlamaForCausalLM) checkpoints are supported"
        )
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise CheckpointError(f"unsupported rope scaling {rope}: only plain rotary embeddings are supported")
    for flag in ("attention_bias", "mlp_bias"):
        if hf_config.get(flag):
            raise CheckpointError(f"unsupported {flag}=True: the model has no biases")
    d = _required(hf_config, "hidden_size")
    n_heads = _required(hf_config, "num_attention_heads")
    cfg = ModelConfig(
        vocab_size=_required(hf_config, "vocab_size"),
        d_model=d,
        n_layers=_required(hf_config, "num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=hf_config.get("num_key_value_heads", n_heads),
        head_dim=hf_config.get("head_dim") or d // n_heads,
        d_ff=_required(hf_config, "intermediate_size"),
        max_seq_len=hf_config.get("max_position_embeddings", 2048),
        rope_theta=float(hf_config.get("rope_theta", rope.get("rope_theta", 10000.0))),
        norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
    )
    return dataclasses.replace(cfg, **overrides)


def config_to_hf(cfg: ModelConfig) -> dict:
    """Hugging Face Llama ``config.json`` dict for ``cfg`` (``hidden_act`` "relu" or "silu").

    Raises:
      CheckpointError: non-gated FFN (no Llama counterpart).
    """
    if not cfg.gated:
        raise CheckpointError("a non-gated FFN has no Hugging Face Llama counterpart (gated=False)")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu" if cfg.ffn == "dense_silu" else "relu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(jnp.dtype(cfg.param_dtype)),
    }


def from_hf_checkpoint(directory: str | pathlib.Path, **overrides) -> TransformerLM:
    """``TransformerLM`` from a Hugging Face folder (``config.json`` + safetensors shards).

    ``overrides`` go to ``config_from_hf``. Parameters are allocated only once, from the
    checkpoint (no random initialisation).
    """
    directory = pathlib.Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"no config.json in {directory}")
    try:
        hf_config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{config_path}: not a readable JSON config ({e})") from None
    if not isinstance(hf_config, dict):
        raise CheckpointError(f"{config_path}: expected a JSON object, got {type(hf_config).__name__}")
    try:
        cfg = config_from_hf(hf_config, **overrides)
    except (ValueError, TypeError) as e:  # CheckpointError included: name the file
        raise CheckpointError(f"{config_path}: {e}") from None
    model = nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0)))
    load_safetensors(model, directory)
    return model


def save_hf_checkpoint(model: TransformerLM, directory: str | pathlib.Path) -> None:
    """Writes ``config.json`` and ``model.safetensors`` into ``directory`` (created if needed)."""
    directory = pathlib.Path(directory)
    hf_config = config_to_hf(model.cfg)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    save_safetensors(model, directory / "model.safetensors")
