"""Public training op: ``sparse_ffn_train``.

``implementation=``: "reference" (hybrid format, sparse custom_vjp backward in pure JAX),
"xla" (dense, JAX autodiff), "cuda" (the training kernels) or None ("cuda" on CUDA
devices where the kernels are available and take d, else "xla"; chosen per lowering
platform). How a "cuda" call is decided: :func:`jax_twell.ops.plan.plan_ffn_train` (the
plan), run by :mod:`jax_twell.ops.ffn_train.vjp` on the bindings of
:mod:`jax_twell.ops.ffn_train.binding`.
"""

from __future__ import annotations

import functools

import jax

from jax_twell.ops import layout, xla
from jax_twell.ops.common import check_ffn_args, choose, flatten_tokens
from jax_twell.ops.ffn_train import cpu, reference, vjp
from jax_twell.ops.pack.api import check_hybrid_layout
from jax_twell.ops.plan import LayerInfo, TrainOptions
from jax_twell.ops.sharded import FFNSharding, shard_ffn_train
from jax_twell.ops.stats import FFNAux, make_aux

__all__ = ["sparse_ffn_train", "sparse_ffn_train_for_layer"]


def sparse_ffn_train(
    x: jax.Array, w_gate: jax.Array | None, w_up: jax.Array, w_down: jax.Array, *,
    implementation: str | None = None, sharding: FFNSharding | None = None,
) -> tuple[jax.Array, FFNAux]:
    """Training FFN: output, L1 term and sparsity statistics, differentiable.

    Same math as :func:`jax_twell.sparse_ffn`. The L1 term is ``mean over tokens of sum_f
    |h|`` (the per-token sum; the paper's per-element mean is f times weaker); add
    ``coefficient * aux.l1`` to the loss. Gradients equal ``jax.grad`` of the dense
    formula plus that term.

    Args:
      x: ``[..., d]`` bf16 or f32.  w_gate: ``[d, f]`` or None (non-gated).
      w_up: ``[d, f]``.  w_down: ``[f, d]``; all x's dtype.
      implementation: "reference", "xla", "cuda" (training kernels on the blocked TwELL
        layout, sparse residuals, sparse or dense chosen per call on the device; d a
        multiple of 64; f32 runs dense) or None ("cuda" where available, else "xla").
      sharding: run per shard of a device mesh (see :class:`jax_twell.FFNSharding`);
        statistics are combined exactly across shards.
    Returns:
      ``(y [..., d], FFNAux)``; ``aux.rows_over_capacity`` counts the tokens past the hybrid
      format's row width (128 entries).
    """
    return sparse_ffn_train_for_layer(x, w_gate, w_up, w_down, implementation=implementation, sharding=sharding)


def sparse_ffn_train_for_layer(
    x: jax.Array, w_gate: jax.Array | None, w_up: jax.Array, w_down: jax.Array, *, layer: LayerInfo = LayerInfo(),
    options: TrainOptions = TrainOptions(), implementation: str | None = None, sharding: FFNSharding | None = None,
) -> tuple[jax.Array, FFNAux]:
    """:func:`sparse_ffn_train` given what is known about the layer (internal entry point).

    ``layer``: the layer's measured fractions or decided side
    (:class:`jax_twell.ops.plan.LayerInfo`: with a known fraction "cuda" decides sparse
    or dense at trace time, and the dense side is plain XLA autodiff); ``options``: the
    hybrid row width and backup, the cost model and the kernels' step variants
    (:class:`jax_twell.ops.plan.TrainOptions`; width and backup also shape "reference").
    Shapes and result as :func:`sparse_ffn_train`.
    """
    check_ffn_args(x, w_gate, w_up, w_down)
    check_hybrid_layout(options.width, options.backup_capacity)
    kernels = dict(
        reference=functools.partial(reference.ffn_with_aux, width=options.width,
                                    backup_capacity=options.backup_capacity),
        xla=xla.ffn_with_aux,
        cpu=functools.partial(cpu.ffn_with_aux, layer=layer),
    )
    if implementation == "cuda" or layout.train_supported(x.shape[-1]):
        kernels["cuda"] = functools.partial(vjp.ffn_with_aux, layer=layer, options=options)
    fn = choose("sparse_ffn_train", implementation, kernels, "xla")
    x2, lead = flatten_tokens(x)
    if sharding is not None:
        y, aux = shard_ffn_train(fn, sharding, options.width, x2, w_gate, w_up, w_down)
    else:
        y, l1, counts, fired = fn(x2, w_gate, w_up, w_down)
        aux = make_aux(l1, counts, fired, options.width)
    return y.reshape(*lead, x.shape[-1]), aux
