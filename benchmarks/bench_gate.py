"""Gate benchmark: the fused gate kernel (GEMM + TwELL pack in its epilogue) against XLA.

Per configuration (M, d, f, active fraction), on the same inputs, timed in interleaved
rounds (benchmarks/common.time_interleaved; ``*_spread``: interquartile range over the
rounds / median):
- xla_matmul: ``relu(x @ w)`` through XLA (the dense gate every FFN runs; bf16 output);
- xla_pack: that matmul then the ``jax_twell_pack`` kernel (the unfused TwELL gate);
- fused: ``binding.gate_pack`` (one kernel: the matmul's epilogue packs, no [M, f] write),
  cooperative schedule; fused_pingpong: the same with the ping-pong schedule.
Ratios: ``fused_vs_matmul`` = xla_matmul / fused (issue 3 item 1a asks >= 0.9: matmul
throughput within 10% of XLA's) and ``fused_vs_pack`` = xla_pack / fused (what the fused
kernel saves the sparse paths); ``default_*``: the configuration the library picks for
this d (layout.fused_gate_variant). Inputs: synthetic_ffn_inputs (a real gate at the stated
firing rate), bf16.

Usage: python benchmarks/bench_gate.py [--quick] [--out results.json]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from jax_twell.formats import relu_matmul
from jax_twell.ops import layout
from jax_twell.ops.ffn import binding
from jax_twell.ops.pack import binding as pack_binding
from jax_twell.testing import synthetic_ffn_inputs

from common import run_metadata, time_interleaved, write_result

TILE, CAPACITY = 256, 32


def configurations(quick: bool):
    """(M, d, f, active fraction): quick, the headline shape at M=16384 and 2048 and the two
    larger shapes at 16384; else every shape at M from 1024 to 65536."""
    shapes = [(2048, 5632), (2048, 8192), (4096, 11008)]
    if quick:
        return [(16384, 2048, 5632, 0.005), (2048, 2048, 5632, 0.005)] + [(16384, d, f, 0.005) for d, f in shapes[1:]]
    return [(m, d, f, 0.005) for d, f in shapes for m in (65536, 16384, 4096, 2048, 1024)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the headline shape at M=16384 and 2048, two more shapes at 16384")
    parser.add_argument("--out", default=None)
    parser.add_argument("--variants", type=lambda v: [int(c) for c in v.split(",") if c], default=[],
                        help="extra variant codes of the fused kernel to time, comma-separated")
    args = parser.parse_args()

    variants = {
        "xla_matmul": jax.jit(relu_matmul),
        "xla_pack": jax.jit(lambda x, w: pack_binding.pack_twell(relu_matmul(x, w), tile=TILE, capacity=CAPACITY)),
        "fused": jax.jit(lambda x, w: binding.gate_pack(x, w, tile=TILE, capacity=CAPACITY, variant=0)),
        "fused_pingpong": jax.jit(lambda x, w: binding.gate_pack(x, w, tile=TILE, capacity=CAPACITY, variant=1)),
    }
    for v in args.variants:  # extra schedule / raster / swizzle codes (ffi/twell_gate.cu)
        variants[f"fused_v{v}"] = jax.jit(lambda x, w, v=v: binding.gate_pack(x, w, tile=TILE, capacity=CAPACITY, variant=v))
    rows = []
    for m, d, f, density in configurations(args.quick):
        inp = synthetic_ffn_inputs(jax.random.key(m + d + f), m, d, f, density=density, dtype=jnp.bfloat16)
        # One exactness check per configuration before timing: the fused counts equal the
        # pack's except where an element sits at the last bit of zero.
        pack_counts = variants["xla_pack"](inp.x, inp.w_gate).counts
        mismatch = max(
            float(jnp.mean((variants[v](inp.x, inp.w_gate).counts != pack_counts).astype(jnp.float32)))
            for v in ("fused", "fused_pingpong")
        )
        timing = time_interleaved(variants, (inp.x, inp.w_gate), min_seconds=0.05, max_reps=200, rounds=11)
        row = dict(m=m, d=d, f=f, density=density, count_mismatch=mismatch,
                   active=float(pack_counts.sum()) / (m * f))
        for name, (t, spread) in timing.items():
            row[f"{name}_ms"] = t * 1e3
            row[f"{name}_spread"] = spread
        row["fused_tflops"] = 2 * m * d * f / timing["fused"][0] / 1e12
        row["xla_tflops"] = 2 * m * d * f / timing["xla_matmul"][0] / 1e12
        row["fused_vs_matmul"] = timing["xla_matmul"][0] / timing["fused"][0]
        row["fused_vs_pack"] = timing["xla_pack"][0] / timing["fused"][0]
        for name in timing:
            if name.startswith("fused_"):
                row[f"{name}_vs_matmul"] = timing["xla_matmul"][0] / timing[name][0]
        row["pingpong_vs_matmul"] = row["fused_pingpong_vs_matmul"]
        # What gate_twell and the FFN paths run: the configuration layout.fused_gate_variant picks.
        row["default_variant"] = layout.fused_gate_variant(d)
        default = {0: "fused", 1: "fused_pingpong"}.get(row["default_variant"])
        if default is not None:
            row["default_ms"] = row[f"{default}_ms"]
            row["default_vs_matmul"] = timing["xla_matmul"][0] / timing[default][0]
            row["default_vs_pack"] = timing["xla_pack"][0] / timing[default][0]
        rows.append(row)
        print(json.dumps(row), flush=True)

    result = dict(run_metadata("gate"), tile=TILE, capacity=CAPACITY, rows=rows)
    path = write_result(result, args.out, "gate_quick" if args.quick else "gate")
    print(f"\n{'M':>6} {'d':>5} {'f':>6} | {'matmul':>7} {'+pack':>7} {'fused':>7} {'pingpong':>8} ms | {'TF/s xla':>8} {'fused':>6} | {'vs mm':>6} {'pp vs mm':>8} {'vs pack':>7} | mismatch")
    for r in rows:
        print(f"{r['m']:>6} {r['d']:>5} {r['f']:>6} | {r['xla_matmul_ms']:7.3f} {r['xla_pack_ms']:7.3f} {r['fused_ms']:7.3f} {r['fused_pingpong_ms']:8.3f}    | "
              f"{r['xla_tflops']:8.0f} {r['fused_tflops']:6.0f} | {r['fused_vs_matmul']:6.2f} {r['pingpong_vs_matmul']:8.2f} {r['fused_vs_pack']:7.2f} | {r['count_mismatch']:.2e}")
    for v in args.variants:
        print(f"variant {v:>2} vs XLA's matmul: " + " ".join(f"{r[f'fused_v{v}_vs_matmul']:.2f}" for r in rows))
    print("default configuration (by d) vs XLA's matmul: " + " ".join(f"{r.get('default_vs_matmul', float('nan')):.2f}" for r in rows))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
