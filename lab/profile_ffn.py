"""One call of the sparse FFN at a benchmark shape, for Nsight Compute (ncu) to profile.

Usage: ncu --kernel-name regex:Twell ... python lab/profile_ffn.py [--kernel blocked]
       [--m 16384] [--d 2048] [--f 5632] [--density 0.005] [--pattern uniform]
The call runs twice (compile, then the profiled run); ncu's --launch-skip can skip the first.
"""

from __future__ import annotations

import argparse

import jax

from jax_twell.ops import cuda
from jax_twell.testing import synthetic_ffn_inputs

from common import add_shape_arguments


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kernel", default="blocked", choices=cuda.KERNELS)
    add_shape_arguments(p, m=16384)
    a = p.parse_args()
    inp = synthetic_ffn_inputs(jax.random.key(0), a.m, a.d, a.f, density=a.density, pattern=a.pattern)
    op = jax.jit(
        lambda x, wg, wu, wd: cuda.sparse_ffn(
            x, wg, wu, wd, tile=256, capacity=32, kernel=a.kernel,
            crossover=cuda.DenseCrossover(margin=float("inf")),
        )
    )
    for _ in range(2):
        op(*inp).block_until_ready()


if __name__ == "__main__":
    main()
