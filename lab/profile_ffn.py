"""One call of the sparse FFN at a benchmark shape, for Nsight Compute (ncu) to profile.

Usage: ncu --kernel-name regex:Twell ... python lab/profile_ffn.py [--kernel blocked]
       [--m 16384] [--d 2048] [--f 5632] [--density 0.005] [--pattern uniform]
The call runs twice (compile, then the profiled run); ncu's --launch-skip can skip the first.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

from jax_twell.ops.ffn import cuda as ffn_cuda
from jax_twell.ops.plan import FFNOptions, Kernel, LayerInfo, Side
from jax_twell.testing import synthetic_ffn_inputs

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))  # common.py

from common import add_shape_arguments


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kernel", default="blocked", choices=[k.value for k in Kernel])
    add_shape_arguments(p, m=16384)
    a = p.parse_args()
    inp = synthetic_ffn_inputs(jax.random.key(0), a.m, a.d, a.f, density=a.density, pattern=a.pattern)
    op = jax.jit(
        lambda x, wg, wu, wd: ffn_cuda.sparse_ffn(
            x, wg, wu, wd, layer=LayerInfo(side=Side.SPARSE), options=FFNOptions(kernel=a.kernel),
        )
    )
    for _ in range(2):
        op(*inp).block_until_ready()


if __name__ == "__main__":
    main()
