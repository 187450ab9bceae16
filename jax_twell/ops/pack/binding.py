"""CUDA binding of the TwELL pack kernel (ffi/twell_pack.cu): a thin ``jax.ffi.ffi_call`` wrapper."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_twell._kernels import kernel_call
from jax_twell.formats import TwELL

__all__ = ["pack_twell"]


def pack_twell(a: jax.Array, *, tile: int, capacity: int, skip: jax.Array | None = None) -> TwELL:
    """TwELL packing of ``a [..., f]`` (bf16, f16 or f32) by ``jax_twell_pack``; the same
    arrays as :func:`jax_twell.formats.pack_twell_reference`, bit for bit. ``skip``: a
    device bool (``jax_twell_pack_unless``); where set the kernel writes zero counts and
    returns (values and columns hold anything): for a call whose dense side was chosen on
    the device (:func:`jax_twell.ops.ffn.warp.sparse_ffn`'s device choice), whose backup
    then lists no row."""
    f = a.shape[-1]
    n_tiles = -(-f // tile)
    lead = a.shape[:-1]
    out_types = (
        jax.ShapeDtypeStruct((*lead, n_tiles, capacity), a.dtype),
        jax.ShapeDtypeStruct((*lead, n_tiles, capacity), jnp.int16),
        jax.ShapeDtypeStruct((*lead, n_tiles), jnp.int32),
    )
    attrs = dict(tile=np.int32(tile), capacity=np.int32(capacity))
    if skip is None:
        # The handler flattens leading dimensions, so a vmapped call is one launch.
        values, cols, counts = kernel_call("jax_twell_pack", out_types, vmap_method="broadcast_all")(a, **attrs)
    else:
        values, cols, counts = kernel_call("jax_twell_pack_unless", out_types, vmap_method="sequential")(
            a, jnp.asarray(skip).astype(jnp.int32), **attrs)
    return TwELL(values, cols, counts, f=f, tile=tile)
