"""What the default call would take with no conditional: the sparse path's programs with
the backup at a static size and no ``lax.cond``/``lax.switch`` (not exact past the backup:
a measurement of the ceiling, not a path).

Usage: python lab/nocond.py [--configs 2048:uniform,16384:tail] [--d 2048] [--f 5632]
       [--density 0.005] [--out r.json]

Variants, timed interleaved with XLA's dense FFN and the default call:
- fused_nb: the fused gate (TwELL epilogue) then the warp kernel, no backup (the floor);
- fused_b8 / fused_b64: the same with a static backup of M/8 (the default's size) or M/64
  rows: ``jnp.nonzero`` of the backed-up rows, the dense FFN of those rows, a scatter;
- gate_b64: XLA's gate matmul writes g, the pack kernel, the warp kernel, a static backup
  of M/64 rows from g's rows (the default's sparse side without its conditionals);
- fused_b64_t: fused_b64 with ``w_up.T`` transposed in the call (the default's input).
All take ``w_up.T`` kept except fused_b64_t.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")]

import jax_twell as jt  # noqa: E402
from bench_patterns import family_inputs, FAMILIES  # noqa: E402
from common import time_interleaved  # noqa: E402
from jax_twell.formats import relu_matmul  # noqa: E402
from jax_twell.ops import xla  # noqa: E402
from jax_twell.ops.ffn import cuda, warp  # noqa: E402
from jax_twell.ops.pack.binding import pack_twell  # noqa: E402


def static_backup(x, act, y, backup, rows_ffn):
    rows = warp.backed_up(act, warp.ROW_BUDGET)
    (idx,) = jnp.nonzero(rows, size=backup, fill_value=x.shape[0])
    return y.at[idx].set(rows_ffn(idx).astype(y.dtype), mode="drop")


def rows_of(a, idx):
    return a.at[idx].get(mode="fill", fill_value=0)


def variants(m):
    b8, b64 = warp.backup_size(m), max(8, -(-m // 64))

    def fused(backup, transpose=False):
        def fn(x, wg, wu, wd, wut):
            wut = wu.T if transpose else wut
            act = cuda.gate_twell(x, wg, tile=256, capacity=32)
            y = warp.ffn_rows(x, act, wut, wd)
            if backup == 0:
                return y
            return static_backup(x, act, y, backup, lambda idx: xla.ffn(rows_of(x, idx), wg, wu, wd))
        return fn

    def gate(x, wg, wu, wd, wut):
        g = relu_matmul(x, wg)
        act = pack_twell(g, tile=256, capacity=32)
        y = warp.ffn_rows(x, act, wut, wd)
        return static_backup(x, act, y, b64, lambda idx: xla.up_down(rows_of(x, idx), rows_of(g, idx), wu, wd))

    return {
        "xla": lambda x, wg, wu, wd, wut: xla.ffn(x, wg, wu, wd),
        "default": lambda x, wg, wu, wd, wut: jt.sparse_ffn(x, wg, wu, wd),
        "fused_nb": fused(0), "fused_b8": fused(b8), "fused_b64": fused(b64),
        "gate_b64": gate, "fused_b64_t": fused(b64, transpose=True),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="2048:uniform,8192:uniform,16384:uniform,16384:tail,65536:uniform")
    p.add_argument("--d", type=int, default=2048)
    p.add_argument("--f", type=int, default=5632)
    p.add_argument("--density", type=float, default=0.005)
    p.add_argument("--min-seconds", type=float, default=0.25)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = []
    for spec in a.configs.split(","):
        m, family = spec.split(":")
        m = int(m)
        key = jax.random.key(m * 7 + a.d + a.f + FAMILIES.index(family))
        x, wg, wu, wd = family_inputs(key, m, a.d, a.f, a.density, family)
        args = (x, wg, wu, wd, jnp.asarray(wu.T))
        fns = {k: jax.jit(v) for k, v in variants(m).items()}
        want = np.asarray(fns["xla"](*args), np.float32)
        err = {k: float(np.linalg.norm(np.asarray(fn(*args), np.float32) - want) / np.linalg.norm(want))
               for k, fn in fns.items()}
        t = time_interleaved(fns, args, min_seconds=a.min_seconds, max_reps=2000 if m <= 4096 else 200)
        row = dict(m=m, family=family, d=a.d, f=a.f, density=a.density, ms={k: v[0] * 1e3 for k, v in t.items()},
                   speedup={k: t["xla"][0] / v[0] for k, v in t.items()}, rel_error=err)
        rows.append(row)
        print(f"{family} m={m}: " + "  ".join(f"{k} {v:.3f}ms ({row['speedup'][k]:.2f}x, err {err[k]:.0e})"
                                              for k, v in row["ms"].items()), flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(dict(jax=jax.__version__, device=str(jax.devices()[0]), rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
