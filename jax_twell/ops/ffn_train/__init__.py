"""The training FFN op: public function (api), pure-JAX reference, CUDA binding, and the
CUDA implementation's custom VJP that runs a plan."""

from jax_twell.ops.ffn_train.api import sparse_ffn_train, sparse_ffn_train_for_layer

__all__ = ["sparse_ffn_train", "sparse_ffn_train_for_layer"]
