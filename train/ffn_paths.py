"""Per-layer sparse-or-dense choice of the CUDA training FFN, made at trace time.

With ``ffn_implementation="cuda"`` each layer's FFN either runs the training kernels or
plain XLA autodiff, chosen per layer from the layer's measured active fraction by the
training rule (``jax_twell.ops.cuda_train.TrainCrossover``). Deciding inside the step (a
per-call ``lax.cond``) would cost the dense side ~15% (ffi/notes/training_kernels.md);
deciding before tracing costs a re-jit each time a layer's choice flips, which happens
once or twice per layer in a run (dense from initialisation, sparse after the L1 warm-up).

The choice lives in ``TrainState.ffn_sparse`` ([L] bool, checkpointed): the step updates
it at log steps only, from that step's ``nnz_mean``, with 10% hysteresis; the loop reads
it after each log step and re-jits when it changed. A resumed run therefore traces the
same layers sparse as the run it continues.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jax_twell.ops import cuda_train
from jax_twell.train.sharding import BATCH_AXES

HYSTERESIS = 0.1  # a layer changes side only when a 10% denser (sparser) layer would too


@dataclasses.dataclass(frozen=True)
class PathRule:
    """What one FFN call sees on one device: ``m`` tokens, ``d`` features, ``f`` neurons."""

    m: int
    d: int
    f: int
    itemsize: int = 2  # bf16

    def next(self, sparse: jax.Array, active_fraction: jax.Array) -> jax.Array:
        """``[L]`` bool: the layers' sides after a log step that measured ``active_fraction``
        ``[L]``, from the current ``sparse`` ``[L]`` bool (traceable)."""
        rule = cuda_train.train_crossover()
        if not rule.sparse_can_win(self.m, self.d, self.f, self.itemsize):
            return jnp.zeros_like(sparse)

        def wins(fraction):
            return rule.use_sparse(fraction * (self.m * self.f), 0, self.m, self.d, self.f, self.itemsize)

        stay_sparse = wins(active_fraction * (1.0 - HYSTERESIS))
        go_sparse = wins(active_fraction * (1.0 + HYSTERESIS))
        return jnp.broadcast_to(jnp.where(sparse, stay_sparse, go_sparse), sparse.shape)


def enabled(model_cfg) -> bool:
    """True where the choice applies: the sparse FFN on the CUDA training kernels."""
    return model_cfg.ffn == "sparse_relu" and model_cfg.ffn_implementation == "cuda"


def path_rule(model_cfg, mesh, micro_batch: int, seq_len: int) -> PathRule:
    """The rule for one FFN call of a micro-batch: tokens split over the batch axes of
    ``mesh``, neurons over its tensor axis."""
    token_shards = 1
    for axis in BATCH_AXES:
        token_shards *= mesh.shape[axis]
    return PathRule(
        m=micro_batch * seq_len // token_shards,
        d=model_cfg.d_model,
        f=model_cfg.d_ff // mesh.shape["tensor"],
        itemsize=jnp.dtype(model_cfg.dtype).itemsize,
    )


def with_paths(setup, sparse: tuple[bool, ...]):
    """``setup`` whose model traces layer ``i``'s FFN on the kernels where ``sparse[i]``,
    as plain XLA autodiff elsewhere (``SparseFFN.active_fraction`` 0 or 1: the training
    op's trace-time choice). Call inside ``sharding.mesh_context(setup.mesh)``."""
    if len(sparse) != setup.num_layers:
        raise ValueError(f"one side per layer: got {len(sparse)} for {setup.num_layers} layers")
    model = nnx.merge(setup.graphdef, setup.abstract_state.params, setup.rest)
    for layer, is_sparse in zip(model.layers, sparse):
        layer.ffn.active_fraction = 0.0 if is_sparse else 1.0
    graphdef = nnx.split(model, nnx.Param, ...)[0]
    return dataclasses.replace(setup, graphdef=graphdef)


def describe(sparse: tuple[bool, ...]) -> str:
    """One console line: which layers run the kernels."""
    on = [i for i, s in enumerate(sparse) if s]
    return f"FFN on the sparse kernels in {len(on)}/{len(sparse)} layers" + (f": {on}" if on else "")
