"""One decode-sized FFN call, for Nsight Compute (ncu) to profile.

Usage: ncu --kernel-name regex:Decode ... python lab/profile_decode.py [--path rows]
       [--m 1] [--d 2048] [--f 5632] [--density 0.005] [--pattern uniform]
Paths: rows (binding.decode_ffn_rows, weights stored by neuron), gate (binding.decode_ffn_gate:
our gate kernel, then the up and down steps; w_up_t given), xla_gate (XLA's gate matmul,
then binding.decode_ffn). The call runs twice (compile, then the profiled run); ncu's
--launch-skip can skip the first.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

from jax_twell.formats import relu_matmul
from jax_twell.ops.ffn import binding
from jax_twell.testing import synthetic_ffn_inputs

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))  # common.py

from common import add_shape_arguments


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--path", default="rows", choices=["rows", "gate", "xla_gate"])
    add_shape_arguments(p, m=1)
    a = p.parse_args()
    inp = synthetic_ffn_inputs(jax.random.key(0), a.m, a.d, a.f, density=a.density, pattern=a.pattern)
    w_gate_t, w_up_t = inp.w_gate.T.copy(), inp.w_up.T.copy()
    ops = dict(
        rows=lambda x: binding.decode_ffn_rows(x, w_gate_t, inp.w_down, w_up_t=w_up_t),
        gate=lambda x: binding.decode_ffn_gate(x, inp.w_gate, inp.w_up, inp.w_down, w_up_t=w_up_t),
        xla_gate=lambda x: binding.decode_ffn(x, relu_matmul(x, inp.w_gate), inp.w_up, inp.w_down, w_up_t=w_up_t),
    )
    op = jax.jit(ops[a.path])
    for _ in range(2):
        op(inp.x).block_until_ready()


if __name__ == "__main__":
    main()
