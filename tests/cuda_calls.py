"""The CUDA implementations called with plan options spelled as keywords, for tests.

Each builds the :class:`~jax_twell.ops.plan.LayerInfo` and the options a plan takes and
calls the implementation directly (no platform switch), with the bindings or the
stand-ins a test passes as ``kernels``.
"""

from jax_twell.ops.costs import DenseCrossover
from jax_twell.ops.ffn import cuda as ffn_cuda
from jax_twell.ops.ffn_train import vjp as train_cuda
from jax_twell.ops.plan import FFNOptions, Kernel, LayerInfo, Side, TrainOptions


def cuda_ffn(x, w_gate, w_up, w_down, *, tile=256, capacity=32, rule=None, kernel="auto", side=Side.AUTO,
             active_fraction=None, union_fraction=None, w_up_t=None, w_act_t=None, gate_variant=None,
             kernels=ffn_cuda.BINDINGS, device_backup=True):
    """``jax_twell.ops.ffn.cuda.sparse_ffn`` for ``x [M, d]``: ``y [M, d]``."""
    options = FFNOptions(tile=tile, capacity=capacity, kernel=kernel, rule=rule or DenseCrossover(),
                         gate_variant=gate_variant, device_backup=device_backup)
    layer = LayerInfo(active_fraction, union_fraction, side)
    return ffn_cuda.sparse_ffn(x, w_gate, w_up, w_down, layer=layer, options=options, w_up_t=w_up_t, w_act_t=w_act_t,
                               kernels=kernels)


def cuda_ffn_train(x, w_gate, w_up, w_down, *, width=128, backup_capacity=None, rule=None, side=Side.AUTO,
                   active_fraction=None, union_fraction=None, kernels=train_cuda.BINDINGS, **steps):
    """``jax_twell.ops.ffn_train.vjp.ffn_with_aux`` for ``x [M, d]``: ``(y, l1, counts, fired)``;
    ``steps``: :class:`~jax_twell.ops.plan.TrainOptions` step fields (``tensor_cores``, ...)."""
    options = TrainOptions(width=width, backup_capacity=backup_capacity, rule=rule, **steps)
    layer = LayerInfo(active_fraction, union_fraction, side)
    return train_cuda.ffn_with_aux(x, w_gate, w_up, w_down, layer=layer, options=options, kernels=kernels)
FUSED_KERNELS = tuple(k.value for k in Kernel if k is not Kernel.AUTO)  # the up + down kernels a plan may pick
