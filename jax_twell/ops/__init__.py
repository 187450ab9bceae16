"""The ops: public functions (api), and their implementations (reference, xla, cuda)."""

from jax_twell.ops.api import gate_twell, pack_hybrid, pack_twell, sparse_ffn, sparse_ffn_train, twell_ffn
from jax_twell.ops.common import FFNAux
from jax_twell.ops.sharded import FFNSharding

__all__ = ["FFNAux", "FFNSharding", "gate_twell", "pack_hybrid", "pack_twell", "sparse_ffn", "sparse_ffn_train", "twell_ffn"]
