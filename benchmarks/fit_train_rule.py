"""Fits the training rule's (``jax_twell.ops.TrainCrossover``) measured
constants to a ``bench_training.py`` result, and shows how the refit decides each point.

The rule prices the kernels' step after the shared gate matmul as known terms (the pack,
the per-call transposes, the weight gradients' x/dy slices at L2 rate) plus four fitted
ones, each linear in its constant's inverse: ``fixed_overhead`` (seconds per call),
``pair_rate`` (the FMAs of each active pair), ``grad_stream_spill`` (how the x/dy slices
slow as x and dy outgrow L2) and ``union_bandwidth`` (each 64-token block's union rows of
the five tables the union products read). The target of each row is its forced-kernel step (``mma_step_ms``) less
XLA's gate matmul, one of the dense step's nine matmuls (eight in files timed with
``--grad-only``, where XLA drops the forward's down matmul). ``matmul_rate`` (the dense
side of the rule: eight matmuls past the gate) is the median over the rows of the dense
step's rate, from value_and_grad files only. Relative least squares:
every point weighs the same whatever its time. Points at several M separate the per-call
and per-token parts (the slices' spill).

Usage: python benchmarks/fit_train_rule.py lab/results/training_fit_*.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

from jax_twell.ops.costs import TrainCrossover


FITTED = ("fixed_overhead", "pair_rate", "grad_stream_spill", "union_bandwidth")


def dense_matmuls(result: dict) -> int:
    """Matmuls of m d f in a result file's dense step: nine for value_and_grad, eight for
    jax.grad alone (files without a ``step`` field were timed so)."""
    return 9 if result.get("step") == "value_and_grad" else 8


def gate_ms(row: dict) -> float:
    """The dense step's share of one matmul: what both sides spend on the gate."""
    return row["dense_step_ms"] / row["dense_matmuls"]


def fit(rows: list[dict], base: TrainCrossover, itemsize: int = 2) -> TrainCrossover:
    """``base`` with the constants of :data:`FITTED` fitted to ``rows``."""
    known, target, design = [], [], []
    for r in rows:
        m, d, f = r["m"], r["d"], r["f"]
        pairs = r["measured_active_fraction"] * m * f
        stream = pairs * 2.0 * d * itemsize / base.grad_stream_bandwidth  # at L2 rate
        target.append(1e-3 * (r["mma_step_ms"] - gate_ms(r)))
        known.append(m * f * itemsize / base.hbm_bandwidth + 5.0 * d * f * itemsize / base.transpose_bandwidth + stream)
        design.append([
            1.0,                                               # fixed_overhead
            pairs * 8.0 * d,                                   # 1 / pair_rate
            stream * 2.0 * m * d * itemsize,                   # 1 / grad_stream_spill
            base.union_bytes(m, d, f, itemsize, r["measured_union_fraction"]),  # 1 / union_bandwidth
        ])
    y = np.asarray(target) - np.asarray(known)
    a = np.asarray(design)
    w = 1.0 / np.asarray(target)
    coef, *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
    if (coef <= 0).any():
        raise ValueError(f"the fit is not physical ({dict(zip(FITTED, coef))}): more points needed")
    fixed, per_fma, per_spill, per_byte = (float(c) for c in coef)
    rates = [16.0 * r["m"] * r["d"] * r["f"] / (1e-3 * (r["dense_step_ms"] - gate_ms(r)))
             for r in rows if r["dense_matmuls"] == 9]
    matmul_rate = float(np.median(rates)) if rates else base.matmul_rate
    return dataclasses.replace(base, fixed_overhead=fixed, pair_rate=1.0 / per_fma, matmul_rate=matmul_rate,
                               grad_stream_spill=1.0 / per_spill, union_bandwidth=1.0 / per_byte)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="bench_training.py JSONs with measured_union_fraction in their rows")
    args = parser.parse_args()
    rows = []
    for path in args.results:
        result = json.load(open(path))
        rows += [dict(r, dense_matmuls=dense_matmuls(result)) for r in result["results"] if "measured_union_fraction" in r]
    if len(rows) < 2 * len(FITTED):
        raise SystemExit(f"{len(rows)} rows with a measured union; the fit wants at least {2 * len(FITTED)}")
    rule = fit(rows, TrainCrossover())
    print(", ".join(f"{name} {getattr(rule, name):.4g}" for name in (*FITTED, "matmul_rate")))
    print(f"{'M':>6} {'pattern':>8} {'active':>7} {'union':>6} {'measured ms':>11} {'model ms':>8} {'error':>6} "
          f"{'kernels':>7} {'rule':>6}")
    for r in rows:
        m, d, f = r["m"], r["d"], r["f"]
        nnz = r["measured_active_fraction"] * m * f
        after_gate = r["mma_step_ms"] - gate_ms(r)
        model = 1e3 * float(rule.sparse_cost(nnz, 0, m, d, f, 2, union=r["measured_union_fraction"]))
        sparse = rule.prefers_sparse(m, d, f, 2, r["measured_active_fraction"], r["measured_union_fraction"])
        print(f"{m:>6} {r['pattern']:>8} {100 * r['measured_active_fraction']:>6.2f}% {r['measured_union_fraction']:>6.3f} "
              f"{after_gate:>11.3f} {model:>8.3f} {100 * (model / after_gate - 1):>+5.1f}% "
              f"{r['mma_ratio']:>6.2f}x {'sparse' if sparse else 'dense':>6}")


if __name__ == "__main__":
    main()
