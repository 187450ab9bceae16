"""Hugging Face Llama safetensors import / export."""

import dataclasses
import json
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx
from specs import assert_close
from test_models import LOGITS_TOL, TINY, forward, llama_reference, tokens_for

from jax_twell.models import (
    CheckpointError,
    TransformerLM,
    config_from_hf,
    config_to_hf,
    from_hf_checkpoint,
    load_hf_tensors,
    load_safetensors,
    save_hf_checkpoint,
    save_safetensors,
    to_hf_tensors,
)

CFG = dataclasses.replace(TINY, n_kv_heads=2, tie_embeddings=False)


def hf_config(cfg, **extra):
    """A Llama config.json dict, as Hugging Face writes it."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "rope_scaling": None,
    } | extra


def hf_tensors(cfg, seed=0):
    """Random Llama weights under Hugging Face names, torch layout, built from numpy only."""
    rng = np.random.default_rng(seed)
    d, f, n, k, hd = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (n * hd, d),
            p + "self_attn.k_proj.weight": (k * hd, d),
            p + "self_attn.v_proj.weight": (k * hd, d),
            p + "self_attn.o_proj.weight": (d, n * hd),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        }
    return {
        name: (1.0 + 0.1 * rng.standard_normal(shape) if len(shape) == 1 else 0.2 * rng.standard_normal(shape)).astype(
            np.float32
        )
        for name, shape in shapes.items()
    }


@pytest.fixture
def checkpoint_file(tmp_path):
    tensors = hf_tensors(CFG)
    path = tmp_path / "model.safetensors"
    safetensors.numpy.save_file(tensors, str(path))
    return path, tensors


def fresh_model(cfg=CFG, seed=5):
    return TransformerLM(cfg, rngs=nnx.Rngs(seed))


def assert_same_params(a, b):
    for x, y in zip(jax.tree.leaves(nnx.state(a, nnx.Param)), jax.tree.leaves(nnx.state(b, nnx.Param))):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("ffn", ["sparse_relu", "dense_silu"])
def test_import_written_checkpoint(checkpoint_file, ffn):
    path, tensors = checkpoint_file
    cfg = dataclasses.replace(CFG, ffn=ffn)
    model = fresh_model(cfg)
    load_safetensors(model, path)
    layer, hf = model.layers[1], {n.removeprefix("model.layers.1."): a for n, a in tensors.items()}
    d, n, k, hd = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    np.testing.assert_array_equal(layer.attn.wq[...], hf["self_attn.q_proj.weight"].T.reshape(d, n, hd))
    np.testing.assert_array_equal(layer.attn.wk[...], hf["self_attn.k_proj.weight"].T.reshape(d, k, hd))
    np.testing.assert_array_equal(layer.attn.wo[...], hf["self_attn.o_proj.weight"].T.reshape(n, hd, d))
    np.testing.assert_array_equal(layer.ffn.w_gate[...], hf["mlp.gate_proj.weight"].T)
    np.testing.assert_array_equal(layer.ffn.w_down[...], hf["mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(model.lm_head[...], tensors["lm_head.weight"].T)
    # The model computes Hugging Face Llama with these weights (ReLU gate when sparse).
    tokens = tokens_for(cfg)
    want, _ = llama_reference(tensors, cfg, tokens)
    assert_close(forward(model, tokens)[0], want, LOGITS_TOL, "imported logits")


@pytest.mark.parametrize("cfg", [CFG, dataclasses.replace(TINY, gated=False)], ids=["gated_untied", "nongated_tied"])
def test_round_trip_is_exact(tmp_path, cfg):
    model = fresh_model(cfg, seed=1)
    path = tmp_path / "out.safetensors"
    save_safetensors(model, path)
    written = safetensors.numpy.load_file(str(path))
    exported = to_hf_tensors(model)
    assert written.keys() == exported.keys()
    assert ("lm_head.weight" in written) == (not cfg.tie_embeddings)
    assert any(n.endswith("gate_proj.weight") for n in written) == cfg.gated
    for name in written:
        np.testing.assert_array_equal(written[name], exported[name])
    loaded = fresh_model(cfg, seed=2)
    load_safetensors(loaded, path)
    assert_same_params(loaded, model)


def test_file_to_model_to_file_is_exact(tmp_path, checkpoint_file):
    path, tensors = checkpoint_file
    model = fresh_model()
    load_safetensors(model, path)
    save_safetensors(model, tmp_path / "again.safetensors")
    again = safetensors.numpy.load_file(str(tmp_path / "again.safetensors"))
    assert again.keys() == tensors.keys()
    for name in tensors:
        np.testing.assert_array_equal(again[name], tensors[name])


def test_hf_folder_round_trip(tmp_path):
    model = fresh_model(dataclasses.replace(CFG, ffn="dense_silu"))
    save_hf_checkpoint(model, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["hidden_act"] == "silu" and config["num_key_value_heads"] == 2
    loaded = from_hf_checkpoint(tmp_path / "ckpt", ffn="dense_silu")
    assert loaded.cfg == model.cfg
    assert_same_params(loaded, model)
    # Default import switches the gate to ReLU for sparsification fine-tuning.
    assert from_hf_checkpoint(tmp_path / "ckpt").cfg.ffn == "sparse_relu"


def test_sharded_folder_and_bf16(tmp_path):
    tensors = hf_tensors(CFG)
    names = sorted(tensors)
    half = len(names) // 2
    as_bf16 = {n: tensors[n].astype(ml_dtypes.bfloat16) for n in names}
    for i, shard in enumerate((names[:half], names[half:])):
        path = tmp_path / f"model-0000{i + 1}-of-00002.safetensors"
        safetensors.numpy.save_file({n: as_bf16[n] for n in shard}, str(path))
    (tmp_path / "config.json").write_text(json.dumps(hf_config(CFG)))
    with pytest.warns(UserWarning, match="stored as bfloat16 are cast to float32"):
        model = from_hf_checkpoint(tmp_path)
    assert model.layers[0].attn.wq.dtype == np.float32
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # kept as stored: nothing to say
        assert from_hf_checkpoint(tmp_path, param_dtype="bfloat16").layers[0].attn.wq.dtype == jnp.bfloat16
    np.testing.assert_array_equal(model.embed[...], as_bf16["model.embed_tokens.weight"].astype(np.float32))

    safetensors.numpy.save_file({names[0]: as_bf16[names[0]]}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(CheckpointError, match="more than one shard"):
        load_safetensors(fresh_model(), tmp_path)


def test_tied_checkpoint_with_equal_lm_head_and_ignored_buffers():
    cfg = dataclasses.replace(CFG, tie_embeddings=True)
    tensors = hf_tensors(cfg)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(cfg.head_dim // 2, np.float32)
    model = fresh_model(cfg)
    load_hf_tensors(model, tensors)
    np.testing.assert_array_equal(model.embed[...], tensors["model.embed_tokens.weight"])


def _without(tensors, name):
    return {n: a for n, a in tensors.items() if n != name}


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (
            lambda t: _without(t, "model.layers.1.mlp.up_proj.weight"),
            r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight",
        ),
        (
            lambda t: t | {"model.layers.0.self_attn.k_proj.weight": np.zeros((64, 32), np.float32)},
            r"model\.layers\.0\.self_attn\.k_proj\.weight has shape \(64, 32\), expected \(16, 32\)",
        ),
        (
            lambda t: t | {"model.layers.0.extra.weight": np.zeros(3, np.float32)},
            r"unexpected tensors: model\.layers\.0\.extra\.weight",
        ),
        (
            lambda t: t | {"model.layers.0.self_attn.q_proj.bias": np.zeros(32, np.float32)},
            "biases are not part of the Llama architecture",
        ),
        (lambda t: _without(t, "lm_head.weight"), "a tied checkpoint needs tie_embeddings=True"),
        (
            lambda t: {n.replace("model.layers.", "transformer.h."): a for n, a in t.items() if "layers" in n},
            "not a Llama-architecture checkpoint",
        ),
        (
            lambda t: {n: a for n, a in t.items() if not n.startswith("model.layers.1.")},
            "checkpoint has 1 layers, the model has n_layers=2",
        ),
    ],
    ids=["missing", "shape", "extra", "bias", "tied_mismatch", "not_llama", "layers"],
)
def test_bad_checkpoints_are_rejected(checkpoint_file, corrupt, message):
    _, tensors = checkpoint_file
    model = fresh_model()
    before = to_hf_tensors(model)
    with pytest.raises(CheckpointError, match=message):
        load_hf_tensors(model, corrupt(dict(tensors)))
    after = to_hf_tensors(model)  # nothing was changed
    assert all(np.array_equal(before[n], after[n]) for n in before)


def test_untied_lm_head_into_tied_model_is_rejected():
    tensors = hf_tensors(CFG)
    with pytest.raises(CheckpointError, match="differs from model.embed_tokens.weight"):
        load_hf_tensors(fresh_model(dataclasses.replace(CFG, tie_embeddings=True)), tensors)


def test_gated_checkpoint_into_nongated_model_is_rejected():
    with pytest.raises(CheckpointError, match="a gated checkpoint needs gated=True"):
        load_hf_tensors(fresh_model(dataclasses.replace(CFG, gated=False)), hf_tensors(CFG))


def test_config_from_hf():
    cfg = config_from_hf(hf_config(CFG))
    assert cfg == CFG
    assert config_from_hf(hf_config(CFG), ffn="dense_silu", dtype="bfloat16").dtype == "bfloat16"
    assert config_to_hf(cfg)["hidden_act"] == "relu"
    assert config_from_hf(config_to_hf(cfg)) == cfg


@pytest.mark.parametrize(
    "extra, message",
    [
        (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]), "only Llama"),
        (dict(model_type="mistral", architectures=["MistralForCausalLM"]), "only Llama"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "unsupported rope scaling"),
        (dict(attention_bias=True), "attention_bias=True"),
    ],
)
def test_unsupported_configs_are_rejected(extra, message):
    with pytest.raises(CheckpointError, match=message):
        config_from_hf(hf_config(CFG, **extra))


def test_missing_config_field_and_nongated_export():
    config = hf_config(CFG)
    del config["intermediate_size"]
    with pytest.raises(CheckpointError, match="config is missing 'intermediate_size'"):
        config_from_hf(config)
    with pytest.raises(CheckpointError, match="non-gated"):
        config_to_hf(dataclasses.replace(CFG, gated=False))


@pytest.mark.parametrize("content", [b"", b"garbage, not a header", None])
def test_unreadable_safetensors_name_the_file(tmp_path, checkpoint_file, content):
    good = checkpoint_file[0].read_bytes()
    path = tmp_path / "broken.safetensors"
    path.write_bytes(content if content is not None else good[: len(good) // 2])  # empty, garbage, or truncated
    with pytest.raises(CheckpointError, match=f"{path}: not a readable safetensors file"):
        load_safetensors(fresh_model(), path)


@pytest.mark.parametrize("text, message", [("{not json", "not a readable JSON config"), ("[1, 2]", "expected a JSON object"),
                                           ("{}", "unsupported architecture")])
def test_bad_hf_config_names_the_file(tmp_path, text, message):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'config.json'}: {message}"):
        from_hf_checkpoint(tmp_path)
