"""The CPU sparse side with the gate packed to TwELL in its pass against the same side
through the dense g, paired in the same process (bf16, few tokens, w_up.T given).

Usage: python lab/cpu_twell_ab.py [--m 1,8,16] [--densities 0.005,0.05,0.2] [--out r.json]

- g: the kernel's dense gate (jax_twell_cpu_gate), then the up and down kernel reading g;
- twell: jax_twell_cpu_gate_twell, then jax_twell_cpu_up_down_twell (g never written);
ratios are g's time over twell's in the same round (above 1: TwELL faster), median over
the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from common import time_paired  # noqa: E402

from jax_twell.ops.ffn import cpu  # noqa: E402
from jax_twell.testing import synthetic_ffn_inputs  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--m", default="1,8,16")
    p.add_argument("--densities", default="0.005,0.05,0.2")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    fns = {
        "g": jax.jit(lambda x, wg, wu, wd, wut: cpu.up_down(x, cpu.gate(x, wg), wu, wd, w_up_t=wut)),
        "twell": jax.jit(lambda x, wg, wu, wd, wut: cpu.up_down_twell(x, cpu.gate_twell(x, wg), wg, wu, wd, w_up_t=wut)),
    }
    rows = []
    for m in (int(v) for v in a.m.split(",")):
        for dens in (float(v) for v in a.densities.split(",")):
            x, wg, wu, wd = synthetic_ffn_inputs(jax.random.key(m), m, 2048, 5632, density=dens, dtype=jnp.bfloat16)
            args = (x, wg, wu, wd, jnp.asarray(wu.T))
            t = time_paired(fns, args, baseline="g", min_seconds=0.05, max_reps=50, rounds=a.rounds)
            row = dict(m=m, density=dens, g_ms=t["g"][0] * 1e3, twell_ms=t["twell"][0] * 1e3,
                       g_over_twell=t["twell"][2], ratio_spread=t["twell"][3])
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(dict(cpu_count=os.cpu_count(), jax=jax.__version__, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
