"""CUDA implementations: thin ``jax.ffi.ffi_call`` wrappers over the registered handlers.

Each wrapper builds the call for operands already validated by the public API; the
handlers re-check shapes and fail with an InvalidArgument naming the constraint.
Attributes are numpy scalars of the declared type (a Python float would arrive as F64).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_twell.formats import TwELL

__all__ = ["pack_twell"]


def pack_twell(a: jax.Array, *, tile: int, capacity: int) -> TwELL:
    """TwELL packing of ``a [..., f]`` by the ``jax_twell_pack`` kernel (see formats.TwELL)."""
    f = a.shape[-1]
    n_tiles = -(-f // tile)
    lead = a.shape[:-1]
    out_types = (
        jax.ShapeDtypeStruct((*lead, n_tiles, capacity), a.dtype),
        jax.ShapeDtypeStruct((*lead, n_tiles, capacity), jnp.int16),
        jax.ShapeDtypeStruct((*lead, n_tiles), jnp.int32),
    )
    # The handler flattens leading dimensions, so a vmapped call is one launch.
    call = jax.ffi.ffi_call("jax_twell_pack", out_types, vmap_method="broadcast_all")
    values, cols, counts = call(a, tile=np.int32(tile), capacity=np.int32(capacity))
    return TwELL(values, cols, counts, f=f, tile=tile)
