"""Transformer++ (Llama-style) language model on jax-twell's FFN modules.

Pre-norm blocks ``x += attn(rmsnorm(x)); x += ffn(rmsnorm(x))``, rotary position
embeddings, causal attention through ``jax.nn.dot_product_attention``, no biases, tied
input/output embeddings by default, final RMSNorm. The FFN is ``SparseFFN`` for
``cfg.ffn == "sparse_relu"``, else ``DenseFFN`` (ReLU or SiLU gate).

Entry points (``B`` batch, ``T`` tokens, ``V`` vocabulary, ``L`` layers)::

    model = TransformerLM(cfg, rngs=nnx.Rngs(0))
    logits, stats = model(tokens)          # training: [B, T] int32 -> [B, T, V] f32, FFNStats
    loss = cross_entropy + l1_coef * stats.l1.mean()

    logits, cache = model.prefill(tokens, max_len)     # inference, fills a KV cache
    logits, cache = model.decode_step(next_tokens, cache)

For serving on the CUDA kernels, ``model.calibrate_ffn(sample_tokens)`` stores each
layer's measured active fraction and 64-token union (decode-sized calls then take the
decode kernels where they win, and prefill-sized calls the union kernels or dense, chosen
at trace time) and ``model.cache_for_decode()`` keeps the up weights in the layout those
kernels read.

``model.ffn_inputs(tokens, layers)`` returns what the listed layers' FFNs receive in the
training forward (the normalised hidden state), e.g. to benchmark the FFN kernels on a
trained model's activations (``benchmarks/trained_activations.py``).

``prefill`` and ``decode_step`` use the FFN's inference path (no statistics); jit them
(``nnx.jit``, or ``nnx.split`` + ``jax.jit`` as ``generate`` does). The cache has a fixed
size ``max_len``; a step that would run past it returns NaN logits (the cache is then
unusable), never plausible-looking ones. All rows of a batch share positions (prompts of equal length).

Rotary embeddings use the "rotate_half" layout of Hugging Face Llama: the two halves of
each head (``[..., :H/2]`` and ``[..., H/2:]``) form the rotated pairs, frequency ``i``
being ``rope_theta ** (-2i / H)``. Checkpoints in Hugging Face layout therefore load with
no permutation of the q/k projections.

Parameters and logical axes (``param_dtype``; names in the ``out_sharding`` metadata,
mapped to a mesh by ``LOGICAL_AXIS_RULES``; ``N`` heads, ``K`` kv heads, ``H`` head_dim)::

    embed                         [V, d]     ("vocab", "embed")   std 0.02
    layers[i].attn_norm.scale     [d]        ("norm",)            ones
    layers[i].attn.wq             [d, N, H]  ("embed", "heads", "kv")      std d**-0.5
    layers[i].attn.wk, .wv        [d, K, H]  ("embed", "kv_heads", "kv")   std d**-0.5
    layers[i].attn.wo             [N, H, d]  ("heads", "kv", "embed")      std (N H)**-0.5
    layers[i].ffn_norm.scale      [d]        ("norm",)            ones
    layers[i].ffn.w_gate, .w_up   [d, f]     ("embed", "mlp")     std d**-0.5 (w_gate None if non-gated)
    layers[i].ffn.w_down          [f, d]     ("mlp", "embed")     std f**-0.5
    final_norm.scale              [d]        ("norm",)            ones
    lm_head                       [d, V]     ("embed", "vocab")   std d**-0.5 (None when tied)

Weights draw from a normal truncated at 2 std, rescaled to the std given.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_twell.models.config import ModelConfig
from jax_twell.modules import DenseFFN, FFNStats, SparseFFN, logical_param, stack_stats, truncated_normal

__all__ = ["TransformerLM", "Block", "Attention", "RMSNorm", "KVCache", "rotary"]

EMBED_STD = 0.02



@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def logits_matmul(x: jax.Array, w: jax.Array, spec: str) -> jax.Array:
    """``einsum(spec, x, w)`` with f32 results (logits for the loss), whose backward runs in
    ``x.dtype``: the f32 cotangent is rounded to ``x.dtype`` first, so both backward
    matmuls are bf16 x bf16 (f32 accumulation) instead of the f32 x f32 pair that JAX's
    own transpose of an f32-result einsum gives."""
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)


def _logits_fwd(x, w, spec):
    return logits_matmul(x, w, spec), (x, w)


def _logits_bwd(spec, saved, ct):
    x, w = saved
    _, vjp = jax.vjp(lambda x, w: jnp.einsum(spec, x, w), x, w)
    return vjp(ct.astype(x.dtype))


logits_matmul.defvjp(_logits_fwd, _logits_bwd)

class KVCache(NamedTuple):
    """Fixed-size key/value cache of every layer.

    Attributes:
      k: tuple of ``L`` arrays ``[B, S, K, H]`` compute dtype (``S`` = max_len);
        rotary embeddings already applied.
      v: tuple of ``L`` arrays ``[B, S, K, H]`` compute dtype.
      length: ``[]`` int32, positions filled (the next token's position).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    length: jax.Array


def rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding in the rotate_half layout (Hugging Face Llama).

    Args:
      x: ``[B, T, heads, H]`` any float dtype, ``H`` even.
      positions: ``[T]`` int32 position of each token.
      theta: base frequency.
    Returns:
      ``[B, T, heads, H]`` of ``x.dtype``; computed in f32.
    """
    head_dim = x.shape[-1]
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq  # [T, H/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class RMSNorm(nnx.Module):
    """``x / rms(x) * scale``, normalised in f32. x: ``[..., d]`` -> ``[..., d]`` x.dtype."""

    def __init__(self, dim: int, *, eps: float, param_dtype):
        self.eps = eps
        self.scale = logical_param(jnp.ones((dim,), param_dtype), ("norm",))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def _project_in(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [B, T, d] @ w [d, heads, H]`` -> ``[B, T, heads, H]``, as one 2-D matmul over the
    merged ``heads x H`` columns. (Written as a 3-D einsum, XLA on the CPU copied each
    weight to another layout on every decode step inside the generation loop, where the
    prompt's prefill had used it: 24 copies of 1 MB per token for the small preset, about a
    sixth of its decode time.)"""
    d = x.shape[-1]
    y = x.reshape(-1, d) @ w.reshape(d, -1)
    return y.reshape(*x.shape[:-1], *w.shape[1:])


class Attention(nnx.Module):
    """Multi-head (or grouped-query) causal self-attention with rotary embeddings."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, n, k, h = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
        dtype = jnp.dtype(cfg.param_dtype)
        self.rope_theta = cfg.rope_theta
        self.implementation = cfg.attention_implementation
        self.wq = logical_param(truncated_normal(rngs.params(), (d, n, h), d**-0.5, dtype), ("embed", "heads", "kv"))
        self.wk = logical_param(truncated_normal(rngs.params(), (d, k, h), d**-0.5, dtype), ("embed", "kv_heads", "kv"))
        self.wv = logical_param(truncated_normal(rngs.params(), (d, k, h), d**-0.5, dtype), ("embed", "kv_heads", "kv"))
        self.wo = logical_param(
            truncated_normal(rngs.params(), (n, h, d), (n * h) ** -0.5, dtype), ("heads", "kv", "embed")
        )

    def _qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``x [B, T, d]`` -> q ``[B, T, N, H]``, k, v ``[B, T, K, H]``; rotary on q and k."""
        q = _project_in(x, self.wq[...].astype(x.dtype))
        k = _project_in(x, self.wk[...].astype(x.dtype))
        v = _project_in(x, self.wv[...].astype(x.dtype))
        return rotary(q, positions, self.rope_theta), rotary(k, positions, self.rope_theta), v

    def _out(self, o: jax.Array) -> jax.Array:
        """``o [B, T, N, H]`` -> ``[B, T, d]``."""
        n, h, d = self.wo.shape
        y = o.reshape(-1, n * h) @ self.wo[...].astype(o.dtype).reshape(n * h, d)
        return y.reshape(*o.shape[:-2], d)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Causal attention over the sequence, positions ``0..T-1``.

        x: ``[B, T, d]`` compute dtype -> ``[B, T, d]``.
        """
        q, k, v = self._qkv(x, jnp.arange(x.shape[1]))
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self._implementation(q))
        return self._out(o)

    def _implementation(self, q: jax.Array) -> str | None:
        """The configured attention implementation; by default cuDNN's fused kernel where
        it applies (GPU, bf16/f16, head size a multiple of 8 up to 128), else XLA."""
        if self.implementation is not None:
            return self.implementation
        head = q.shape[-1]
        fused_ok = q.dtype in (jnp.bfloat16, jnp.float16) and head % 8 == 0 and head <= 128
        return "cudnn" if fused_ok and jax.default_backend() == "gpu" else None

    def cached(
        self, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array, start: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Attention of ``T`` new tokens at positions ``start..start+T-1`` over the cache.

        Args:
          x: ``[B, T, d]`` compute dtype.
          k_cache, v_cache: ``[B, S, K, H]``; the new keys/values are written at ``start``.
          start: ``[]`` int32, or the Python int 0 for a prompt into an empty cache (then
            the tokens attend to each other only: causal attention over ``T`` keys, fused
            where :meth:`_implementation` allows, rather than over all ``S`` positions).
        Returns:
          ``(y [B, T, d], k_cache, v_cache)``.
        """
        positions = start + jnp.arange(x.shape[1])
        q, k, v = self._qkv(x, positions)
        k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, start, 0, 0))
        v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, start, 0, 0))
        if isinstance(start, int) and start == 0:
            # A prompt into an empty cache sees only itself: causal attention over the new
            # tokens, on the fused kernel where it applies (as __call__), instead of a
            # masked [B, N, T, S] score matrix over the whole cache.
            o = jax.nn.dot_product_attention(
                q, k.astype(k_cache.dtype), v.astype(v_cache.dtype), is_causal=True, implementation=self._implementation(q)
            )
        else:
            visible = jnp.arange(k_cache.shape[1])[None, :] <= positions[:, None]  # [T, S]
            o = jax.nn.dot_product_attention(q, k_cache, v_cache, mask=visible[None, None])
        return self._out(o), k_cache, v_cache


def _make_ffn(cfg: ModelConfig, rngs: nnx.Rngs) -> SparseFFN | DenseFFN:
    dtype = jnp.dtype(cfg.param_dtype)
    if cfg.ffn == "sparse_relu":
        return SparseFFN(
            cfg.d_model,
            cfg.d_ff,
            gated=cfg.gated,
            implementation=cfg.ffn_implementation,
            sharding=cfg.ffn_sharding,
            param_dtype=dtype,
            rngs=rngs,
        )
    activation = cfg.ffn.removeprefix("dense_")
    return DenseFFN(cfg.d_model, cfg.d_ff, gated=cfg.gated, activation=activation, param_dtype=dtype, rngs=rngs)


class Block(nnx.Module):
    """Pre-norm transformer block: attention then FFN, each with a residual."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=dtype)
        self.attn = Attention(cfg, rngs=rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=dtype)
        self.ffn = _make_ffn(cfg, rngs)

    def __call__(self, x: jax.Array):
        """Training forward: ``x [B, T, d]`` -> ``(x [B, T, d], FFNAux)``."""
        return self.forward_with_union(x, union=False)[:2]

    def attend(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The block up to its FFN: ``x [B, T, d]`` -> ``(x + attn(attn_norm(x)), h)``, ``h``
        the FFN's input (``ffn_norm`` of the first), both ``[B, T, d]`` of ``x.dtype``."""
        x = x + self.attn(self.attn_norm(x))
        return x, self.ffn_norm(x)

    def forward_with_union(self, x: jax.Array, *, union: bool = True):
        """As ``__call__``, plus ``SparseFFN.layout_stats`` of the FFN's input: its mean
        64-token union of active neurons as a fraction of f, its fraction of tokens past the
        warp kernel's layout and of pairs in the tokens that fit it (NaN for a dense FFN or
        ``union=False``): ``(x, FFNAux, [3] f32)``."""
        x, h = self.attend(x)
        y, aux = self.ffn.forward_with_stats(h)
        measured = (self.ffn.layout_stats(h) if union and isinstance(self.ffn, SparseFFN)
                    else jnp.full((3,), jnp.nan, jnp.float32))
        return x + y, aux, measured

    def cached(self, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array, start: jax.Array):
        """Inference forward over a KV cache (see ``Attention.cached``): ``(x, k_cache, v_cache)``."""
        a, k_cache, v_cache = self.attn.cached(self.attn_norm(x), k_cache, v_cache, start)
        x = x + a
        return x + self.ffn.infer(self.ffn_norm(x)), k_cache, v_cache


class TransformerLM(nnx.Module):
    """Transformer++ language model (see the module docstring for layout and API).

    Args:
      cfg: ``ModelConfig``.
      rngs: ``nnx.Rngs`` with a ``params`` stream.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dtype = jnp.dtype(cfg.param_dtype)
        self.embed = logical_param(
            truncated_normal(rngs.params(), (cfg.vocab_size, cfg.d_model), EMBED_STD, dtype), ("vocab", "embed")
        )
        self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=dtype)
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else logical_param(
                truncated_normal(rngs.params(), (cfg.d_model, cfg.vocab_size), cfg.d_model**-0.5, dtype),
                ("embed", "vocab"),
            )
        )

    def _embed(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embed[...], tokens, axis=0).astype(self.cfg.dtype)

    def _logits(self, x: jax.Array) -> jax.Array:
        x = self.final_norm(x)
        if self.lm_head is None:
            return logits_matmul(x, self.embed[...].astype(x.dtype), "btd,vd->btv")
        return logits_matmul(x, self.lm_head[...].astype(x.dtype), "btd,dv->btv")

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, FFNStats]:
        """Training forward with FFN statistics.

        Args:
          tokens: ``[B, T]`` int32, positions ``0..T-1``.
        Returns:
          ``(logits [B, T, V] f32, FFNStats)``; stats fields are ``[L]`` (``neuron_fired``
          ``[L, f]``), ``stats.l1`` differentiable.
        """
        x = self._embed(tokens)
        block = nnx.remat(Block.__call__) if self.cfg.remat else Block.__call__
        auxes = []
        for layer in self.layers:
            x, aux = block(layer, x)
            auxes.append(aux)
        return self._logits(x), stack_stats(auxes)

    def measure_ffn(self, tokens: jax.Array) -> tuple[FFNStats, jax.Array]:
        """The training forward's FFN statistics on ``tokens [B, T]`` and each layer's mean
        union of active neurons over blocks of 64 consecutive tokens, as a fraction of f
        (``SparseFFN.block_union``; NaN for a dense FFN): ``(FFNStats, [L] f32)``.
        Traceable; one extra gate matmul per sparse layer."""
        stats, layouts = self.measure_ffn_layouts(tokens)
        return stats, layouts[:, 0]

    def measure_ffn_layouts(self, tokens: jax.Array) -> tuple[FFNStats, jax.Array]:
        """As :meth:`measure_ffn`, with each layer's ``SparseFFN.layout_stats`` (NaN for a
        dense FFN): ``(FFNStats, [L, 3] f32)``, the columns union, overflow and kept
        fractions. Traceable; one extra gate matmul per sparse layer."""
        x = self._embed(tokens)
        auxes, layouts = [], []
        for layer in self.layers:
            x, aux, measured = layer.forward_with_union(x)
            auxes.append(aux)
            layouts.append(measured)
        return stack_stats(auxes), jnp.stack(layouts)

    def ffn_inputs(self, tokens: jax.Array, layers: Sequence[int]) -> tuple[jax.Array, ...]:
        """The input the FFN of each layer in ``layers`` receives in the training forward on
        ``tokens [B, T]``: the normalised hidden state (``ffn_norm`` of the residual stream
        after the layer's attention), ``[B, T, d]`` of the compute dtype, one per entry of
        ``layers`` in their order. Runs the blocks up to the last layer asked for and no
        further (no logits). Traceable."""
        wanted = [int(i) for i in layers]
        if not wanted or min(wanted) < 0 or max(wanted) >= len(self.layers):
            raise ValueError(f"layers must name layers 0..{len(self.layers) - 1}, got {list(layers)}")
        x = self._embed(tokens)
        found = {}
        for i, layer in enumerate(self.layers):
            x, h = layer.attend(x)
            if i in wanted:
                found[i] = h
            if i == max(wanted):
                break
            x = x + layer.ffn.forward_with_stats(h)[0]
        return tuple(found[i] for i in wanted)

    def calibrate_ffn(self, tokens: jax.Array) -> list[float]:
        """Measures each sparse FFN layer's fraction of active (token, neuron) pairs on
        ``tokens [B, T]`` (the training forward) and stores it as the layer's
        ``active_fraction``, the per-layer choice the CUDA ops then make at trace time
        (decode kernels or dense for inference; kernels or XLA for training); also each
        layer's mean union of active neurons over blocks of 64 consecutive tokens, as its
        ``union_fraction`` (what the CUDA union kernels read; a trained layer's is well
        below the uniform pattern's at the same density), and the fractions of tokens past
        the warp kernel's layout and of pairs in the tokens that fit it, as its
        ``overflow_fraction`` and ``kept_fraction`` (what that kernel and its dense backup
        are priced by). Returns the active fractions, one per layer. Re-jit code that
        captured the model after calling it.
        """
        stats, layouts = nnx.jit(TransformerLM.measure_ffn_layouts)(self, jnp.asarray(tokens, jnp.int32))
        fractions = [float(v) / self.cfg.d_ff for v in np.asarray(stats.nnz_mean, np.float64)]
        clip = lambda v: min(max(float(v), 0.0), 1.0)
        for layer, fraction, (union, over, kept) in zip(self.layers, fractions, np.asarray(layouts, np.float64)):
            if isinstance(layer.ffn, SparseFFN):
                layer.ffn.active_fraction = clip(fraction)
                layer.ffn.union_fraction = clip(union)
                layer.ffn.overflow_fraction = clip(over)
                layer.ffn.kept_fraction = clip(kept)
        return fractions

    def cache_for_decode(self, dtype=None, *, activation_weight: bool = False) -> None:
        """Keeps each sparse FFN's up weight transposed for the decode kernels
        (``SparseFFN.cache_transposed_up_weight``, in the model's compute dtype by
        default); with ``activation_weight``, also the gate (activation) weight
        transposed, so single-token decode runs the rows kernel
        (``SparseFFN.cache_transposed_activation_weight``; one more d x f copy per layer).
        A snapshot of the current weights."""
        for layer in self.layers:
            if isinstance(layer.ffn, SparseFFN):
                layer.ffn.cache_transposed_up_weight(jnp.dtype(dtype or self.cfg.dtype))
                if activation_weight:
                    layer.ffn.cache_transposed_activation_weight(jnp.dtype(dtype or self.cfg.dtype))

    def decode_layout_kept(self, *, activation_weight: bool = False) -> bool:
        """Whether every sparse FFN keeps what :meth:`cache_for_decode` keeps, with
        ``activation_weight`` the transposed activation weight too (True where there is no
        sparse FFN)."""
        return all(layer.ffn.weights_finite is not None and (not activation_weight or layer.ffn.w_act_t is not None)
                   for layer in self.layers if isinstance(layer.ffn, SparseFFN))

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """Empty cache for ``batch`` rows and ``max_len`` positions (zeros, length 0)."""
        shape = (batch, max_len, self.cfg.kv_heads, self.cfg.head_dim)
        zeros = tuple(jnp.zeros(shape, self.cfg.dtype) for _ in range(self.cfg.n_layers))
        return KVCache(k=zeros, v=zeros, length=jnp.zeros((), jnp.int32))

    def decode_step(self, tokens: jax.Array, cache: KVCache, *, last_only: bool = False) -> tuple[jax.Array, KVCache]:
        """Runs ``T`` new tokens at positions ``cache.length ..`` through the cache.

        Args:
          tokens: ``[B, T]`` int32 (``T = 1`` for token-by-token decoding).
          cache: ``KVCache`` with ``B`` rows.
          last_only: compute the logits of the last token only (``T' = 1``), sparing
            the ``[B, T, V]`` output projection of a long prompt.
        Returns:
          ``(logits [B, T', V] f32, cache)`` with ``length`` advanced by ``T``; ``T' = T``
          unless ``last_only``. Logits are NaN if the tokens do not fit in the cache.
        """
        return self._cached_step(tokens, cache, cache.length, last_only)

    def _cached_step(self, tokens: jax.Array, cache: KVCache, start, last_only: bool) -> tuple[jax.Array, KVCache]:
        """``decode_step`` with the start position given: ``cache.length``, or the Python int
        0 when the cache is known empty (``prefill``)."""
        x = self._embed(tokens)
        ks, vs = [], []
        for layer, k_cache, v_cache in zip(self.layers, cache.k, cache.v):
            x, k_cache, v_cache = layer.cached(x, k_cache, v_cache, start)
            ks.append(k_cache)
            vs.append(v_cache)
        end = cache.length + tokens.shape[1]
        logits = self._logits(x[:, -1:] if last_only else x)
        logits = jnp.where(end <= cache.k[0].shape[1], logits, jnp.nan)
        return logits, KVCache(k=tuple(ks), v=tuple(vs), length=end)

    def prefill(self, tokens: jax.Array, max_len: int, *, last_only: bool = False) -> tuple[jax.Array, KVCache]:
        """Prompt pass: ``decode_step`` on an empty cache of ``max_len`` positions.

        Args:
          tokens: ``[B, T]`` int32, ``T <= max_len``.
          max_len: static cache size (prompt plus tokens to generate).
          last_only: as in ``decode_step``.
        Returns:
          ``(logits [B, T', V] f32, cache)``; the logits match ``model(tokens)[0]`` (same
          math, up to the rounding of the FFN implementation).
        """
        if tokens.shape[1] > max_len:
            raise ValueError(f"prompt of {tokens.shape[1]} tokens does not fit a cache of max_len={max_len}")
        return self._cached_step(tokens, self.init_cache(tokens.shape[0], max_len), 0, last_only)
