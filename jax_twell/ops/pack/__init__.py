"""TwELL and hybrid packing: public functions (api) and the CUDA binding."""

from jax_twell.ops.pack.api import pack_hybrid, pack_twell

__all__ = ["pack_hybrid", "pack_twell"]
