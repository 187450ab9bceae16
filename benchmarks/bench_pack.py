"""Pack benchmark: the ``jax_twell_pack`` kernel (dense activation -> TwELL) against the
memory it has to move.

The pack runs wherever the FFN paths take XLA's gate matmul instead of the fused gate
(a call with no known active fraction, M below the fused gate's threshold, the training
forward's dense start). It reads g [M, f] once and writes the TwELL fields, so its floor
is a memory floor. Per configuration (M, f, active fraction, dtype), on the same g, timed
in interleaved rounds (benchmarks/common.time_interleaved; ``*_spread``: interquartile
range over the rounds / median):
- pack: ``pack_binding.pack_twell(g)`` (tile 256, capacity 32);
- xla_count: ``jnp.count_nonzero(g, axis=-1)`` through XLA, a reduction that reads g once
  and writes almost nothing: what reading g costs on this GPU, in the same process.
``pack_tbps``: the pack's bytes moved (g read, values / cols / counts written) per second;
``pack_vs_read`` = xla_count / pack (1.0: the pack costs no more than reading g).

Usage: python benchmarks/bench_pack.py [--quick] [--out results.json]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from jax_twell.ops.pack import binding as pack_binding
from jax_twell.testing import synthetic_ffn_inputs
from jax_twell.formats import relu_matmul

from common import run_metadata, time_interleaved, write_result

TILE, CAPACITY = 256, 32


def configurations(quick: bool):
    """(M, d, f, active fraction, dtype name): quick, the headline shape at M=16384 and 2048
    at 0.5% and 50% active (a run's dense start), bf16; else more shapes and f32."""
    rows = [(16384, 2048, 5632, 0.005, "bfloat16"), (2048, 2048, 5632, 0.005, "bfloat16"),
            (16384, 2048, 5632, 0.5, "bfloat16")]
    if quick:
        return rows
    return rows + [(65536, 2048, 5632, 0.005, "bfloat16"), (16384, 2048, 8192, 0.005, "bfloat16"),
                   (16384, 4096, 11008, 0.005, "bfloat16"), (16384, 2048, 5632, 0.005, "float32")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the headline shape at M=16384 and 2048 only")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    variants = {
        "pack": jax.jit(lambda g: pack_binding.pack_twell(g, tile=TILE, capacity=CAPACITY)),
        "xla_count": jax.jit(lambda g: jnp.count_nonzero(g, axis=-1)),
    }
    rows = []
    for m, d, f, density, dtype in configurations(args.quick):
        inp = synthetic_ffn_inputs(jax.random.key(m + f), m, d, f, density=density, dtype=jnp.dtype(dtype))
        g = jax.block_until_ready(relu_matmul(inp.x, inp.w_gate))
        timing = time_interleaved(variants, (g,), min_seconds=0.05, max_reps=500, rounds=11)
        n_tiles = -(-f // TILE)
        moved = g.size * g.dtype.itemsize + m * n_tiles * (CAPACITY * (g.dtype.itemsize + 2) + 4)
        row = dict(m=m, d=d, f=f, density=density, dtype=dtype,
                   active=float(jnp.count_nonzero(g)) / (m * f), bytes_moved=moved)
        for name, (t, spread) in timing.items():
            row[f"{name}_us"] = t * 1e6
            row[f"{name}_spread"] = spread
        row["pack_tbps"] = moved / timing["pack"][0] / 1e12
        row["read_tbps"] = g.size * g.dtype.itemsize / timing["xla_count"][0] / 1e12
        row["pack_vs_read"] = timing["xla_count"][0] / timing["pack"][0]
        rows.append(row)
        print(json.dumps(row), flush=True)

    result = dict(run_metadata("pack"), tile=TILE, capacity=CAPACITY, rows=rows)
    path = write_result(result, args.out, "pack_quick" if args.quick else "pack")
    print(f"\n{'M':>6} {'f':>6} {'active':>6} {'dtype':>8} | {'pack':>7} {'read g':>7} us | {'pack TB/s':>9} {'read TB/s':>9} | {'vs read':>7}")
    for r in rows:
        print(f"{r['m']:>6} {r['f']:>6} {r['density']:6.3f} {r['dtype']:>8} | {r['pack_us']:7.1f} {r['xla_count_us']:7.1f}    | "
              f"{r['pack_tbps']:9.2f} {r['read_tbps']:9.2f} | {r['pack_vs_read']:7.2f}")
    print(f"written: {path}")


if __name__ == "__main__":
    main()
