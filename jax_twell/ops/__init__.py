"""The ops, one folder per family: ``ffn`` (inference: gate_twell, twell_ffn, sparse_ffn),
``ffn_train`` (sparse_ffn_train), ``pack`` (pack_twell, pack_hybrid). Each holds its
public functions (api.py), pure-JAX reference, CUDA binding and VJP; the kernels' layout
constants are in layout.py, the plans (which kernels a call runs) in plan.py with the
cost models in costs.py, statistics in stats.py, the dense baseline in xla.py."""

from jax_twell.ops.ffn import gate_twell, sparse_ffn, twell_ffn
from jax_twell.ops.ffn_train import sparse_ffn_train
from jax_twell.ops.pack import pack_hybrid, pack_twell
from jax_twell.ops.sharded import FFNSharding
from jax_twell.ops.stats import FFNAux

__all__ = ["FFNAux", "FFNSharding", "gate_twell", "pack_hybrid", "pack_twell", "sparse_ffn", "sparse_ffn_train", "twell_ffn"]
