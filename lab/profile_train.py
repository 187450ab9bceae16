"""One forward + backward of the CUDA training FFN at a benchmark shape, for Nsight Compute.

Usage: ncu --kernel-name regex:Twell ... python lab/profile_train.py [--m 16384]
       [--d 2048] [--f 5632] [--density 0.005] [--pattern uniform] [--nongated] [--cudacore-dx]
The step runs twice (compile, then the profiled run); the kernels of one step are the
second half of what ncu lists (or skip the first step's with --launch-skip).
Nsight Compute does not profile kernels inside CUDA graphs with conditional nodes: run with
XLA_FLAGS=--xla_gpu_graph_min_graph_size=100000 (no graphs for the step's small sequences).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

from jax_twell.ops.ffn_train import vjp as train_cuda
from jax_twell.ops.plan import LayerInfo, Side, TrainOptions
from jax_twell.testing import synthetic_ffn_inputs

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))  # common.py

from common import add_shape_arguments


def main():
    p = argparse.ArgumentParser()
    add_shape_arguments(p, m=16384)
    p.add_argument("--nongated", action="store_true")
    p.add_argument("--cudacore-dx", action="store_true", help="dx on CUDA cores (TrainOptions(dx_tensor_cores=False)); default: the defaults")
    a = p.parse_args()
    inp = synthetic_ffn_inputs(jax.random.key(0), a.m, a.d, a.f, density=a.density, pattern=a.pattern)
    w_gate = None if a.nongated else inp.w_gate
    options = TrainOptions(dx_tensor_cores=False if a.cudacore_dx else None)

    # A random cotangent, as bench_training.py's step takes (a sum's ones would make the
    # backward materialise a broadcast that a training loss does not have).
    cot = jax.random.normal(jax.random.key(1), inp.x.shape, jnp.float32)

    def loss(x, wg, wu, wd):
        y, l1 = train_cuda.ffn_with_aux(x, wg, wu, wd, layer=LayerInfo(side=Side.SPARSE), options=options)[:2]
        return jnp.sum(y.astype(jnp.float32) * cot) + 2e-5 * l1

    # The loss and every gradient a training step takes, as a training loop takes them
    # (value_and_grad: the forward's y is needed): x, the weights (the gate's only when gated).
    step = jax.jit(jax.value_and_grad(loss, (0, 2, 3) if w_gate is None else (0, 1, 2, 3)))
    for _ in range(2):
        jax.block_until_ready(step(inp.x, w_gate, inp.w_up, inp.w_down))


if __name__ == "__main__":
    main()
