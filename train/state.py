"""Training state and its sharded initialisation.

The state is a plain pytree (`TrainState`) of the model's parameters as a pure dict, the
optimizer state, the step counter and the dead-neuron counters. Parameters are created
directly in their shards (jit with out_shardings), so no device ever holds a full copy
of a sharded weight. Optimizer moments take the sharding of the parameter they mirror.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_twell import FFNSharding
from jax_twell.models import ModelConfig, TransformerLM, param_shardings
from jax_twell.train import sharding
from jax_twell.train.dead_neurons import gate_weight_name


class TrainState(NamedTuple):
    """step: [] int32; params: pure dict of the model's nnx.Param values; opt_state: optax
    state; since_fired: [L, f] int32, steps since each FFN neuron last fired; ffn_sparse:
    [L] bool, the layers whose FFN is traced on the sparse training kernels
    (`jax_twell.train.ffn_paths`; all False unless the FFN runs on "cuda")."""

    step: jax.Array
    params: dict
    opt_state: Any
    since_fired: jax.Array
    ffn_sparse: jax.Array


@dataclasses.dataclass(frozen=True)
class ModelSetup:
    """Everything needed to build, shard and rebuild a model on a mesh.

    graphdef: the model's structure; rest: its non-parameter state (pure dict, replicated);
    state_shardings / abstract_state: `TrainState` trees of NamedSharding / sharded
    ShapeDtypeStruct (the restore target for checkpoints); init: () -> TrainState, jitted.
    """

    mesh: Mesh
    graphdef: Any
    rest: dict
    state_shardings: TrainState
    abstract_state: TrainState
    init: Any
    num_params: int
    num_layers: int
    d_ff: int

    def bind(self, params: dict) -> TransformerLM:
        """The model with `params` (inside jit: a traced, differentiable view)."""
        return nnx.merge(self.graphdef, params, self.rest)


def _split_model(model_cfg: ModelConfig, seed: int):
    return nnx.split(TransformerLM(model_cfg, rngs=nnx.Rngs(seed)), nnx.Param, ...)


def _opt_state_shardings(abstract_opt_state, params_shardings: dict, params_abstract: dict, mesh: Mesh):
    # Optimizer moments are params-shaped subtrees: a leaf whose key path ends with a
    # parameter's key path (and has its shape) takes that parameter's sharding.
    by_path = {
        jax.tree_util.keystr(path): (leaf.shape, shard)
        for (path, leaf), shard in zip(
            jax.tree_util.tree_flatten_with_path(params_abstract)[0], jax.tree.leaves(params_shardings)
        )
    }

    def pick(path, leaf):
        for start in range(len(path)):
            match = by_path.get(jax.tree_util.keystr(path[start:]))
            if match is not None and match[0] == leaf.shape:
                return match[1]
        return sharding.replicated(mesh)

    return jax.tree_util.tree_map_with_path(pick, abstract_opt_state)


def setup_model(
    model_cfg: ModelConfig, seed: int, tx: optax.GradientTransformation, mesh: Mesh, *, shard_tokens: bool = True
) -> ModelSetup:
    """Traces the model abstractly and prepares its sharded initialisation on `mesh`.

    The FFN ops run per shard (shard_map) with tokens split over (data, fsdp) and f over
    tensor; `shard_tokens=False` keeps tokens whole (generation, where one decoded token
    cannot be split). Call the returned `init` (and any step built on it) inside
    `sharding.mesh_context(mesh)`.
    """
    token_axes = sharding.BATCH_AXES if shard_tokens else ()
    model_cfg = dataclasses.replace(model_cfg, ffn_sharding=FFNSharding(token_axes=token_axes, tensor_axis="tensor"))
    abstract_model = nnx.eval_shape(lambda: TransformerLM(model_cfg, rngs=nnx.Rngs(seed)))
    params_shardings = nnx.to_pure_dict(param_shardings(abstract_model, mesh))
    with sharding.mesh_context(mesh):
        graphdef, abs_params, _ = nnx.split(abstract_model, nnx.Param, ...)
        abs_params = nnx.to_pure_dict(abs_params)
        num_layers = len(abs_params["layers"])
        first = min(abs_params["layers"], key=int)
        gate_name = gate_weight_name(abs_params["layers"][first]["ffn"])
        d_ff = abs_params["layers"][first]["ffn"][gate_name].shape[1]
        # The dead-neuron counters [L, f] follow the gate's sharding of f.
        gate_spec = params_shardings["layers"][first]["ffn"][gate_name].spec
        fired_sharding = NamedSharding(mesh, PartitionSpec(None, gate_spec[1] if len(gate_spec) > 1 else None))

        def init_state() -> TrainState:
            _, params, _ = _split_model(model_cfg, seed)
            params = nnx.to_pure_dict(params)
            return TrainState(
                jnp.int32(0),
                params,
                tx.init(params),
                jnp.zeros((num_layers, d_ff), jnp.int32),
                jnp.zeros((num_layers,), jnp.bool_),
            )

        abstract = jax.eval_shape(init_state)
        shardings = TrainState(
            sharding.replicated(mesh),
            params_shardings,
            _opt_state_shardings(abstract.opt_state, params_shardings, abs_params, mesh),
            fired_sharding,
            sharding.replicated(mesh),
        )
        abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
        rest = jax.jit(lambda: nnx.to_pure_dict(_split_model(model_cfg, seed)[2]), out_shardings=sharding.replicated(mesh))()
    return ModelSetup(
        mesh=mesh,
        graphdef=graphdef,
        rest=rest,
        state_shardings=shardings,
        abstract_state=abstract,
        init=jax.jit(init_state, out_shardings=shardings),
        num_params=sum(int(x.size) for x in jax.tree.leaves(abs_params)),
        num_layers=num_layers,
        d_ff=d_ff,
    )
