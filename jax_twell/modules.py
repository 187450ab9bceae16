"""Flax NNX feed-forward blocks: ``SparseFFN`` (ReLU gate, sparse kernels) and ``DenseFFN``.

``SparseFFN`` is a drop-in replacement for a SwiGLU MLP whose gate uses ReLU, so that an L1
penalty on the hidden activations drives them to exact zeros; its math runs through
``jax_twell.sparse_ffn_train`` / ``jax_twell.sparse_ffn``. ``DenseFFN`` is the plain XLA
baseline (SiLU or ReLU gate) with the same interface and the same statistics, so
telemetry and the trainer treat both alike.

Math, per token row ``x`` (``d`` features, ``f`` hidden neurons)::

    gated:      h = act(x @ w_gate) * (x @ w_up)      y = h @ w_down
    non-gated:  h = act(x @ w_up)                     y = h @ w_down

``act`` is ReLU for ``SparseFFN``; ``DenseFFN`` takes ``activation="relu" | "silu"``.

Three entry points on both modules (same shapes: ``x [..., d]`` in, ``y [..., d]`` out,
dtype of ``x``):

- ``forward_with_stats(x) -> (y, FFNAux)``: the training forward; the L1 term
  ``aux.l1`` is differentiable (mean over tokens of the per-token *sum* over ``f`` of
  ``|h|``, the convention of the public training code; the paper's text writes a
  per-element mean, ``f`` times weaker).
- ``__call__(x) -> y``: the same training forward, recording its ``FFNAux`` with
  ``self.sow(nnx.Intermediate, "ffn_stats", aux)`` for code that expects a plain MLP
  (collect with ``y, inter = nnx.capture(model, nnx.Intermediate)(x)``; one ``FFNAux``
  per call in ``inter["ffn_stats"]``; outside a capture nothing is recorded).
- ``infer(x) -> y``: inference, no statistics (``jax_twell.sparse_ffn``): prefill and
  decode use this.

Parameter layout (``nnx.Param`` of ``param_dtype``, cast to the input dtype at use;
logical axis names in each Param's ``out_sharding`` metadata, not sharded eagerly: map
them to a mesh with rules such as ``jax_twell.models.LOGICAL_AXIS_RULES``)::

    w_gate  [d, f]  ("embed", "mlp")   None when non-gated
    w_up    [d, f]  ("embed", "mlp")
    w_down  [f, d]  ("mlp", "embed")

Initialisation: truncated normal (cut at 2 std, rescaled so the std is exact) with
std ``1/sqrt(fan_in)`` (LeCun normal): ``d**-0.5`` for ``w_gate`` and ``w_up``,
``f**-0.5`` for ``w_down``.

Telemetry: models stack each layer's ``FFNAux`` into ``FFNStats`` (``stack_stats``);
``summarize_stats`` turns either into Python floats for logging. All statistics come
out of the FFN's own pass over ``h``, cheap enough to leave on.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_twell.formats import relu_matmul
from jax_twell.ops import FFNAux, FFNSharding
from jax_twell.ops.common import finite_columns
from jax_twell.ops.ffn.api import sparse_ffn_for_layer
from jax_twell.ops.ffn_train.api import sparse_ffn_train_for_layer
from jax_twell.ops.plan import LayerInfo, Side, TrainOptions
from jax_twell.ops.stats import block_union_fraction, hidden_stats, make_aux, warp_layout_fit

__all__ = [
    "SparseFFN",
    "DenseFFN",
    "InferenceCache",
    "FFNAux",
    "FFNStats",
    "stack_stats",
    "summarize_stats",
    "logical_param",
    "truncated_normal",
]

# Standard deviation of a unit normal truncated to [-2, 2]: dividing by it makes the
# truncated draw's std exactly the one asked for.
_TRUNCATED_STD = 0.87962566103423978


def truncated_normal(key: jax.Array, shape: Sequence[int], std: float, dtype) -> jax.Array:
    """Normal draw truncated at +-2 std, rescaled so its std is exactly ``std``.

    Returns ``shape`` of ``dtype``.
    """
    draw = jax.random.truncated_normal(key, -2.0, 2.0, tuple(shape), jnp.float32)
    return (draw * (std / _TRUNCATED_STD)).astype(dtype)


def logical_param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    """``nnx.Param`` holding ``value`` with logical axis names ``axes`` (one per dim).

    The names live in the ``out_sharding`` metadata (``nnx.get_partition_spec`` reads
    them); eager sharding is off, so modules build anywhere and the trainer places
    parameters by mapping the names to mesh axes.
    """
    if len(axes) != value.ndim:
        raise ValueError(f"need one logical axis name per dimension of {value.shape}, got {axes}")
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class FFNStats(NamedTuple):
    """Per-layer FFN statistics of a model, each ``FFNAux`` field stacked on axis 0.

    Attributes:
      l1: ``[L]`` f32, per-layer L1 term (differentiable); the training loss adds
        ``l1_coef * l1.mean()``.
      nnz_mean: ``[L]`` f32, mean active neurons per token.
      nnz_max: ``[L]`` int32, max active neurons of any token.
      rows_over_capacity: ``[L]`` int32, tokens past the sparse format's row width.
      neuron_fired: ``[L, f]`` bool, neuron active for at least one token of the batch.
    """

    l1: jax.Array
    nnz_mean: jax.Array
    nnz_max: jax.Array
    rows_over_capacity: jax.Array
    neuron_fired: jax.Array


def stack_stats(auxes: Sequence[FFNAux]) -> FFNStats:
    """Stacks one ``FFNAux`` per layer (all with the same ``f``) into ``FFNStats``."""
    return FFNStats(*(jnp.stack(field) for field in zip(*auxes)))


def summarize_stats(stats: FFNStats | FFNAux) -> dict[str, float]:
    """Python floats for logging, overall and per layer (``layer{i}/...``).

    Keys: ``l1`` (mean over layers), ``nnz_mean`` (mean over layers), ``nnz_max`` (max
    over layers), ``active_fraction`` (``nnz_mean / f``), ``dead_fraction`` (mean over
    layers of the fraction of neurons that fired for no token), ``rows_over_capacity``
    (sum over layers); per layer ``nnz_mean``, ``nnz_max``, ``dead_fraction``,
    ``rows_over_capacity``. Dead fractions here are for the batch the stats came from;
    OR ``neuron_fired`` over steps for neurons dead across training.

    Args:
      stats: ``FFNStats`` (``[L]`` fields) or a single layer's ``FFNAux``.
    """
    host = jax.device_get(stats)
    l1 = np.atleast_1d(np.asarray(host.l1, np.float64))
    nnz_mean = np.atleast_1d(np.asarray(host.nnz_mean, np.float64))
    nnz_max = np.atleast_1d(np.asarray(host.nnz_max))
    over = np.atleast_1d(np.asarray(host.rows_over_capacity))
    fired = np.asarray(host.neuron_fired).reshape(len(l1), -1)
    dead = 1.0 - fired.mean(axis=1)
    summary = {
        "l1": float(l1.mean()),
        "nnz_mean": float(nnz_mean.mean()),
        "nnz_max": float(nnz_max.max()),
        "active_fraction": float(nnz_mean.mean() / fired.shape[1]),
        "dead_fraction": float(dead.mean()),
        "rows_over_capacity": float(over.sum()),
    }
    for i in range(len(l1)):
        summary[f"layer{i}/nnz_mean"] = float(nnz_mean[i])
        summary[f"layer{i}/nnz_max"] = float(nnz_max[i])
        summary[f"layer{i}/dead_fraction"] = float(dead[i])
        summary[f"layer{i}/rows_over_capacity"] = float(over[i])
    return summary


def _capturing(module: nnx.Module) -> bool:
    """Whether ``module`` runs inside ``nnx.capture`` (which gives each module of the call
    its collections), or the installed Flax predates ``nnx.capture`` (sowing is then the
    only way to record intermediates)."""
    return not hasattr(nnx, "capture") or hasattr(module, "__captures__")


class _FFN(nnx.Module):
    """Parameters and the sow-ing ``__call__`` shared by ``SparseFFN`` and ``DenseFFN``."""

    def __init__(self, d_model: int, d_ff: int, *, gated: bool, width: int, param_dtype, rngs: nnx.Rngs):
        self.d_model = d_model
        self.d_ff = d_ff
        self.gated = gated
        self.width = width

        def weight(shape, axes):
            return logical_param(truncated_normal(rngs.params(), shape, shape[0] ** -0.5, param_dtype), axes)

        self.w_gate = weight((d_model, d_ff), ("embed", "mlp")) if gated else None
        self.w_up = weight((d_model, d_ff), ("embed", "mlp"))
        self.w_down = weight((d_ff, d_model), ("mlp", "embed"))

    def _weights(self, dtype) -> tuple[jax.Array | None, jax.Array, jax.Array]:
        """(w_gate, w_up, w_down) cast to the compute ``dtype``."""
        w_gate = None if self.w_gate is None else self.w_gate[...].astype(dtype)
        return w_gate, self.w_up[...].astype(dtype), self.w_down[...].astype(dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Training forward ``y [..., d]`` for ``x [..., d]``; inside ``nnx.capture`` it sows
        ``FFNAux`` as ``ffn_stats``. Outside a capture nothing is recorded: the module's state
        stays its parameters (Flax deprecates sowing there, which stored the value on the
        module); with a Flax that has no ``nnx.capture``, it sows as that Flax does."""
        y, aux = self.forward_with_stats(x)
        if _capturing(self):
            self.sow(nnx.Intermediate, "ffn_stats", aux)
        return y


class InferenceCache(nnx.Variable):
    """Derived arrays kept for inference (not trained, not parameters): a snapshot of the
    weights it was made from."""


class SparseFFN(_FFN):
    """ReLU-gated (or non-gated ReLU) FFN on jax-twell's sparse ops.

    Args:
      d_model: ``d``, input and output features.
      d_ff: ``f``, hidden neurons.
      gated: ``h = relu(x Wg) * (x Wu)`` when True, ``h = relu(x Wu)`` when False.
      implementation: passed to ``jax_twell.sparse_ffn_train`` / ``sparse_ffn``
        (None picks CUDA kernels on GPU when available, else dense XLA math).
      width: ELL row width of the training format (``TrainOptions.width``); tokens with
        more active neurons count in ``rows_over_capacity``.
      sharding: ``jax_twell.FFNSharding`` to run the ops per shard of a device mesh
        (needed whenever the operands are sharded; None for unsharded use).
      param_dtype: parameter storage dtype (f32 default); compute runs in ``x.dtype``.
      active_fraction: this layer's expected fraction of active (token, neuron) pairs, a
        Python float or None (``LayerInfo.active_fraction``: with the "cuda"
        implementation the sparse-or-dense choice is then made per layer at trace time,
        and decode-sized inference calls may take the decode kernels). A plain attribute:
        set it from measured statistics (``FFNAux.nnz_mean / d_ff``, or
        ``TransformerLM.calibrate_ffn``) and re-jit when the layer's choice changes.
      union_fraction: this layer's measured mean union of active neurons over 64-token
        blocks as a fraction of f (a Python float or None; :meth:`block_union`, or
        ``TransformerLM.calibrate_ffn``); with ``active_fraction`` it prices the union
        kernels at trace time. A plain attribute, like ``active_fraction``.
      overflow_fraction, kept_fraction: this layer's measured fraction of tokens past the
        warp kernel's layout, and of (token, neuron) pairs in the tokens that fit it
        (Python floats or None; :meth:`layout_stats`, or ``TransformerLM.calibrate_ffn``):
        with ``active_fraction`` they price that kernel and its dense backup at trace
        time (``LayerInfo``). Plain attributes, like ``active_fraction``.
      side: ``jax_twell.ops.plan.Side``: a side decided for the layer (the trainer's
        per-layer choice, ``jax_twell.train.ffn_paths``); AUTO lets the ops decide.
      rngs: ``nnx.Rngs`` with a ``params`` stream.

    See the module docstring for the parameter layout, initialisation and entry points.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        gated: bool = True,
        implementation: str | None = None,
        width: int = TrainOptions.width,
        sharding: FFNSharding | None = None,
        param_dtype=jnp.float32,
        active_fraction: float | None = None,
        union_fraction: float | None = None,
        side: Side = Side.AUTO,
        overflow_fraction: float | None = None,
        kept_fraction: float | None = None,
        rngs: nnx.Rngs,
    ):
        super().__init__(d_model, d_ff, gated=gated, width=width, param_dtype=param_dtype, rngs=rngs)
        self.implementation = implementation
        self.sharding = sharding
        self.active_fraction = active_fraction
        self.union_fraction = union_fraction
        self.side = side
        self.overflow_fraction = overflow_fraction
        self.kept_fraction = kept_fraction
        self.w_up_t: InferenceCache | None = nnx.data(None)  # data, not structure: set later
        self.w_act_t: InferenceCache | None = nnx.data(None)
        self.weights_finite: InferenceCache | None = nnx.data(None)

    def cache_transposed_up_weight(self, dtype=jnp.bfloat16) -> None:
        """Keeps ``w_up.T`` ``[f, d]`` in ``dtype`` (an ``InferenceCache``) for ``infer``:
        the layout the CUDA kernels read, which they would otherwise transpose in every
        call (at decode sizes that costs more than the kernels save). A snapshot: call it
        again after the weights change (training does not update it), or
        :meth:`clear_inference_cache`. No effect on the training forward."""
        if self.gated:
            self.w_up_t = nnx.data(InferenceCache(self.w_up[...].T.astype(dtype)))
        self._cache_finite(dtype)

    def cache_transposed_activation_weight(self, dtype=jnp.bfloat16) -> None:
        """Keeps the activation's weight transposed (``w_gate.T`` gated, ``w_up.T``
        non-gated), ``[f, d]`` in ``dtype``, for ``infer``: with it (and, gated, the
        transposed up weight of :meth:`cache_transposed_up_weight`) and a known
        ``active_fraction``, single-token calls on the CUDA kernels run the decode rows
        kernel (``jax_twell.ops.ffn.binding.decode_ffn_rows``), measured ~5-35% faster than the
        other decode path at one token. Costs one more ``d x f`` copy. A snapshot, as the
        up weight's."""
        w_act = self.w_gate if self.gated else self.w_up
        self.w_act_t = nnx.data(InferenceCache(w_act[...].T.astype(dtype)))
        self._cache_finite(dtype)

    def _cache_finite(self, dtype) -> None:
        """Keeps which output columns the up and down weights (in ``dtype``) leave finite
        (``jax_twell.ops.common.finite_columns``), so that inference checks only x for the
        dense formula's NaN and Inf."""
        w_up = self.w_up[...].astype(dtype) if self.gated else None
        w_act = (self.w_gate if self.gated else self.w_up)[...].astype(dtype)
        self.weights_finite = nnx.data(InferenceCache(finite_columns(w_up, self.w_down[...].astype(dtype), w_act)))

    def clear_inference_cache(self) -> None:
        """Drops what :meth:`cache_transposed_up_weight` and
        :meth:`cache_transposed_activation_weight` kept."""
        self.w_up_t = nnx.data(None)
        self.w_act_t = nnx.data(None)
        self.weights_finite = nnx.data(None)

    def forward_with_stats(self, x: jax.Array) -> tuple[jax.Array, FFNAux]:
        """Training forward: ``x [..., d]`` bf16/f32 -> ``(y [..., d] x.dtype, FFNAux)``."""
        layer = LayerInfo(self.active_fraction, None if self.active_fraction is None else self.union_fraction,
                          self.side)
        return sparse_ffn_train_for_layer(
            x,
            *self._weights(x.dtype),
            layer=layer,
            options=TrainOptions(width=self.width),
            implementation=self.implementation,
            sharding=self.sharding,
        )

    def block_union(self, x: jax.Array) -> jax.Array:
        """``[]`` f32: the mean union of active neurons over 64-token blocks of ``x [..., d]``
        (tokens in order, leading dimensions flattened), as a fraction of f: what the
        ``union_fraction`` attribute wants (``jax_twell.ops.stats.block_union_fraction`` of
        ``relu(x @ w_act)``; pure JAX, one extra gate matmul)."""
        return block_union_fraction(self._gate(x))

    def layout_stats(self, x: jax.Array) -> jax.Array:
        """``[3]`` f32 of the gate activation ``relu(x @ w_act)`` for ``x [..., d]`` (tokens
        in order, leading dimensions flattened; one extra gate matmul): the mean 64-token
        union (as :meth:`block_union`), the fraction of tokens past the warp kernel's
        layout and the fraction of (token, neuron) pairs in the tokens that fit it
        (``jax_twell.ops.stats.warp_layout_fit``): what the ``union_fraction``,
        ``overflow_fraction`` and ``kept_fraction`` attributes want."""
        g = self._gate(x)
        return jnp.concatenate([block_union_fraction(g)[None], warp_layout_fit(g)])

    def _gate(self, x: jax.Array) -> jax.Array:
        w_gate, w_up, _ = self._weights(x.dtype)
        return relu_matmul(x.reshape(-1, x.shape[-1]), w_up if w_gate is None else w_gate)

    def layer_info(self) -> LayerInfo:
        """What the inference ops are told of this layer: its attributes (the measured
        fractions count only with ``active_fraction``)."""
        return LayerInfo(self.active_fraction, self.union_fraction, self.side,
                         overflow_fraction=self.overflow_fraction, kept_fraction=self.kept_fraction)

    def infer(self, x: jax.Array) -> jax.Array:
        """Inference forward, no statistics: ``x [..., d]`` -> ``y [..., d]`` of ``x.dtype``."""
        cached = lambda c: None if c is None else c[...].astype(x.dtype)
        return sparse_ffn_for_layer(
            x,
            *self._weights(x.dtype),
            layer=self.layer_info(),
            w_up_t=cached(self.w_up_t),
            w_act_t=cached(self.w_act_t),
            weights_finite=None if self.weights_finite is None else self.weights_finite[...],
            implementation=self.implementation,
            sharding=self.sharding,
        )


class DenseFFN(_FFN):
    """Dense FFN baseline through XLA, gate ``silu`` (SwiGLU) or ``relu``.

    Same parameters, entry points and statistics as ``SparseFFN``: a neuron is active
    where ``act(pre-activation) != 0``, which for SiLU is (almost) every neuron, and
    ``rows_over_capacity`` counts rows past ``width``, the sparse format's row width.

    Args:
      d_model, d_ff, gated, width, param_dtype, rngs: as ``SparseFFN``.
      activation: ``"silu"`` or ``"relu"``.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        gated: bool = True,
        activation: str = "silu",
        width: int = TrainOptions.width,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        if activation not in ("silu", "relu"):
            raise ValueError(f"DenseFFN activation must be 'silu' or 'relu', got {activation!r}")
        super().__init__(d_model, d_ff, gated=gated, width=width, param_dtype=param_dtype, rngs=rngs)
        self.activation = activation

    def _hidden(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(h [..., f], active [..., f] bool)`` for ``x [..., d]``; h in ``x.dtype``."""
        w_gate, w_up, _ = self._weights(x.dtype)
        act = jax.nn.relu if self.activation == "relu" else jax.nn.silu
        # Matmuls in x.dtype (f32 accumulation inside XLA), so that their backward stays in
        # bf16 too; the activation is evaluated in f32.
        pre = jnp.matmul(x, w_up if w_gate is None else w_gate)
        g = act(pre.astype(jnp.float32)).astype(x.dtype)
        if w_gate is None:
            return g, g != 0
        u = jnp.matmul(x, w_up)
        return g * u, g != 0

    def _down(self, h: jax.Array, dtype) -> jax.Array:
        return jnp.matmul(h, self.w_down[...].astype(dtype))

    def forward_with_stats(self, x: jax.Array) -> tuple[jax.Array, FFNAux]:
        """Training forward: ``x [..., d]`` bf16/f32 -> ``(y [..., d] x.dtype, FFNAux)``."""
        h, active = self._hidden(x)
        f = h.shape[-1]
        stats = hidden_stats(h.reshape(-1, f), active.reshape(-1, f))
        return self._down(h, x.dtype), make_aux(*stats, self.width)

    def infer(self, x: jax.Array) -> jax.Array:
        """Inference forward: ``x [..., d]`` -> ``y [..., d]`` of ``x.dtype``."""
        return self._down(self._hidden(x)[0], x.dtype)
