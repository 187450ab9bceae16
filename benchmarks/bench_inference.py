"""Inference FFN benchmark: the sparse op against XLA's dense FFN, same process, same inputs.

Protocol (docs/design.md, section 7, Benchmark protocol): synthetic sparsity with a real
gate matmul (one feature per row sets the firing rate), uniform and heavy-tailed row
patterns; bf16; every timing is the median of many runs after warm-up, synchronised with
block_until_ready; never on zeros. All variants of a configuration are timed in interleaved
rounds (each round times every variant once, so a drift of the GPU clock falls on all alike;
``*_spread``: the interquartile range over the rounds / the median).

Two clocks:
- "call": R back-to-back calls of the jitted op, then one block_until_ready, divided by R
  (the GPU stays busy when each call outlasts its dispatch; the clock for M >= 2048);
- "loop": the op run L times inside one jitted fori_loop (each iteration's x perturbed by
  a carried zero so nothing is hoisted but the loop-invariant weight transpose), divided
  by L: device time per call plus the loop's own per-iteration cost (~11 us on the H200,
  recorded as "empty_loop_ms"), which dilutes every ratio at M <= 64; the decode ratios
  to quote come from benchmarks/bench_decode.py (a stack of layers in one call).

Variants timed per configuration:
- dense: jax_twell.ops.xla.ffn (gate, up, down matmuls through XLA);
- sparse: jax_twell.ops.ffn.cuda.sparse_ffn forced sparse (``LayerInfo(side=Side.SPARSE)``) (gate matmul, pack kernel, fused
  up+down kernel; the up weight transposed inside the call);
- pret: as sparse, with the up weight given pre-transposed ([f, d], as a model can store it);
- auto: jax_twell.sparse_ffn with the default dense-crossover rule (what users get);
- layer: the same given the measured active fraction and 64-token union
  (``measured_union_fraction``, stats.block_union_fraction of the gate activations): what a
  calibrated SparseFFN layer runs (where the rule predicts dense, XLA's dense FFN with no
  device check);
- layer_pret: as layer, with the up weight given pre-transposed (a layer that stores it);
- gather (M <= 64 only, shared by every kernel's row): jax_twell.ops.xla.gather_ffn, the
  decode path reading only the active neurons' weights, w_up as stored and pre-transposed;
- decode kernels: benchmarks/bench_decode.py (its own clock).
Each configuration gives one row per fused kernel ("kernel": a ``jax_twell.ops.plan.Kernel``
value, ``FFNOptions.kernel``; a blocked kernel's "auto" is that kernel under the default
rule); dense is timed once and shared.

Usage: python benchmarks/bench_inference.py [--quick] [--kernels row,blocked,blocked_mma|none] [--m 16384,2048]
       [--configs M:d:f:density:pattern,...] [--out results.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp

import jax_twell as jt
from jax_twell.ops import stats, xla
from jax_twell.ops.costs import DenseCrossover
from jax_twell.ops.ffn import cuda as ffn_cuda
from jax_twell.ops.plan import FFNOptions, Kernel, LayerInfo, Side
from jax_twell.testing import inference_benchmark_grid, synthetic_ffn_inputs

from common import run_metadata, time_calls, time_interleaved, write_result

FORCED = LayerInfo(side=Side.SPARSE)
KERNELS = tuple(k.value for k in Kernel if k is not Kernel.AUTO)


def timed(fn, args):
    return time_calls(fn, args, min_seconds=0.02, max_reps=200)


def grid(quick: bool, only_m: list[int] | None = None, configs: str | None = None):
    if configs:  # "M:d:f:density:pattern,..."
        out = []
        for item in configs.split(","):
            try:
                m, d, f, density, pattern = item.split(":")
                out.append((int(m), int(d), int(f), float(density), pattern))
            except ValueError:
                raise SystemExit(f"--configs: {item!r} is not M:d:f:density:pattern (e.g. 16384:2048:5632:0.005:uniform)")
        return out
    return [c for c in inference_benchmark_grid(quick) if only_m is None or c[0] in only_m]


def looped(op, iters):
    def run(x, *w):
        def body(_, carry):
            c, acc = carry
            y = op(x + c.astype(x.dtype), *w)
            return c * 0, acc + y[0, 0].astype(jnp.float32)

        return jax.lax.fori_loop(0, iters, body, (jnp.float32(0), jnp.float32(0)))[1]

    return jax.jit(run)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--kernels", default=",".join(KERNELS),
                        help="comma-separated fused kernels to time; a name with the suffix _nostat (blocked_union_nostat) "
                             "traces the kernel with the rule's stationary_down off: the union down product instead of the "
                             "stationary one (the A/B of ffi/twell_stationary.cuh)")
    parser.add_argument("--m", default=None, help="comma-separated token counts: time only these configurations")
    parser.add_argument("--configs", default=None,
                        help="comma-separated M:d:f:density:pattern: time these configurations instead of the grid")
    parser.add_argument("--margin", type=float, default=None,
                        help="the dense-crossover rule's margin for the auto and layer variants (default: the rule's own)")
    parser.add_argument("--no-fused-gate", action="store_true",
                        help="pack the gate with XLA's matmul + the pack kernel everywhere (the A/B of the fused gate kernel)")
    args = parser.parse_args()
    kernels = [k for k in args.kernels.split(",") if k != "none"]
    rule = DenseCrossover() if args.margin is None else DenseCrossover(margin=args.margin)

    dense_op = lambda x, wg, wu, wd: xla.ffn(x, wg, wu, wd)

    def cuda_op(kernel, layer=LayerInfo(), rule=rule, pret=False):
        # a name with _nostat: the rule without the stationary down step (the union product)
        if kernel.endswith("_nostat"):
            kernel, rule = kernel.removesuffix("_nostat"), dataclasses.replace(rule, stationary_down=False)
        options = FFNOptions(kernel=kernel, rule=rule, fused_gate=not args.no_fused_gate)

        def op(x, wg, wu, wd, wut=None):
            return ffn_cuda.sparse_ffn(x, wg, wu, wd, layer=layer, options=options, w_up_t=wut if pret else None)
        return op

    def kernel_ops(kernel):
        auto_op = cuda_op(kernel)
        if kernel == "row" and args.margin is None and not args.no_fused_gate:
            auto_op = lambda x, wg, wu, wd: jt.sparse_ffn(x, wg, wu, wd)  # the public default (Kernel.AUTO)
        elif kernel == "row":
            auto_op = cuda_op("auto")  # the public default under the options given
        return dict(sparse=cuda_op(kernel, FORCED, DenseCrossover()), pret=cuda_op(kernel, FORCED, DenseCrossover(), True),
                    auto=auto_op)

    def layer_op(kernel, base, pret=False):
        # The trace-time choice of a layer whose fractions are known (what
        # TransformerLM.calibrate_ffn measures for a SparseFFN): dense is XLA's FFN itself.
        # With pret, the layer also gives the up weight as [f, d] (five operands).
        info = LayerInfo(active_fraction=base["measured_active_fraction"], union_fraction=base["measured_union_fraction"],
                         overflow_fraction=base["measured_overflow_fraction"], kept_fraction=base["measured_kept_fraction"])
        return cuda_op(kernel, info, pret=pret)

    rows = []
    for m, d, f, density, pattern in grid(args.quick, [int(v) for v in args.m.split(",")] if args.m else None, args.configs):
        inp = synthetic_ffn_inputs(jax.random.key(m + f + int(density * 1e4)), m, d, f, density=density, pattern=pattern)
        act = jt.gate_twell(inp.x, inp.w_gate)
        counts = act.counts
        nnz = counts.sum(axis=-1)
        base = dict(
            m=m, d=d, f=f, density=density, pattern=pattern,
            measured_active_fraction=float(nnz.mean() / f),
            max_active_per_row=int(nnz.max()),
            overflowed_tiles=int((counts > act.capacity).sum()),
            measured_union_fraction=float(stats.block_union_fraction(jt.formats.relu_matmul(inp.x, inp.w_gate))),
        )
        over, kept = stats.warp_layout_fit(jt.formats.relu_matmul(inp.x, inp.w_gate)).tolist()
        base.update(measured_overflow_fraction=float(over), measured_kept_fraction=float(kept))
        clock = "loop" if m <= 64 else "call"
        w_up_t = inp.w_up.T.copy()
        operands = tuple(inp) + (w_up_t,)  # every variant gets w_up_t; only the *_pret ones use it
        four = lambda op: lambda x, wg, wu, wd, wut: op(x, wg, wu, wd)
        width = xla.gather_width(m, f)
        variants = {"dense": four(dense_op)}
        if m <= 64:
            # The decode path that gathers the active neurons' weights (xla.gather_ffn), with
            # the up weight as stored ([d, f]) and pre-transposed ([f, d], rows contiguous);
            # "empty": the loop's own cost per iteration (an op that only reads x).
            variants["gather"] = four(lambda x, wg, wu, wd: xla.gather_ffn(x, wg, wu, wd, width=width))
            variants["gather_pret"] = lambda x, wg, wu, wd, wut: xla.gather_ffn(x, wg, wu, wd, width=width, w_up_t=wut)
            variants["empty"] = lambda x, *w: x
        for kernel in kernels:
            ops = dict(
                kernel_ops(kernel),
                layer=layer_op(kernel, base),
                layer_pret=layer_op(kernel, base, pret=True),
            )
            for name, op in ops.items():
                variants[f"{kernel}/{name}"] = op if name in ("pret", "layer_pret") else four(op)
        # Every variant of this configuration in interleaved rounds (each round times each
        # once), on the call clock and, for decode sizes, the loop clock.
        iters = 50
        call_names = [n for n in variants if n not in ("gather", "gather_pret", "empty")]
        call = time_interleaved({n: jax.jit(variants[n]) for n in call_names}, operands, min_seconds=0.02, max_reps=200)
        loop = {}
        if m <= 64:
            loop = time_interleaved({n: looped(v, iters) for n, v in variants.items()}, operands, min_seconds=0.02, max_reps=200)
        dense_times = {"dense_call_ms": 1e3 * call["dense"][0], "dense_call_spread": call["dense"][1]}
        if m <= 64:
            for n in ("dense", "gather", "gather_pret", "empty"):
                dense_times[f"{n}_loop_ms"] = 1e3 * loop[n][0] / iters
                dense_times[f"{n}_loop_spread"] = loop[n][1]
            for name in ("gather", "gather_pret"):
                dense_times[f"{name}_ratio"] = dense_times["dense_loop_ms"] / dense_times[f"{name}_loop_ms"]
        if not kernels:  # --kernels none: dense and the gather path only
            rows.append(dict(base, kernel="none", clock=clock, **dense_times))
            print(json.dumps(rows[-1]), flush=True)
        for kernel in kernels:
            row = dict(base, kernel=kernel, **dense_times)
            for name in ("sparse", "pret", "auto", "layer", "layer_pret"):
                row[f"{name}_call_ms"] = 1e3 * call[f"{kernel}/{name}"][0]
                row[f"{name}_call_spread"] = call[f"{kernel}/{name}"][1]
                if m <= 64:
                    row[f"{name}_loop_ms"] = 1e3 * loop[f"{kernel}/{name}"][0] / iters
                    row[f"{name}_loop_spread"] = loop[f"{kernel}/{name}"][1]
            for name in ("sparse", "pret", "auto", "layer", "layer_pret"):
                row[f"{name}_ratio"] = row[f"dense_{clock}_ms"] / row[f"{name}_{clock}_ms"]
            row["clock"] = clock
            if kernel.removesuffix("_nostat") == "blocked_union":  # which down step the forced calls ran
                for name, pret in (("down_stationary", False), ("down_stationary_pret", True)):
                    row[name] = not kernel.endswith("_nostat") and DenseCrossover().down_stationary(m, d, f, 2, None, pret)
            if m == 16384 and density == 0.005 and pattern == "uniform" and f == 5632 and kernel in KERNELS:
                gate = jax.jit(lambda x, w: jt.formats.relu_matmul(x, w))
                gate_pack = jax.jit(lambda x, w: jt.gate_twell(x, w, implementation="cuda"))
                transpose = jax.jit(lambda w: w.T + 0)
                a = jt.gate_twell(inp.x, inp.w_gate, implementation="cuda")
                fused = jax.jit(lambda x, a, wg, wu, wd: ffn_cuda.twell_ffn(x, a, wg, wu, wd, w_up_t=wu.T, kernel=kernel))
                fused_t = jax.jit(lambda x, a, wg, wu, wd, wut: ffn_cuda.twell_ffn(x, a, wg, wu, wd, w_up_t=wut, kernel=kernel))
                row["breakdown_ms"] = dict(
                    gate_matmul=1e3 * timed(gate, (inp.x, inp.w_gate)),
                    gate_and_pack=1e3 * timed(gate_pack, (inp.x, inp.w_gate)),
                    transpose_w_up=1e3 * timed(transpose, (inp.w_up,)),
                    fused_kernel_with_transpose=1e3 * timed(fused, (inp.x, a, inp.w_gate, inp.w_up, inp.w_down)),
                    fused_kernel_pretransposed=1e3 * timed(fused_t, (inp.x, a, inp.w_gate, inp.w_up, inp.w_down, w_up_t)),
                )
            rows.append(row)
            print(json.dumps(row), flush=True)

    result = dict(
        **run_metadata("inference_ffn"),
        fused_gate=not args.no_fused_gate,
        dtype="bfloat16",
        tile=256,
        capacity=32,
        crossover=vars(rule),
        clocks=__doc__.split("Two clocks:")[1].split("Variants")[0].strip(),
        results=rows,
    )
    write_result(result, args.out, "inference")

    print(f"\n{result['gpu']} jax {result['jax']} commit {result['commit']}")
    print(f"{'M':>6} {'d':>5} {'f':>6} {'dens':>6} {'pattern':>8} {'kernel':>7} {'act%':>6} {'max':>5} {'clock':>5} {'dense ms':>9} {'sparse ms':>9} {'ratio':>6} {'auto ms':>8} {'auto r':>6} {'layer r':>7} {'lay-t r':>7}")
    for r in rows:
        c = r["clock"]
        if r["kernel"] == "none":
            continue
        print(
            f"{r['m']:>6} {r['d']:>5} {r['f']:>6} {r['density']:>6.3f} {r['pattern']:>8} {r['kernel']:>7} {100 * r['measured_active_fraction']:>6.2f} "
            f"{r['max_active_per_row']:>5} {c:>5} {r[f'dense_{c}_ms']:>9.4f} {r[f'sparse_{c}_ms']:>9.4f} {r['sparse_ratio']:>6.2f} "
            f"{r[f'auto_{c}_ms']:>8.4f} {r['auto_ratio']:>6.2f} {r['layer_ratio']:>7.2f} {r['layer_pret_ratio']:>7.2f}"
        )
    for r in rows:
        if "gather_ratio" in r and r["kernel"] == (kernels[0] if kernels else "none"):
            print(
                f"decode gather M={r['m']:>2} {r['density']:.3f} {r['pattern']:>7}: dense {r['dense_loop_ms']:.4f} ms "
                f"(empty loop {r['empty_loop_ms']:.4f}), gather {r['gather_loop_ms']:.4f} ({r['gather_ratio']:.2f}x), "
                f"with w_up [f, d] {r['gather_pret_loop_ms']:.4f} ({r['gather_pret_ratio']:.2f}x)"
            )
    for r in rows:
        if "breakdown_ms" in r:
            print(f"breakdown {r['kernel']} (M=16384, 0.5% uniform):", {k: round(v, 4) for k, v in r["breakdown_ms"].items()})


if __name__ == "__main__":
    main()
