"""Fits the training rule's (``jax_twell.ops.cuda_train.TrainCrossover``) measured
constants to a ``bench_training.py`` result, and shows how the refit decides each point.

The rule prices the kernels' step after the shared gate matmul as known terms (the pack,
the per-call transposes, the weight gradients' x/dy slices) plus three fitted ones:
``fixed_overhead`` (seconds per call), ``pair_rate`` (the FMAs of each active pair) and
``union_bandwidth`` (each 64-token block's union rows of the five tables the union products
read). The target of each row is its forced-kernel step (``mma_step_ms``) less a ninth of
XLA's step (the gate matmul, one of its nine matmuls). Relative least squares: every point
weighs the same whatever its time.

Usage: python benchmarks/fit_train_rule.py benchmarks/results/training_fit_b1bb9c0_union.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

from jax_twell.ops import cuda_train


def fit(rows: list[dict], base: cuda_train.TrainCrossover, itemsize: int = 2) -> cuda_train.TrainCrossover:
    """``base`` with ``fixed_overhead``, ``pair_rate`` and ``union_bandwidth`` fitted to ``rows``."""
    known, target, design = [], [], []
    for r in rows:
        m, d, f = r["m"], r["d"], r["f"]
        pairs = r["measured_active_fraction"] * m * f
        union_bytes = base.union_bytes(m, d, f, itemsize, r["measured_union_fraction"])
        fixed_known = base.sparse_fixed_cost(m, d, f, itemsize) - base.fixed_overhead
        stream = pairs * 2.0 * d * itemsize / base.grad_stream_bandwidth
        target.append(1e-3 * (r["mma_step_ms"] - r["dense_step_ms"] / 9.0))
        known.append(fixed_known + stream)
        design.append([1.0, pairs * 8.0 * d, union_bytes])
    y = np.asarray(target) - np.asarray(known)
    a = np.asarray(design)
    w = 1.0 / np.asarray(target)
    (fixed, per_fma, per_byte), *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
    if min(fixed, per_fma, per_byte) <= 0:
        raise ValueError(f"the fit is not physical (fixed {fixed}, s/FMA {per_fma}, s/B {per_byte}): more points needed")
    return dataclasses.replace(base, fixed_overhead=float(fixed), pair_rate=float(1.0 / per_fma),
                               union_bandwidth=float(1.0 / per_byte))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="a bench_training.py JSON with measured_union_fraction in its rows")
    args = parser.parse_args()
    rows = [r for r in json.load(open(args.results))["results"] if "measured_union_fraction" in r]
    if len(rows) < 4:
        raise SystemExit(f"{args.results}: {len(rows)} rows with a measured union; the fit needs at least 4")
    rule = fit(rows, cuda_train.TrainCrossover())
    print(f"fixed_overhead {rule.fixed_overhead:.4g} s, pair_rate {rule.pair_rate:.4g} FMA/s, "
          f"union_bandwidth {rule.union_bandwidth:.4g} B/s")
    print(f"{'pattern':>8} {'active':>7} {'union':>6} {'measured ms':>11} {'model ms':>8} {'error':>6} "
          f"{'kernels':>7} {'rule':>6}")
    for r in rows:
        m, d, f = r["m"], r["d"], r["f"]
        nnz = r["measured_active_fraction"] * m * f
        after_gate = r["mma_step_ms"] - r["dense_step_ms"] / 9.0
        model = 1e3 * float(rule.sparse_cost(nnz, 0, m, d, f, 2, union=r["measured_union_fraction"]))
        sparse = rule.prefers_sparse(m, d, f, 2, r["measured_active_fraction"], r["measured_union_fraction"])
        print(f"{r['pattern']:>8} {100 * r['measured_active_fraction']:>6.2f}% {r['measured_union_fraction']:>6.3f} "
              f"{after_gate:>11.3f} {model:>8.3f} {100 * (model / after_gate - 1):>+5.1f}% "
              f"{r['mma_ratio']:>6.2f}x {'sparse' if sparse else 'dense':>6}")


if __name__ == "__main__":
    main()
