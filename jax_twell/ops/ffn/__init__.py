"""The inference FFN ops: public functions (api), pure-JAX reference, CUDA binding, the
CUDA implementation that runs a plan, and its VJP."""

from jax_twell.ops.ffn.api import gate_twell, sparse_ffn, sparse_ffn_for_layer, twell_ffn

__all__ = ["gate_twell", "sparse_ffn", "sparse_ffn_for_layer", "twell_ffn"]
