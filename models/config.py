"""Model configuration and presets."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_twell.ops import FFNSharding

__all__ = ["ModelConfig", "PRESETS", "FFN_KINDS"]

FFN_KINDS = ("sparse_relu", "dense_relu", "dense_silu")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Transformer++ (Llama-style) language model configuration.

    Override fields with ``dataclasses.replace(cfg, ...)``.

    Attributes:
      vocab_size: tokens in the vocabulary (``V``).
      d_model: residual width (``d``).
      n_layers: transformer blocks (``L``).
      n_heads: query heads (``N``).
      head_dim: features per head (``H``); ``n_heads * head_dim`` need not equal ``d``.
      d_ff: FFN hidden neurons (``f``).
      max_seq_len: longest sequence the model is meant for (training context, and the
        bound on prompt + generated tokens in ``generate``).
      rope_theta: rotary base frequency.
      ffn: ``"sparse_relu"`` (jax-twell ``SparseFFN``), ``"dense_relu"`` or
        ``"dense_silu"`` (``DenseFFN`` baselines; ``dense_silu`` gated is SwiGLU).
      gated: gated FFN (``h = act(x Wg) * (x Wu)``) or not (``h = act(x Wu)``).
      dtype: compute dtype (activations), anything ``jnp.dtype`` accepts.
      param_dtype: parameter storage dtype.
      tie_embeddings: output projection is the transposed input embedding.
      norm_eps: RMSNorm epsilon.
      n_kv_heads: key/value heads for grouped-query attention (``K``); None = ``n_heads``.
      ffn_implementation: ``implementation=`` for the sparse FFN ops (None = default).
        With ``"cuda"`` the bundled training loop also chooses, per layer and at trace
        time, between the training kernels and XLA autodiff (``jax_twell.train.ffn_paths``).
      ffn_sharding: ``jax_twell.FFNSharding`` for the sparse FFN ops when the model runs
        sharded over a mesh (with ``LOGICAL_AXIS_RULES``:
        ``FFNSharding(token_axes=("data", "fsdp"), tensor_axis="tensor")``); None
        unsharded.
      attention_implementation: ``implementation=`` for ``jax.nn.dot_product_attention``
        in the full-sequence forward. None (default) picks cuDNN's fused kernel on GPU for
        bf16/f16 with head size a multiple of 8 up to 128, and XLA otherwise; ``"xla"`` or
        ``"cudnn"`` force one.
      remat: recompute each block's activations in the backward pass
        (``nnx.remat``), trading compute for memory in training.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    head_dim: int
    d_ff: int
    max_seq_len: int
    rope_theta: float = 10000.0
    ffn: str = "sparse_relu"
    gated: bool = True
    dtype: str = "float32"
    param_dtype: str = "float32"
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    n_kv_heads: int | None = None
    ffn_implementation: str | None = None
    ffn_sharding: FFNSharding | None = None
    attention_implementation: str | None = None
    remat: bool = False

    def __post_init__(self):
        if self.ffn not in FFN_KINDS:
            raise ValueError(f"ffn must be one of {FFN_KINDS}, got {self.ffn!r}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "head_dim", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        for name in ("dtype", "param_dtype"):
            try:
                jnp.dtype(getattr(self, name))
            except TypeError as e:
                raise ValueError(f"{name} must name a dtype, got {getattr(self, name)!r}") from e

    @property
    def kv_heads(self) -> int:
        """Key/value heads ``K`` (``n_kv_heads``, or ``n_heads`` when unset)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads


def _paper(n_layers: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=49152,
        d_model=2048,
        n_layers=n_layers,
        n_heads=32,
        head_dim=64,
        d_ff=5632,
        max_seq_len=2048,
        dtype="bfloat16",
    )


# The paper's presets (docs/design.md, section 6, Model and training recipe) run in bf16;
# their non-gated variant uses f = 8192: dataclasses.replace(PRESETS["1.5b"], gated=False,
# d_ff=8192). "tiny" and "small" are byte-level (vocabulary of the 256 byte values, no
# special tokens) and train on CPU; "small" is the calibration model of that section.
PRESETS: dict[str, ModelConfig] = {
    "0.5b": _paper(8),
    "1b": _paper(18),
    "1.5b": _paper(28),
    "2b": _paper(38),
    "tiny": ModelConfig(vocab_size=256, d_model=128, n_layers=4, n_heads=4, head_dim=32, d_ff=352, max_seq_len=256),
    "small": ModelConfig(vocab_size=256, d_model=512, n_layers=8, n_heads=8, head_dim=64, d_ff=1408, max_seq_len=512),
}
