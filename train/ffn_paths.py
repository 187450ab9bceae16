"""Per-layer sparse-or-dense choice of the CUDA training FFN, made at trace time.

With ``ffn_implementation="cuda"`` each layer's FFN either runs the training kernels or
plain XLA autodiff, chosen per layer from the layer's measured active fraction by the
training rule (``jax_twell.ops.costs.TrainCrossover``). Deciding inside the step (a
per-call ``lax.cond``) would cost the dense side ~15% (ffi/notes/training_kernels.md);
deciding before tracing costs a re-jit each time a layer's choice flips, which happens
once or twice per layer in a run (dense from initialisation, sparse after the L1 warm-up).

The choice lives in ``TrainState.ffn_sparse`` ([L] bool, checkpointed). At log steps
only, the loop decides each layer's side from that step's ``nnz_mean`` and, where it could
change a side, each layer's mean union of active neurons over 64-token blocks, measured on
the step's first micro-batch (:func:`make_union_probe`: a dense forward plus one gate
matmul per layer), with 10% hysteresis (:meth:`PathRule.next`); it writes the register
and re-jits when a side changed (:func:`update_sides`). The union matters: the kernels'
union products read each block's union rows, and a trained layer's union is well below
the uniform pattern's at the same density, so such layers stay on the kernels to ~1.15%
active instead of ~0.85-0.9% (d=2048, f=5632, 16,384 tokens per call).
A resumed run traces the same layers sparse as the run it continues.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_twell.ops.costs import TrainCrossover
from jax_twell.ops.plan import Side, default_train_rule
from jax_twell.train import sharding
from jax_twell.train.sharding import BATCH_AXES

HYSTERESIS = 0.1  # a layer changes side only when a 10% denser (sparser) layer would too


@dataclasses.dataclass(frozen=True)
class PathRule:
    """What one FFN call sees on one device: ``m`` tokens, ``d`` features, ``f`` neurons."""

    m: int
    d: int
    f: int
    itemsize: int = 2  # bf16
    rule: TrainCrossover | None = None  # the training rule; None: the default for this shape

    def next(self, sparse: Sequence[bool], active_fraction: Sequence[float],
             union_fraction: Sequence[float] | None = None) -> tuple[bool, ...]:
        """The layers' sides after a log step that measured ``active_fraction`` ``[L]`` and
        (where given; NaN or None: unknown, the uniform pattern's is assumed) each layer's
        mean 64-token union ``union_fraction`` ``[L]``, from the current ``sparse`` ``[L]``.
        Host values (numbers, NumPy or fetched arrays)."""
        rule = self.rule or default_train_rule(self.m, self.d, self.f, self.itemsize)
        sparse = [bool(v) for v in np.asarray(sparse).reshape(-1)]
        fractions = np.asarray(active_fraction, np.float64).reshape(-1)
        unions = (np.full(len(sparse), np.nan) if union_fraction is None
                  else np.asarray(union_fraction, np.float64).reshape(-1))
        if not len(sparse) == len(fractions) == len(unions):
            raise ValueError(
                f"one value per layer: sides {len(sparse)}, fractions {len(fractions)}, unions {len(unions)}"
            )
        if not rule.sparse_can_win(self.m, self.d, self.f, self.itemsize):
            return (False,) * len(sparse)

        def wins(fraction, union, scale):
            clip = lambda v: min(max(v * scale, 0.0), 1.0)
            known = None if math.isnan(union) else clip(union)
            return rule.prefers_sparse(self.m, self.d, self.f, self.itemsize, clip(fraction), known)

        # a layer changes side only when a 10% denser (sparser) layer would too
        return tuple(bool(wins(p, u, 1.0 - HYSTERESIS) if s else wins(p, u, 1.0 + HYSTERESIS))
                     for s, p, u in zip(sparse, fractions, unions))


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
    as plain XLA autodiff elsewhere (``SparseFFN.side``: the training op's trace-time
    choice). Call inside ``sharding.mesh_context(setup.mesh)``."""
    if len(sparse) != setup.num_layers:
        raise ValueError(f"one side per layer: got {len(sparse)} for {setup.num_layers} layers")
    model = nnx.merge(setup.graphdef, setup.abstract_state.params, setup.rest)
    for layer, is_sparse in zip(model.layers, sparse):
        layer.ffn.side = Side.SPARSE if is_sparse else Side.DENSE
    graphdef = nnx.split(model, nnx.Param, ...)[0]
    return dataclasses.replace(setup, graphdef=graphdef)


def make_union_probe(setup):
    """Jitted ``probe(params, tokens [B, T + 1]) -> [L] f32``: each layer's mean union of
    active neurons over 64-token blocks, as a fraction of f (``TransformerLM.measure_ffn``
    on the inputs ``tokens[:, :-1]``). The model runs with every FFN dense (plain XLA, no
    kernels), plus one gate matmul per layer. Call inside ``sharding.mesh_context``."""
    dense = with_paths(setup, (False,) * setup.num_layers)

    def probe(params, tokens):
        return dense.bind(params).measure_ffn(tokens[:, :-1])[1]

    return jax.jit(
        probe,
        in_shardings=(setup.state_shardings.params, sharding.batch_sharding(setup.mesh, 2)),
        out_shardings=sharding.replicated(setup.mesh),
    )


def update_sides(state, setup, rule: PathRule, probe, tokens: jax.Array, nnz_mean) -> tuple:
    """At a log step: ``(state, sides, unions)`` with ``state.ffn_sparse`` set to the
    layers' new sides (a tuple of bools, also returned) from ``nnz_mean`` ``[L]`` (that
    step's, fetched) and each layer's union as ``probe`` measures it on ``tokens [B, T + 1]``
    (one micro-batch). The probe runs only when a union could change a side: the cost
    grows with the union, so if the sides are the same with no union at all and with the
    uniform pattern's (the largest a density has), they are the sides; ``unions`` is then
    None, else the measured ``[L]`` float64."""
    current = tuple(bool(v) for v in jax.device_get(state.ffn_sparse))
    fractions = np.asarray(nnz_mean, np.float64) / setup.d_ff
    sides, unions = rule.next(current, fractions), None
    if rule.next(current, fractions, np.zeros_like(fractions)) != sides:
        unions = np.asarray(jax.device_get(probe(state.params, tokens)), np.float64)
        sides = rule.next(current, fractions, unions)
    if sides != current:  # every process holds the same sides: build the array from them
        host = np.asarray(sides, bool)
        register = jax.make_array_from_callback(host.shape, setup.state_shardings.ffn_sparse, lambda index: host[index])
        state = state._replace(ffn_sparse=register)
    return state, sides, unions


def describe(sparse: tuple[bool, ...]) -> str:
    """One console line: which layers run the kernels."""
    on = [i for i, s in enumerate(sparse) if s]
    return f"FFN on the sparse kernels in {len(on)}/{len(sparse)} layers" + (f": {on}" if on else "")
