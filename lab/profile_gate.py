"""One call of each gate variant for Nsight Compute: XLA's relu(x @ w), XLA's matmul +
the pack kernel, and the fused gate kernel with each variant code given (ffi/twell_gate.cu).

Usage: ncu --kernel-name regex:"gemm|device_kernel|Pack" python lab/profile_gate.py [--variants 0,1] [shape options]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

from jax_twell.formats import relu_matmul
from jax_twell.ops.ffn import binding
from jax_twell.ops.pack import binding as pack_binding
from jax_twell.testing import synthetic_ffn_inputs

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))  # common.py

from common import add_shape_arguments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser, m=16384)
    parser.add_argument("--variants", type=lambda v: [int(c) for c in v.split(",") if c], default=[0, 1])
    args = parser.parse_args()
    inp = synthetic_ffn_inputs(jax.random.key(0), args.m, args.d, args.f, density=args.density, pattern=args.pattern)
    fns = {"xla": jax.jit(relu_matmul), "xla_pack": jax.jit(lambda x, w: pack_binding.pack_twell(relu_matmul(x, w), tile=256, capacity=32))}
    for v in args.variants:
        fns[f"v{v}"] = jax.jit(lambda x, w, v=v: binding.gate_pack(x, w, tile=256, capacity=32, variant=v))
    for name, fn in fns.items():
        for _ in range(2):
            jax.block_until_ready(fn(inp.x, inp.w_gate))
        print(name, flush=True)


if __name__ == "__main__":
    main()
