"""TransformerLM against a plain re-statement of Llama, presets, sharding names, jit and grads."""

import dataclasses
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from specs import assert_close, tolerance

from jax_twell import FFNSharding
from jax_twell.models import (
    LOGICAL_AXIS_RULES,
    PRESETS,
    ModelConfig,
    TransformerLM,
    param_shardings,
    to_hf_tensors,
)
from jax_twell.modules import DenseFFN, FFNStats, SparseFFN

TINY = dataclasses.replace(PRESETS["tiny"], vocab_size=64, d_model=32, n_layers=2, n_heads=4, head_dim=8, d_ff=48)
VARIANTS = {
    "sparse_gated_tied": TINY,
    "sparse_nongated_gqa": dataclasses.replace(TINY, gated=False, n_kv_heads=2, rope_theta=500.0),
    "silu_untied": dataclasses.replace(TINY, ffn="dense_silu", tie_embeddings=False, head_dim=12),
    "relu_untied_mqa": dataclasses.replace(TINY, ffn="dense_relu", tie_embeddings=False, n_kv_heads=1),
}
# Logits reduce over d (and attention over T): f32 against a float64 re-statement.
LOGITS_TOL = tolerance(jnp.float32, 4096)


@pytest.fixture(autouse=True)
def _f32_products():
    """f32 products in f32: on a GPU, XLA's default precision runs f32 matmuls in TF32
    (about 1e-3 relative), which these tolerances are not about."""
    with jax.default_matmul_precision("highest"):
        yield


@nnx.jit
def forward(model, tokens):
    return model(tokens)


def tokens_for(cfg, batch=2, length=7, seed=0):
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, cfg.vocab_size, jnp.int32)


def llama_reference(tensors, cfg, tokens):
    """Hugging Face Llama forward, in float64 numpy, from Hugging Face-named tensors.

    Follows the Hugging Face formulation independently of the model code: torch layout
    ([out, in], ``x @ W.T``), rotate_half rotary, repeat_kv for grouped-query attention.
    Returns (logits [B, T, V], per-layer list of h [B, T, f]).
    """
    t = {name: np.asarray(a, np.float64) for name, a in tensors.items()}
    tokens = np.asarray(tokens)
    b, n_tok = tokens.shape
    n, k, hd = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    act = {"sparse_relu": lambda a: np.maximum(a, 0), "dense_relu": lambda a: np.maximum(a, 0)}.get(
        cfg.ffn, lambda a: a / (1 + np.exp(-a))
    )

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * w

    def rope(x):
        inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, hd, 2) / hd)
        emb = np.concatenate([np.outer(np.arange(n_tok), inv_freq)] * 2, axis=-1)[None, :, None, :]
        rotated = np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], axis=-1)
        return x * np.cos(emb) + rotated * np.sin(emb)

    x = t["model.embed_tokens.weight"][tokens]
    hidden = []
    causal = np.tril(np.ones((n_tok, n_tok), bool))
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        a = rms(x, t[p + "input_layernorm.weight"])
        q = rope((a @ t[p + "self_attn.q_proj.weight"].T).reshape(b, n_tok, n, hd))
        kk = rope((a @ t[p + "self_attn.k_proj.weight"].T).reshape(b, n_tok, k, hd))
        v = (a @ t[p + "self_attn.v_proj.weight"].T).reshape(b, n_tok, k, hd)
        kk, v = np.repeat(kk, n // k, axis=2), np.repeat(v, n // k, axis=2)
        scores = np.einsum("btnh,bsnh->bnts", q, kk) / np.sqrt(hd)
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        o = np.einsum("bnts,bsnh->btnh", probs, v).reshape(b, n_tok, n * hd)
        x = x + o @ t[p + "self_attn.o_proj.weight"].T
        a = rms(x, t[p + "post_attention_layernorm.weight"])
        up = a @ t[p + "mlp.up_proj.weight"].T
        h = act(a @ t[p + "mlp.gate_proj.weight"].T) * up if cfg.gated else act(up)
        hidden.append(h)
        x = x + h @ t[p + "mlp.down_proj.weight"].T
    x = rms(x, t["model.norm.weight"])
    head = t["lm_head.weight"] if "lm_head.weight" in t else t["model.embed_tokens.weight"]
    return x @ head.T, hidden


@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_matches_reference(variant):
    cfg = VARIANTS[variant]
    model = TransformerLM(cfg, rngs=nnx.Rngs(0))
    tokens = tokens_for(cfg)
    logits, stats = forward(model, tokens)
    assert logits.shape == (2, 7, cfg.vocab_size) and logits.dtype == jnp.float32
    want, hidden = llama_reference(to_hf_tensors(model), cfg, tokens)
    assert_close(logits, want, LOGITS_TOL, f"{variant} logits")

    n_layers, f = cfg.n_layers, cfg.d_ff
    assert isinstance(stats, FFNStats)
    assert [a.shape for a in stats] == [(n_layers,)] * 4 + [(n_layers, f)]
    assert [a.dtype for a in stats] == [jnp.float32, jnp.float32, jnp.int32, jnp.int32, jnp.bool_]
    for i, h in enumerate(hidden):
        h = h.reshape(-1, f)
        counts = (h != 0).sum(-1)
        assert_close(stats.l1[i], np.abs(h).sum(-1).mean(), 1e-4, f"layer {i} l1")
        np.testing.assert_allclose(stats.nnz_mean[i], counts.mean(), rtol=1e-6)
        assert int(stats.nnz_max[i]) == counts.max()
        np.testing.assert_array_equal(stats.neuron_fired[i], (h != 0).any(0))


def test_layers_expose_ffn_params():
    model = TransformerLM(TINY, rngs=nnx.Rngs(0))
    ffn = model.layers[1].ffn
    assert isinstance(ffn, SparseFFN)
    assert ffn.w_gate.shape == (32, 48) and ffn.w_up.shape == (32, 48) and ffn.w_down.shape == (48, 32)
    assert isinstance(ffn.w_gate, nnx.Param)
    nongated = TransformerLM(VARIANTS["sparse_nongated_gqa"], rngs=nnx.Rngs(0))
    assert nongated.layers[0].ffn.w_gate is None
    dense = TransformerLM(VARIANTS["silu_untied"], rngs=nnx.Rngs(0))
    assert isinstance(dense.layers[0].ffn, DenseFFN) and dense.layers[0].ffn.activation == "silu"


def test_causal():
    model = TransformerLM(TINY, rngs=nnx.Rngs(0))
    tokens = tokens_for(TINY)
    changed = tokens.at[:, 4].set((tokens[:, 4] + 1) % TINY.vocab_size)
    a, _ = forward(model, tokens)
    b, _ = forward(model, changed)
    np.testing.assert_array_equal(a[:, :4], b[:, :4])
    assert not np.allclose(a[:, 4:], b[:, 4:])


def test_jit_matches_eager():
    model = TransformerLM(TINY, rngs=nnx.Rngs(0))
    tokens = tokens_for(TINY)
    logits, stats = forward(model, tokens)
    want_logits, want_stats = model(tokens)
    assert_close(logits, want_logits, LOGITS_TOL, "jit logits")
    np.testing.assert_array_equal(stats.neuron_fired, want_stats.neuron_fired)


def lm_loss(model, tokens, l1_coef=1e-3):
    logits, stats = model(tokens[:, :-1])
    ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1).mean()
    return ce + l1_coef * stats.l1.mean()


def test_grads_flow_through_sparse_train_op():
    """jax.grad through the rematerialised model with the reference (sparse custom_vjp) op
    equals jax.grad with the dense XLA op."""
    tokens = tokens_for(TINY, length=9)
    grads = {}
    for implementation, remat in (("xla", False), ("reference", True)):
        cfg = dataclasses.replace(TINY, ffn_implementation=implementation, remat=remat)
        model = TransformerLM(cfg, rngs=nnx.Rngs(0))
        loss, grads[implementation, remat] = nnx.jit(nnx.value_and_grad(lm_loss))(model, tokens)
        assert np.isfinite(loss)
    want = jax.tree.leaves(grads["xla", False])
    got = jax.tree.leaves(grads["reference", True])
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert_close(a, b, tolerance(jnp.float32, 4096, grad=True), "grad")
    ffn_grads = grads["reference", True]["layers"][0]["ffn"]
    for name in ("w_gate", "w_up", "w_down"):
        assert np.abs(ffn_grads[name][...]).max() > 0, name


def test_bfloat16_compute():
    cfg = dataclasses.replace(TINY, dtype="bfloat16")
    model = TransformerLM(cfg, rngs=nnx.Rngs(0))
    tokens = tokens_for(cfg)
    logits, stats = forward(model, tokens)
    assert logits.dtype == jnp.float32 and model.layers[0].ffn.w_up.dtype == jnp.float32
    want, _ = llama_reference(to_hf_tensors(model), cfg, tokens)
    assert_close(logits, want, 0.05, "bf16 logits")
    grads = nnx.jit(nnx.grad(lm_loss))(model, tokens)
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


def test_presets():
    assert PRESETS["tiny"].vocab_size == 256 and PRESETS["tiny"].d_model == 128 and PRESETS["tiny"].d_ff == 352
    assert PRESETS["small"].d_model == 512 and PRESETS["small"].d_ff == 1408 and PRESETS["small"].max_seq_len == 512
    layers = {"0.5b": 8, "1b": 18, "1.5b": 28, "2b": 38}
    for name, n_layers in layers.items():
        cfg = PRESETS[name]
        assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_ff) == (n_layers, 2048, 32, 64, 5632)
        assert (cfg.vocab_size, cfg.max_seq_len, cfg.dtype, cfg.tie_embeddings) == (49152, 2048, "bfloat16", True)
    # Parameter count of the 1.5B model, built abstractly (no memory).
    abstract = nnx.eval_shape(lambda: TransformerLM(PRESETS["1.5b"], rngs=nnx.Rngs(0)))
    count = sum(p.size for p in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert 1.5e9 < count < 1.6e9
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["tiny"].d_model = 1


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(ffn="gelu"), "ffn must be one of"),
        (dict(n_kv_heads=3), "multiple of n_kv_heads"),
        (dict(head_dim=7), "head_dim must be even"),
        (dict(d_model=0), "d_model must be a positive int"),
        (dict(dtype="float33"), "dtype must name a dtype"),
    ],
)
def test_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY, **overrides)


def test_logical_axes_and_shardings():
    cfg = dataclasses.replace(TINY, tie_embeddings=False)
    model = TransformerLM(cfg, rngs=nnx.Rngs(0))
    specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    P = jax.sharding.PartitionSpec
    assert specs["embed"].get_value() == P("vocab", "embed")
    assert specs["lm_head"].get_value() == P("embed", "vocab")
    layer = specs["layers"][0]
    assert layer["attn"]["wq"].get_value() == P("embed", "heads", "kv")
    assert layer["attn"]["wk"].get_value() == P("embed", "kv_heads", "kv")
    assert layer["attn"]["wo"].get_value() == P("heads", "kv", "embed")
    assert layer["ffn"]["w_down"].get_value() == P("mlp", "embed")
    assert layer["attn_norm"]["scale"].get_value() == P("norm")

    mesh = jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    shardings = param_shardings(model, mesh)
    assert shardings["layers"][0]["ffn"]["w_up"].get_value().spec == P("fsdp", "tensor")
    assert shardings["embed"].get_value().spec == P("tensor", "fsdp")
    assert shardings["final_norm"]["scale"].get_value().spec == P(None)
    with nnx.logical_axis_rules(LOGICAL_AXIS_RULES):  # an active rules context changes nothing
        in_context = param_shardings(model, mesh)
    assert in_context["layers"][0]["ffn"]["w_up"].get_value().spec == P("fsdp", "tensor")
    assert dict(LOGICAL_AXIS_RULES)["batch"] == ("data", "fsdp")
    # Parameters placed by those shardings, FFN ops per shard: same outputs.
    tokens = tokens_for(cfg)
    want, _ = forward(model, tokens)
    sharded_cfg = dataclasses.replace(cfg, ffn_sharding=FFNSharding(("data", "fsdp"), "tensor", mesh))
    sharded = TransformerLM(sharded_cfg, rngs=nnx.Rngs(0))
    nnx.update(sharded, jax.device_put(nnx.state(model, nnx.Param), shardings))
    logits, stats = forward(sharded, jax.device_put(tokens, NamedSharding(mesh, P(("data", "fsdp")))))
    assert_close(logits, want, LOGITS_TOL, "sharded logits")
    assert stats.neuron_fired.shape == (cfg.n_layers, cfg.d_ff)


def test_model_config_kv_heads_default():
    assert TINY.kv_heads == TINY.n_heads
    assert ModelConfig(16, 8, 1, 4, 2, 8, 16, n_kv_heads=2).kv_heads == 2


SHARDED_SCRIPT = """
import dataclasses
import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jax_twell import FFNSharding
from jax_twell.models import TransformerLM, generate, param_shardings
from test_models import TINY, lm_loss

cfg = dataclasses.replace(TINY, n_kv_heads=2, tie_embeddings=False)
mesh = jax.make_mesh((1, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
model = TransformerLM(cfg, rngs=nnx.Rngs(0))
tokens = jax.random.randint(jax.random.key(0), (4, 8), 0, cfg.vocab_size)
sharded_cfg = dataclasses.replace(cfg, ffn_sharding=FFNSharding(("data", "fsdp"), "tensor", mesh))
sharded = TransformerLM(sharded_cfg, rngs=nnx.Rngs(1))
nnx.update(sharded, jax.device_put(nnx.state(model, nnx.Param), param_shardings(model, mesh)))
assert sharded.layers[0].ffn.w_up[...].sharding.spec == P("fsdp", "tensor")
sharded_tokens = jax.device_put(tokens, NamedSharding(mesh, P(("data", "fsdp"))))

value_and_grad = nnx.jit(nnx.value_and_grad(lm_loss))
forward = nnx.jit(lambda m, t: m(t))
for (a, b) in [(forward(sharded, sharded_tokens), forward(model, tokens)),
               (value_and_grad(sharded, sharded_tokens), value_and_grad(model, tokens))]:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=1e-4, atol=1e-5)
np.testing.assert_array_equal(generate(sharded, sharded_tokens, 3, temperature=0.0),
                              generate(model, tokens, 3, temperature=0.0))
print("sharded ok")
"""


@pytest.mark.slow
def test_sharded_over_four_devices():
    """Forward, grads and generation with parameters and FFN ops sharded over
    (fsdp=2, tensor=2) CPU devices equal the unsharded model's (own process: the device
    count is fixed at JAX start-up)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    tests_dir = pathlib.Path(__file__).parent
    result = subprocess.run(
        [sys.executable, "-c", SHARDED_SCRIPT], cwd=tests_dir, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "sharded ok" in result.stdout


def test_logits_matmul_gradients_stay_in_bf16_and_match():
    from jax_twell.models.transformer import logits_matmul

    kx, kw, kc = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (2, 8, 64), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (300, 64), jnp.float32) / 8).astype(jnp.bfloat16)
    cot = jax.random.normal(kc, (2, 8, 300), jnp.float32)
    ours = lambda x, w: (logits_matmul(x, w, "btd,vd->btv") * cot).sum()
    plain = lambda x, w: (jnp.einsum("btd,vd->btv", x, w, preferred_element_type=jnp.float32) * cot).sum()
    assert logits_matmul(x, w, "btd,vd->btv").dtype == jnp.float32
    np.testing.assert_array_equal(ours(x, w), plain(x, w))  # same forward
    g_ours, g_plain = jax.grad(ours, (0, 1))(x, w), jax.grad(plain, (0, 1))(x, w)
    for a, b in zip(g_ours, g_plain):
        assert a.dtype == jnp.bfloat16
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).max() <= 2.0**-6 * np.abs(b).max()
    def f32_operand_dots(fn):
        hlo = jax.jit(jax.grad(fn, (0, 1))).lower(x, w).as_text()
        operands = [l.rsplit(": (", 1)[1].split(") ->")[0] for l in hlo.splitlines() if "dot_general" in l]
        assert len(operands) == 2  # the two backward matmuls (the loss is linear in the logits)
        return sum("f32" in o for o in operands)

    assert f32_operand_dots(plain) == 2  # what JAX's own transpose does
    assert f32_operand_dots(ours) == 0


def test_calibrate_ffn_stores_each_layers_active_and_union_fractions_and_decode_cache(monkeypatch):
    import jax_twell.modules as modules_lib

    model = TransformerLM(TINY, rngs=nnx.Rngs(3))
    tokens = jax.random.randint(jax.random.key(4), (2, 16), 0, TINY.vocab_size)
    fractions = model.calibrate_ffn(tokens)
    _, stats = model(tokens)
    np.testing.assert_allclose(fractions, np.asarray(stats.nnz_mean) / TINY.d_ff, rtol=1e-6)
    assert all(0.0 < p < 1.0 for p in fractions)  # ReLU at initialisation: about half active
    assert [layer.ffn.active_fraction for layer in model.layers] == pytest.approx(fractions)
    # Each layer's 64-token union (here one block of 32 tokens): at least the mean density,
    # at most all neurons, and what block_union measures on the layer's own input.
    for layer, p in zip(model.layers, fractions):
        assert p <= layer.ffn.union_fraction <= min(1.0, 32 * p)
    x = model._embed(tokens)
    x = x + model.layers[0].attn(model.layers[0].attn_norm(x))
    want = float(model.layers[0].ffn.block_union(model.layers[0].ffn_norm(x)))
    assert model.layers[0].ffn.union_fraction == pytest.approx(want, rel=1e-5)
    # The warp layout's fit, as warp_layout_fit reads the layer's own gate activation:
    # about half of TINY's 48 neurons active (one partial tile), so no token is past the
    # 64-entry budget or the tile's 32: every pair is kept.
    from jax_twell.formats import relu_matmul
    from jax_twell.ops.stats import warp_layout_fit

    ffn0 = model.layers[0].ffn
    h0 = model.layers[0].ffn_norm(x)
    over, kept = np.asarray(warp_layout_fit(relu_matmul(h0.reshape(-1, TINY.d_model), ffn0.w_gate[...].astype(h0.dtype))))
    assert (ffn0.overflow_fraction, ffn0.kept_fraction) == pytest.approx((float(over), float(kept)), abs=1e-6)
    for layer, p in zip(model.layers, fractions):
        assert layer.ffn.overflow_fraction == 0.0 and layer.ffn.kept_fraction == pytest.approx(p, rel=1e-5)
    assert ffn0.layer_info().overflow_fraction == 0.0 and ffn0.layer_info().kept_fraction == ffn0.kept_fraction

    model.cache_for_decode()
    for layer in model.layers:
        cached = layer.ffn.w_up_t[...]
        assert cached.dtype == jnp.dtype(TINY.dtype)
        np.testing.assert_array_equal(cached, layer.ffn.w_up[...].T.astype(TINY.dtype))
        assert layer.ffn.w_act_t is None  # only when asked for
    model.cache_for_decode(activation_weight=True)
    for layer in model.layers:
        np.testing.assert_array_equal(layer.ffn.w_act_t[...], layer.ffn.w_gate[...].T.astype(TINY.dtype))

    seen = []  # what the inference path passes to the op
    real = modules_lib.sparse_ffn_for_layer

    def spy(x, *weights, **kwargs):
        seen.append(kwargs)
        return real(x, *weights, **kwargs)

    monkeypatch.setattr(modules_lib, "sparse_ffn_for_layer", spy)
    logits, _ = model.prefill(tokens, 20)
    assert len(seen) == TINY.n_layers
    for kwargs, layer, p in zip(seen, model.layers, fractions):
        assert kwargs["layer"].active_fraction == pytest.approx(p) and kwargs["w_up_t"].shape == (TINY.d_ff, TINY.d_model)
        assert kwargs["layer"] == layer.ffn.layer_info() and kwargs["layer"].kept_fraction == pytest.approx(p, rel=1e-5)
        assert kwargs["w_act_t"].shape == (TINY.d_ff, TINY.d_model)
    assert np.isfinite(np.asarray(logits)).all()
    for layer in model.layers:
        layer.ffn.clear_inference_cache()
        assert layer.ffn.w_up_t is None and layer.ffn.w_act_t is None
