"""Flax Linen ``SparseFFN``: the NNX ``jax_twell.modules.SparseFFN`` for Linen models.

Same math, parameters, initialisation and logical axes (``nn.LogicallyPartitioned``
boxes; unbox with ``nn.meta.unbox`` or map to a mesh with ``nn.logical_to_mesh_sharding``)::

    w_gate  [d, f]  ("embed", "mlp")   std d**-0.5   (absent when non-gated)
    w_up    [d, f]  ("embed", "mlp")   std d**-0.5
    w_down  [f, d]  ("mlp", "embed")   std f**-0.5

The training call returns ``y`` and sows its ``FFNAux`` into the ``"intermediates"``
collection as ``"ffn_stats"`` (apply with ``mutable=["intermediates"]`` to read it; its
``l1`` is the differentiable L1 term, the per-token sum over ``f`` of ``|h|``, averaged
over tokens).
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_twell.modules import truncated_normal
from jax_twell.ops import FFNSharding, sparse_ffn, sparse_ffn_train
from jax_twell.ops.api import DEFAULT_WIDTH

__all__ = ["SparseFFN"]


def _init(std: float, axes: tuple[str, str]):
    return nn.with_logical_partitioning(lambda key, shape, dtype: truncated_normal(key, shape, std, dtype), axes)


class SparseFFN(nn.Module):
    """ReLU-gated (or non-gated ReLU) FFN on jax-twell's sparse ops.

    Attributes:
      d_ff: ``f``, hidden neurons (``d`` is taken from the input).
      gated: ``h = relu(x Wg) * (x Wu)`` when True, ``h = relu(x Wu)`` when False.
      implementation: passed to ``jax_twell.sparse_ffn_train`` / ``sparse_ffn``.
      width: ELL row width of the training format (see ``sparse_ffn_train``).
      sharding: ``jax_twell.FFNSharding`` for operands sharded over a mesh, else None.
      param_dtype: parameter dtype; compute runs in ``x.dtype``.
      deterministic: default of the call's ``deterministic`` (True: inference path).
    """

    d_ff: int
    gated: bool = True
    implementation: str | None = None
    width: int = DEFAULT_WIDTH
    sharding: FFNSharding | None = None
    param_dtype: jnp.dtype = jnp.float32
    deterministic: bool | None = None

    @nn.compact
    def __call__(
        self, x: jax.Array, *, deterministic: bool | None = None, inference: bool | None = None
    ) -> jax.Array:
        """``x [..., d]`` bf16/f32 -> ``y [..., d]`` of ``x.dtype``.

        ``deterministic=True`` (the call argument, else the attribute, as for Flax's
        ``Dropout``; default False) takes ``sparse_ffn``: the inference path, no
        statistics, nothing sown. Otherwise ``sparse_ffn_train``, sowing ``FFNAux`` as
        ``intermediates/ffn_stats``. ``inference=`` is the former name of
        ``deterministic=`` (deprecated; it still works).
        """
        if inference is not None:
            warnings.warn(
                "SparseFFN(...)(x, inference=...) is deprecated: pass deterministic=... (same meaning)",
                DeprecationWarning,
                stacklevel=2,
            )
            if deterministic is not None and bool(deterministic) != bool(inference):
                raise ValueError(f"deterministic={deterministic} and inference={inference} disagree; pass deterministic only")
            deterministic = inference
        if deterministic is None:
            deterministic = bool(self.deterministic)
        d, f = x.shape[-1], self.d_ff
        w_gate = (
            self.param("w_gate", _init(d**-0.5, ("embed", "mlp")), (d, f), self.param_dtype).astype(x.dtype)
            if self.gated
            else None
        )
        w_up = self.param("w_up", _init(d**-0.5, ("embed", "mlp")), (d, f), self.param_dtype).astype(x.dtype)
        w_down = self.param("w_down", _init(f**-0.5, ("mlp", "embed")), (f, d), self.param_dtype).astype(x.dtype)
        if deterministic:
            return sparse_ffn(x, w_gate, w_up, w_down, implementation=self.implementation, sharding=self.sharding)
        y, aux = sparse_ffn_train(
            x, w_gate, w_up, w_down, width=self.width, implementation=self.implementation, sharding=self.sharding
        )
        self.sow("intermediates", "ffn_stats", aux)
        return y
