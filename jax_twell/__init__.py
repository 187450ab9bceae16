"""jax-twell: sparse feed-forward blocks for JAX/Flax transformers.

A ReLU-gated FFN trained with a small L1 penalty on its hidden activations becomes over
99% sparse; jax-twell stores those activations in the TwELL (inference) and hybrid
(training) formats and computes the FFN on them with CUDA kernels exposed as XLA FFI
custom calls, with pure-JAX references that run anywhere.
"""

from jax_twell._cpu import CpuKernelStatus, cpu_kernel_status, cpu_kernels_available
from jax_twell._kernels import KernelStatus, kernel_status, kernels_available
from jax_twell.formats import Hybrid, TwELL
from jax_twell.ops import FFNAux, FFNSharding, gate_twell, pack_hybrid, pack_twell, sparse_ffn, sparse_ffn_train, twell_ffn

__version__ = "0.1.0"

__all__ = [
    "CpuKernelStatus",
    "FFNAux",
    "FFNSharding",
    "Hybrid",
    "KernelStatus",
    "TwELL",
    "cpu_kernel_status",
    "cpu_kernels_available",
    "gate_twell",
    "kernel_status",
    "kernels_available",
    "pack_hybrid",
    "pack_twell",
    "sparse_ffn",
    "sparse_ffn_train",
    "twell_ffn",
]
