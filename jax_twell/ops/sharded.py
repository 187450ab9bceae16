"""Running the FFN ops per shard of a device mesh.

XLA cannot partition a custom call, so a kernel given globally sharded operands would
see them gathered. With an :class:`FFNSharding`, the ops run their implementation under
``jax.shard_map`` instead: each device computes on its local tokens (data parallel) and
its local slice of the ``f`` hidden neurons (tensor parallel: local sparse activation,
partial outputs summed over the tensor axis). Statistics are combined exactly across
shards (per-token counts are summed over the tensor axis before mean and max).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_twell.ops.stats import FFNAux

__all__ = ["FFNSharding", "shard_ffn", "shard_ffn_train"]


@dataclasses.dataclass(frozen=True)
class FFNSharding:
    """Layout of the FFN operands over a device mesh.

    Attributes:
      token_axes: mesh axes splitting the tokens of ``x`` (its leading dimensions,
        flattened), e.g. ``("data", "fsdp")``; ``()`` for none.
      tensor_axis: mesh axis splitting the hidden width ``f`` (columns of w_gate and w_up,
        rows of w_down), or None.
      mesh: the ``jax.sharding.Mesh``; None uses the context mesh (``jax.set_mesh``).

    Token count must divide by the product of the token axes' sizes, and f by the tensor
    axis size; shard_map raises naming the mismatch otherwise.
    """

    token_axes: tuple[str, ...] = ()
    tensor_axis: str | None = None
    mesh: jax.sharding.Mesh | None = None

    def __post_init__(self):
        if isinstance(self.token_axes, str):
            object.__setattr__(self, "token_axes", (self.token_axes,))
        if self.tensor_axis is not None and self.tensor_axis in self.token_axes:
            raise ValueError(f"tensor_axis {self.tensor_axis!r} is also a token axis")

    def _specs(self, gated: bool):
        tokens = P(self.token_axes or None, None)
        columns = P(None, self.tensor_axis)
        rows = P(self.tensor_axis, None)
        weights = (columns, columns, rows) if gated else (columns, rows)
        return tokens, weights

    def tensor_shards(self) -> int:
        """How many shards split f: the size of ``tensor_axis`` in the mesh (the context
        mesh where ``mesh`` is None), 1 without a tensor axis."""
        if self.tensor_axis is None:
            return 1
        mesh = self.mesh if self.mesh is not None else jax.sharding.get_abstract_mesh()
        if self.tensor_axis not in mesh.axis_names:
            raise ValueError(f"tensor_axis {self.tensor_axis!r} is not an axis of the mesh {dict(mesh.shape)}")
        return mesh.shape[self.tensor_axis]

    def _map(self, body, in_specs, out_specs):
        kwargs = {} if self.mesh is None else {"mesh": self.mesh}
        # check_vma keeps collective transposes exact under autodiff (a psum's transpose
        # must not sum a replicated cotangent again).
        return jax.shard_map(body, in_specs=in_specs, out_specs=out_specs, **kwargs)


def _pack_weights(w_gate, w_up, w_down):
    return (w_up, w_down) if w_gate is None else (w_gate, w_up, w_down)


def _unpack_weights(ws):
    return (None, *ws) if len(ws) == 2 else ws


def shard_ffn(fn: Callable, sharding: FFNSharding, x, w_gate, w_up, w_down, *, weights_finite=None, **by_neuron):
    """Runs ``fn(x, w_gate, w_up, w_down, *by_neuron.values(), ok) -> y`` per shard;
    ``x: [M, d]``. ``by_neuron``: optional ``[f, d]`` weight copies (``w_up_t``,
    ``w_act_t``), split like ``w_down``; passed positionally, in the order given, None
    where not given. ``weights_finite``: the whole weights' ``[d]`` finite columns
    (:func:`jax_twell.ops.common.finite_columns`), passed to every shard as ``ok`` where f
    is not split (:meth:`FFNSharding.tensor_shards` is 1: each shard holds the whole
    weights, so they are its own flags); None otherwise, where each shard checks its own
    slice (a column the other slices make +-Inf must not read NaN in this one's partial)."""
    tokens, weights = sharding._specs(w_gate is not None)
    names = [name for name, w in by_neuron.items() if w is not None]
    ok = weights_finite if weights_finite is not None and sharding.tensor_shards() == 1 else None

    def body(x, *ws):
        local_ok = None
        if ok is not None:
            ws, local_ok = ws[:-1], ws[-1]
        n = len(ws) - len(names)
        local = dict(zip(names, ws[n:]))
        y = fn(x, *_unpack_weights(ws[:n]), *(local.get(name) for name in by_neuron), local_ok)
        if sharding.tensor_axis is not None:
            y = jax.lax.psum(y.astype(jnp.float32), sharding.tensor_axis).astype(y.dtype)
        return y

    specs = (tokens, *weights) + tuple(P(sharding.tensor_axis, None) for _ in names) + ((P(None),) if ok is not None else ())
    operands = (x, *_pack_weights(w_gate, w_up, w_down), *(by_neuron[n] for n in names)) + ((ok,) if ok is not None else ())
    return sharding._map(body, specs, tokens)(*operands)


def shard_ffn_train(fn: Callable, sharding: FFNSharding, width: int, x, w_gate, w_up, w_down):
    """Runs ``fn(...) -> (y, l1, counts, fired)`` per shard and combines the statistics.

    Returns ``(y [M, d], FFNAux)`` as the unsharded op does.
    """
    tokens, weights = sharding._specs(w_gate is not None)
    tensor, token_axes = sharding.tensor_axis, sharding.token_axes

    def body(x, *ws):
        y, l1, counts, fired = fn(x, *_unpack_weights(ws))
        if tensor is not None:
            y = jax.lax.psum(y.astype(jnp.float32), tensor).astype(y.dtype)
            l1 = jax.lax.psum(l1, tensor)
            counts = jax.lax.psum(counts, tensor)
        nnz_mean = counts.astype(jnp.float32).mean()
        nnz_max = counts.max(initial=0)
        over = (counts > width).sum(dtype=jnp.int32)
        fired = fired.astype(jnp.int32)
        if token_axes:
            l1 = jax.lax.pmean(l1, token_axes)
            nnz_mean = jax.lax.pmean(nnz_mean, token_axes)
            nnz_max = jax.lax.pmax(nnz_max, token_axes)
            over = jax.lax.psum(over, token_axes)
            fired = jax.lax.psum(fired, token_axes)
        return y, FFNAux(l1, nnz_mean, nnz_max, over, fired > 0)

    out_specs = (tokens, FFNAux(P(), P(), P(), P(), P(tensor)))
    return sharding._map(body, (tokens, *weights), out_specs)(x, *_pack_weights(w_gate, w_up, w_down))
