"""Logical axis names -> device mesh: default rules and parameter shardings."""

from __future__ import annotations

import flax.linen as nn
import jax
from flax import nnx

__all__ = ["LOGICAL_AXIS_RULES", "param_shardings"]

# Logical axis -> mesh axis rules for a mesh with axes ("data", "fsdp", "tensor") (any may
# have size 1). Parameters are sharded over "fsdp" along the model width and over
# "tensor" along heads / FFN neurons / vocabulary; the batch over "data" and "fsdp".
# The model code carries no sharding annotations of its own: build the mesh with
# jax.sharding.AxisType.Auto axes and let jit propagate shardings from the parameters.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("kv", None),
    ("vocab", "tensor"),
    ("norm", None),
)


def param_shardings(model: nnx.Module, mesh: jax.sharding.Mesh, rules=LOGICAL_AXIS_RULES) -> nnx.State:
    """``NamedSharding`` of every ``nnx.Param`` of ``model``, from its logical axis names.

    Args:
      model: any module built from ``jax_twell.modules.logical_param`` parameters (for
        example ``TransformerLM``, concrete or from ``nnx.eval_shape``).
      mesh: device mesh with every mesh axis the rules name.
      rules: ``(logical name, mesh axis or axes or None)`` pairs.
    Returns:
      ``nnx.State`` shaped like ``nnx.state(model, nnx.Param)``, each value a
      ``NamedSharding`` (use as ``jax.jit`` out_shardings, or with ``jax.device_put``).
    """
    # The logical names are mapped here, once: an active nnx.logical_axis_rules context
    # would otherwise map them already in get_partition_spec, and the second mapping
    # would turn every spec into P(None, ...).
    with nnx.logical_axis_rules(()):
        specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    return nn.logical_to_mesh_sharding(specs, mesh, rules)
