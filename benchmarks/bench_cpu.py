"""CPU benchmark: the sparse FFN's CPU kernel (cpu/twell_cpu.cc) against XLA's dense FFN.

d=2048, f=5632, uniform rows at each density, f32 and bf16, M in --m (1, 8, 64, 512). The
weights (69 to 138 MB) exceed the last-level cache, as a model's layers do. Variants, each
one jitted call, timed in interleaved rounds (median seconds per call after warm-up,
benchmarks/common.py):

- dense: XLA's dense FFN (jax_twell.ops.xla.ffn), the baseline;
- auto: jax_twell.sparse_ffn with no caches (what a plain call gets on the CPU: the kernel
  where g is sparse enough, the weights' NaN/Inf check in the call, w_up read by columns
  up to 16 tokens and transposed in the call above);
- cpu: the same forced (implementation="cpu");
- cached: what jax_twell.modules.SparseFFN runs after cache_transposed_up_weight: w_up.T
  and the weights' finite columns kept, so a call reads neither whole weight;
- dense_again (--control): XLA's dense FFN compiled a second time, the same program as
  dense: its ratio is the spread of identical programs on this machine, against which
  the others' losses are read.

Ratios are dense / variant (above 1: faster than dense), the median over the rounds of each
round's own ratio (benchmarks/common.time_paired: the drift of a shared machine between
minutes falls on both sides of a round alike). ``--train`` instead times a training step
(value_and_grad through ``sparse_ffn_train``) by default against XLA's. ``--sweep`` instead times the kernel
alone (given g and w_up.T, no dense side) against XLA's dense up and down products at
densities 0.5-100%, the measurement behind jax_twell.ops.ffn.cpu.SPARSE_MAX_FRACTION.

Usage: python benchmarks/bench_cpu.py [--m 1,8,64,512] [--densities 0.005,0.05,0.5]
       [--dtypes float32,bfloat16] [--patterns uniform,heavy,skewed,full1] [--sweep | --train]
       [--out results.json]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
from common import run_metadata, time_paired, write_result  # noqa: E402

import jax_twell as jt  # noqa: E402
from jax_twell import _cpu  # noqa: E402
from jax_twell.formats import relu_matmul  # noqa: E402
from jax_twell.ops import xla  # noqa: E402
from jax_twell.ops.common import finite_columns  # noqa: E402
from jax_twell.ops.ffn import cpu  # noqa: E402
from jax_twell.ops.ffn.api import sparse_ffn_for_layer  # noqa: E402
from jax_twell.testing import synthetic_ffn_inputs, with_extreme_rows  # noqa: E402

D, F = 2048, 5632


def ffn_variants() -> dict:
    """name -> jitted fn(x, w_gate, w_up, w_down, w_up_t, finite)."""
    return dict(
        dense=jax.jit(lambda x, wg, wu, wd, wut, ok: xla.ffn(x, wg, wu, wd)),
        auto=jax.jit(lambda x, wg, wu, wd, wut, ok: jt.sparse_ffn(x, wg, wu, wd)),
        cpu=jax.jit(lambda x, wg, wu, wd, wut, ok: jt.sparse_ffn(x, wg, wu, wd, implementation="cpu")),
        cached=jax.jit(lambda x, wg, wu, wd, wut, ok: sparse_ffn_for_layer(x, wg, wu, wd, w_up_t=wut,
                                                                           weights_finite=ok)),
    )


def train_variants() -> dict:
    """A training step each: value_and_grad (x and the three weights) of ``sum(y * x) +
    1e-5 * l1`` through sparse_ffn_train on XLA ("dense") and by default ("auto": the CPU
    training kernels where g is sparse enough, jax_twell.ops.ffn_train.cpu)."""

    def step(implementation):
        def loss(x, wg, wu, wd):
            y, aux = jt.sparse_ffn_train(x, wg, wu, wd, implementation=implementation)
            return (y.astype(jnp.float32) * x.astype(jnp.float32)).sum() + 1e-5 * aux.l1

        grad = jax.value_and_grad(loss, (0, 1, 2, 3))
        return jax.jit(lambda x, wg, wu, wd, wut, ok: grad(x, wg, wu, wd))

    return dict(dense=step("xla"), auto=step(None))


def sweep_variants() -> dict:
    """The up and down products alone, from g: the kernel (no dense side) and XLA's."""
    return dict(
        dense=jax.jit(lambda x, wg, wu, wd, wut, ok: xla.up_down(x, relu_matmul(x, wg), wu, wd)),
        kernel=jax.jit(lambda x, wg, wu, wd, wut, ok: cpu.up_down(x, relu_matmul(x, wg), wu, wd, w_up_t=wut)),
    )


def inputs(m: int, density: float, pattern: str, dtype):
    """The FFN operands of one configuration (jax_twell.testing's generators)."""
    full = {"full1": 1, "full2": 2}.get(pattern, 0)
    base = "uniform" if full else pattern
    inp = synthetic_ffn_inputs(jax.random.key(0), m, D, F, density=density, pattern=base, dtype=dtype)
    return with_extreme_rows(inp, full=min(full, m)) if full else inp


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--m", default="1,8,64,512")
    p.add_argument("--densities", default=None, help="default 0.005,0.05,0.5 (--sweep: 0.005 to 1)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--patterns", default="uniform",
                   help="row patterns, comma-separated: uniform, heavy (log-normal row rates), skewed (per-neuron "
                        "rates), full1 / full2 (uniform rows with the first one / two tokens fully active); "
                        "default uniform")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--train", action="store_true", help="time training steps (train_variants) instead")
    p.add_argument("--control", action="store_true",
                   help="also time dense_again, a second compilation of XLA's dense FFN (the same program): its "
                        "ratio is what identical programs read apart on this machine")
    p.add_argument("--min-seconds", type=float, default=0.05)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not _cpu.cpu_kernels_available():
        raise SystemExit(f"the CPU kernels are unavailable: {_cpu.cpu_kernel_status().reason}")
    default_densities = "0.005,0.02,0.05,0.1,0.25,0.5,1.0" if args.sweep else "0.005,0.05,0.5"
    densities = [float(v) for v in (args.densities or default_densities).split(",")]
    kind = "cpu_sweep" if args.sweep else "cpu_train" if args.train else "cpu"
    make = sweep_variants if args.sweep else train_variants if args.train else ffn_variants
    variants = make()
    if args.control:  # the baseline's function jitted anew: compiled and timed as a variant of its own
        variants["dense_again"] = make()["dense"]
    result = run_metadata(kind)
    result.update(cpu_count=os.cpu_count(), d=D, f=F, configs=[])
    for dtype_name in args.dtypes.split(","):
        dtype = jnp.dtype(dtype_name)
        for m, density, pattern in ((m, density, pattern) for m in (int(v) for v in args.m.split(","))
                                    for pattern in args.patterns.split(",") for density in densities):
            inp = inputs(m, density, pattern, dtype)
            w_up_t = inp.w_up.T.copy()
            ok = finite_columns(inp.w_up, inp.w_down)
            operands = (*inp, w_up_t, ok)
            active = float(jnp.count_nonzero(relu_matmul(inp.x, inp.w_gate))) / (m * F)
            times = time_paired(variants, operands, baseline="dense", min_seconds=args.min_seconds, max_reps=200,
                                rounds=args.rounds)
            row = dict(dtype=dtype_name, m=m, pattern=pattern, density=density, active=round(active, 5))
            for name, (t, spread, ratio, ratio_spread) in times.items():
                row[f"{name}_ms"] = round(t * 1e3, 4)
                row[f"{name}_spread"] = round(spread, 3)
                if name != "dense":
                    row[f"{name}_ratio"] = round(ratio, 3)
                    row[f"{name}_ratio_spread"] = round(ratio_spread, 3)
            result["configs"].append(row)
            print(" ".join(f"{k}={v}" for k, v in row.items() if not k.endswith("spread")), flush=True)
    print("wrote", write_result(result, args.out, kind))


if __name__ == "__main__":
    main()
