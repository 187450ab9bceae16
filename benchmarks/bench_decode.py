"""Decode-sized FFN benchmark (M <= 64): the decode kernels against XLA's dense FFN.

Clock ("stack"): one jitted call runs a stack of LAYERS FFN layers, each with its own
weights (so weights stream from HBM as in a model, not from L2), each layer's input
depending on the previous layer's output (``x + 1e-30 * y``: numerically x, so every layer
keeps the synthetic sparsity, but nothing can be hoisted, sliced or skipped). Time per layer
= median call time / LAYERS, calls back to back (median of many runs after warm-up,
synchronised: docs/design.md, section 7, Benchmark protocol), the variants of a
configuration timed in interleaved rounds (each round times every variant once: a drift of
the GPU clock falls on all of them alike; ``<variant>_spread`` is the interquartile range
over the rounds / the median). This is the device time of an FFN inside a decode step; the
inference benchmark's "loop" clock also carries a fori_loop's per-iteration cost (~11 us on
the H200, measured there as "empty loop").

Variants per configuration:
- dense: jax_twell.ops.xla.ffn;
- gate: the gate matmul alone (relu(x @ w_gate), reduced over f so none of it is skipped);
- decode: the CUDA sparse_ffn with the decode kernels (our gate kernel, then the up and down
  steps: binding.decode_ffn_gate), the up weight as stored ([d, f]: transposed in the call);
- decode_pret: the same with the up weight given as [f, d] (w_up_t) and the weights'
  finite columns (as a serving layer keeps them; so do the variants below);
- xla_gate_pret: XLA's gate matmul, then the up and down steps (binding.decode_ffn), w_up_t;
- checked_pret: as xla_gate_pret behind the per-call device check (dense above 2% active,
  DenseCrossover.decode_dense_above);
- auto: jax_twell.sparse_ffn with the default rule (what users get);
- rows (M <= 4): binding.decode_ffn_rows, the whole FFN in two launches from the weights
  stored by neuron (w_gate.T and w_up.T given, as a decode cache would hold them);
- generate: what each layer of TransformerLM's generation path runs with no calibration
  call (generate() keeps w_up.T and the weights' finite columns, and at one row on a GPU
  w_gate.T; no fraction known: the rows kernel at one token);
- cached: jax_twell.sparse_ffn given the measured active fraction as the layer's
  active_fraction, w_up.T, w_gate.T and the finite columns (what a calibrated SparseFFN
  with both decode caches runs: the rows kernel at one token, the tile path or dense above).

With ``--gate-splits 1,2,4,8`` it instead sweeps the gate kernel's K ranges: our gate plus
the steps (binding.decode_ffn_gate, w_up_t) per split count, the ranges added in a cluster
("c<n>") or through a global workspace ("p<n>"), against XLA's gate plus the same steps, at
0.5% uniform, M 1, 16 and 64.

Usage: python benchmarks/bench_decode.py [--quick] [--tokens 1,4 --densities 0.005,0.5]
       [--gate-splits LIST] [--out results.json]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

import jax_twell as jt
from jax_twell.formats import relu_matmul
from jax_twell.ops.common import finite_columns
from jax_twell.ops import layout, xla
from jax_twell.ops.costs import DenseCrossover
from jax_twell.ops.ffn import binding
from jax_twell.ops.ffn import cuda as ffn_cuda
from jax_twell.ops.ffn.api import sparse_ffn_for_layer
from jax_twell.ops.plan import FFNOptions, LayerInfo, Side
from jax_twell.testing import synthetic_ffn_inputs

from common import run_metadata, time_calls, time_interleaved, write_result

LAYERS = 8
FORCED = LayerInfo(side=Side.SPARSE)
DECODE = FFNOptions(rule=DenseCrossover(decode_kernel_max_tokens=64, decode_fused_gate=True))
DECODE_XLA_GATE = FFNOptions(rule=DenseCrossover(decode_kernel_max_tokens=64, decode_fused_gate=False))
DECODE_CHECKED = FFNOptions(rule=DenseCrossover(decode_kernel_max_tokens=64, decode_dense_above=0.02))


def grid(quick: bool, tokens: str | None = None, densities: str | None = None):
    """(M, d, f, density, pattern) configurations: the default grid (``quick``: fewer), or
    every M of ``tokens`` at every density of ``densities`` (comma-separated), uniform."""
    if tokens or densities:
        ms = [int(v) for v in (tokens or "1,4,64").split(",")]
        ps = [float(v) for v in (densities or "0.005").split(",")]
        return [(m, 2048, 5632, p, "uniform") for m in ms for p in ps]
    ms = [1, 4, 64] if quick else [1, 4, 16, 64]
    densities = [0.005, 0.02] if quick else [0.005, 0.01, 0.02, 0.05]
    configs = [(m, 2048, 5632, p, "uniform") for m in ms for p in densities]
    return configs + [(m, 2048, 5632, 0.005, "heavy") for m in (1, 64)]


def stacked(op, weights: int = 5):
    """The stack clock for ``op(x, *layer[:weights])`` (each layer holds w_gate, w_up,
    w_down, w_up.T, w_gate.T and the weights' finite columns)."""
    def run(x, layers):
        xi = x
        for w in layers:
            y = op(xi, *w[:weights])
            xi = x + (y.astype(jnp.float32) * 1e-30).astype(x.dtype)
        return xi

    return jax.jit(run)


def make_layers(m, d, f, density, pattern):
    layers, x = [], None
    for i in range(LAYERS):
        inp = synthetic_ffn_inputs(jax.random.key(1000 * m + i + int(density * 1e4)), m, d, f, density=density, pattern=pattern)
        x = inp.x if x is None else x
        layers.append((inp.w_gate, inp.w_up, inp.w_down, inp.w_up.T.copy(), inp.w_gate.T.copy(),
                       finite_columns(inp.w_up, inp.w_down)))
    return x, layers


def sweep_gate_splits(splits_list, out):
    rows = []
    for m in (1, 16, 64):
        x, layers = make_layers(m, 2048, 5632, 0.005, "uniform")
        row = dict(m=m, d=2048, f=5632, density=0.005, pattern="uniform", layers=LAYERS)
        ops = dict(
            dense=lambda x, wg, wu, wd, wut, wgt: xla.ffn(x, wg, wu, wd),
            xla_gate=lambda x, wg, wu, wd, wut, wgt: binding.decode_ffn(x, relu_matmul(x, wg), wu, wd, w_up_t=wut),
        )
        for s in splits_list:
            for cl in (True, False):
                ops[f"{'c' if cl else 'p'}{s}"] = lambda x, wg, wu, wd, wut, wgt, s=s, cl=cl: binding.decode_ffn_gate(
                    x, wg, wu, wd, w_up_t=wut, splits=s, cluster=cl
                )
        for name, op in ops.items():
            per_call = time_calls(stacked(op), (x, tuple(layers)), min_seconds=0.02, max_reps=100, trials=9)
            row[f"{name}_ms"] = 1e3 * per_call / LAYERS
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = dict(**run_metadata("decode_gate_splits"), dtype="bfloat16", layers=LAYERS, results=rows,
                  default_splits=binding.decode_gate_splits(1, 2048, 5632))
    write_result(result, out, "decode_gate_splits")
    print(f"\n{result['gpu']} commit {result['commit']}  (us per layer, stack of {LAYERS}; default splits {result['default_splits']})")
    names = [k[:-3] for k in rows[0] if k.endswith("_ms")]
    print(f"{'M':>3} " + " ".join(f"{n:>8}" for n in names))
    for r in rows:
        print(f"{r['m']:>3} " + " ".join(f"{1e3 * r[n + '_ms']:>8.1f}" for n in names))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--gate-splits", default=None, help="comma-separated K range counts to sweep")
    parser.add_argument("--tokens", default=None, help="comma-separated M (with --densities: that grid, uniform rows)")
    parser.add_argument("--densities", default=None, help="comma-separated active fractions")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.gate_splits:
        return sweep_gate_splits([int(v) for v in args.gate_splits.split(",")], args.out)

    def gate_only(x, wg, wu, wd, wut=None, wgt=None, ok=None):
        g = relu_matmul(x, wg)
        return jnp.broadcast_to(g.astype(jnp.float32).sum(axis=1, keepdims=True), x.shape).astype(x.dtype)

    ops = dict(
        dense=lambda x, wg, wu, wd, wut=None, wgt=None, ok=None: xla.ffn(x, wg, wu, wd),
        gate=gate_only,
        decode=lambda x, wg, wu, wd, wut=None, wgt=None, ok=None: ffn_cuda.sparse_ffn(x, wg, wu, wd, layer=FORCED, options=DECODE),
        decode_pret=lambda x, wg, wu, wd, wut, wgt=None, ok=None: ffn_cuda.sparse_ffn(
            x, wg, wu, wd, layer=FORCED, options=DECODE, w_up_t=wut, weights_finite=ok
        ),
        xla_gate_pret=lambda x, wg, wu, wd, wut, wgt=None, ok=None: ffn_cuda.sparse_ffn(
            x, wg, wu, wd, layer=FORCED, options=DECODE_XLA_GATE, w_up_t=wut, weights_finite=ok
        ),
        checked_pret=lambda x, wg, wu, wd, wut, wgt=None, ok=None: ffn_cuda.sparse_ffn(
            x, wg, wu, wd, options=DECODE_CHECKED, w_up_t=wut, weights_finite=ok
        ),
        auto=lambda x, wg, wu, wd, wut=None, wgt=None, ok=None: jt.sparse_ffn(x, wg, wu, wd),
        rows=lambda x, wg, wu, wd, wut, wgt, ok=None: binding.decode_ffn_rows(x, wgt, wd, w_up_t=wut),
    )
    # What a calibrated layer with both decode caches runs (SparseFFN after
    # TransformerLM.calibrate_ffn and cache_for_decode(activation_weight=True)): the public
    # op given the layer's active fraction, w_up.T and w_gate.T.
    cached_op = lambda density: lambda x, wg, wu, wd, wut, wgt, ok: sparse_ffn_for_layer(
        x, wg, wu, wd, w_up_t=wut, w_act_t=wgt, weights_finite=ok, layer=LayerInfo(active_fraction=density)
    )
    # What each layer of TransformerLM's generation path runs with no calibration call:
    # generate() keeps the decode layout (cache_for_decode: w_up.T and the weights' finite
    # columns; with one row on a GPU, w_gate.T too), and the layer knows no fraction.
    generate_op = lambda m: lambda x, wg, wu, wd, wut, wgt, ok: sparse_ffn_for_layer(
        x, wg, wu, wd, w_up_t=wut, w_act_t=wgt if m == 1 else None, weights_finite=ok)
    rows = []
    for m, d, f, density, pattern in grid(args.quick, args.tokens, args.densities):
        x, layers = make_layers(m, d, f, density, pattern)
        g = relu_matmul(x, layers[0][0])
        nnz = (g != 0).sum(axis=1)
        row = dict(
            m=m, d=d, f=f, density=density, pattern=pattern, layers=LAYERS,
            measured_active_fraction=float(nnz.mean() / f), max_active_per_row=int(nnz.max()),
        )
        fns = {name: stacked(op, weights=6) for name, op in ops.items() if name != "rows" or m <= layout.DECODE_ROWS_MAX_TOKENS}
        fns["cached"] = stacked(cached_op(row["measured_active_fraction"]), weights=6)
        fns["generate"] = stacked(generate_op(m), weights=6)
        timed = time_interleaved(fns, (x, tuple(layers)), min_seconds=0.02, max_reps=100, rounds=11)
        for name in (*ops, "cached", "generate"):
            if name not in timed:
                row[f"{name}_ms"] = row[f"{name}_ratio"] = None
                continue
            row[f"{name}_ms"] = 1e3 * timed[name][0] / LAYERS
            row[f"{name}_spread"] = timed[name][1]
        for name in ("decode", "decode_pret", "xla_gate_pret", "checked_pret", "auto", "rows", "cached", "generate"):
            if row[f"{name}_ms"] is None:
                continue
            row[f"{name}_ratio"] = row["dense_ms"] / row[f"{name}_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)

    result = dict(
        **run_metadata("decode_ffn"), dtype="bfloat16", layers=LAYERS,
        crossover=vars(DenseCrossover()), clock=__doc__.split('Clock ("stack"): ')[1].split("Variants")[0].strip(),
        results=rows,
    )
    write_result(result, args.out, "decode")
    print(f"\n{result['gpu']} jax {result['jax']} commit {result['commit']}  (ms per layer, stack of {LAYERS})")
    print(f"{'M':>3} {'dens':>6} {'pattern':>8} {'act%':>5} {'dense':>7} {'xla gate':>8} {'decode':>7} {'ratio':>6} {'pret':>7} {'ratio':>6} {'xg pret':>7} {'ratio':>6} {'auto':>7} {'ratio':>6} {'rows':>7} {'ratio':>6} {'cached':>7} {'ratio':>6} {'generate':>8} {'ratio':>6} {'spread':>6}")
    for r in rows:
        print(
            f"{r['m']:>3} {r['density']:>6.3f} {r['pattern']:>8} {100 * r['measured_active_fraction']:>5.2f} {r['dense_ms']:>7.4f} "
            f"{r['gate_ms']:>8.4f} {r['decode_ms']:>7.4f} {r['decode_ratio']:>6.2f} {r['decode_pret_ms']:>7.4f} "
            f"{r['decode_pret_ratio']:>6.2f} {r['xla_gate_pret_ms']:>7.4f} {r['xla_gate_pret_ratio']:>6.2f} "
            f"{r['auto_ms']:>7.4f} {r['auto_ratio']:>6.2f}"
            + (f" {r['rows_ms']:>7.4f} {r['rows_ratio']:>6.2f}" if r["rows_ms"] is not None else f" {'-':>7} {'-':>6}")
            + f" {r['cached_ms']:>7.4f} {r['cached_ratio']:>6.2f} {r['generate_ms']:>8.4f} {r['generate_ratio']:>6.2f}"
            + f" {max(v for k, v in r.items() if k.endswith('_spread')):>6.2f}"
        )
    print("spread: the largest interquartile range over the rounds / median among the row's variants")


if __name__ == "__main__":
    main()
