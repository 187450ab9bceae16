"""Fits the inference rule's union-product constants (``jax_twell.ops.cuda.DenseCrossover``:
``union_row_bandwidth``, ``union_fixed_overhead``, ``union_transpose_bandwidth``) to
``bench_inference.py`` results, and shows how the refit decides each point.

The rule prices the "blocked_union" kernels after the shared gate matmul as the union rows
of Wu^T and Wd that each 64-token block reads (``1 - (1 - p)^64`` of f at ``p`` active,
the uniform pattern's union), plus a fixed part, plus the up weight's transpose where the
call is not given ``w_up_t``: linear in the three constants' inverses. Each uniform row of
the results gives two points: the forced kernels without ``w_up_t`` (``sparse_call_ms``)
and with it (``pret_call_ms``), each less a third of XLA's dense call (the gate matmul, one
of its three). Relative least squares: every point weighs the same whatever its time.
Rows below ``union_min_tokens`` are left out (the rule does not price union products
there).

Usage: python benchmarks/fit_inference_rule.py benchmarks/results/inference_*.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

from jax_twell.ops import cuda, union_emulation

FITTED = ("union_row_bandwidth", "union_fixed_overhead", "union_transpose_bandwidth")
ITEMSIZE = 2  # bf16, as the benchmark runs


def load_rows(paths: list[str]) -> list[dict]:
    """The result rows of ``bench_inference.py`` JSONs: a file's ``results``, or those of
    each run of a file that gathers several (``runs``: name -> result)."""
    rows = []
    for path in paths:
        data = json.load(open(path))
        runs = [v for v in data["runs"].values() if isinstance(v, dict)] if "runs" in data else [data]
        for run in runs:
            rows.extend(run["results"])
    return rows


def usable(rows: list[dict], base: cuda.DenseCrossover) -> list[dict]:
    """The rows the fit reads: the union kernels forced, uniform rows, enough tokens."""
    return [r for r in rows if r.get("kernel") == "blocked_union" and r["pattern"] == "uniform"
            and "pret_call_ms" in r and r["m"] >= base.union_min_tokens]


def after_gate_seconds(r: dict, pretransposed: bool) -> float:
    """The forced kernels' call less a third of the dense call (seconds)."""
    call = r["pret_call_ms"] if pretransposed else r["sparse_call_ms"]
    return 1e-3 * (call - r["dense_call_ms"] / 3.0)


def fit(rows: list[dict], base: cuda.DenseCrossover) -> cuda.DenseCrossover:
    """``base`` with the constants of :data:`FITTED` fitted to ``rows`` (:func:`usable` ones)."""
    target, design = [], []
    for r in rows:
        m, d, f, p = r["m"], r["d"], r["f"], r["measured_active_fraction"]
        union_bytes = base.union_row_bytes(m, d, f, ITEMSIZE, union_emulation.uniform_union(p))
        for pretransposed in (False, True):
            target.append(after_gate_seconds(r, pretransposed))
            design.append([union_bytes, 1.0, 0.0 if pretransposed else 2.0 * d * f * ITEMSIZE])
    y, a = np.asarray(target), np.asarray(design)
    if (y <= 0).any():
        raise ValueError("a forced call measured below a third of the dense call: not a usable point")
    w = 1.0 / y
    coef, *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
    if (coef <= 0).any():
        raise ValueError(f"the fit is not physical ({dict(zip(FITTED, coef))}): more points needed")
    per_byte, fixed, per_transposed_byte = (float(c) for c in coef)
    return dataclasses.replace(base, union_row_bandwidth=1.0 / per_byte, union_fixed_overhead=fixed,
                               union_transpose_bandwidth=1.0 / per_transposed_byte)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="bench_inference.py JSONs (--kernels blocked_union)")
    args = parser.parse_args()
    base = cuda.DenseCrossover()
    rows = usable(load_rows(args.results), base)
    if len(rows) < len(FITTED):  # each row gives two points, with and without w_up_t
        raise SystemExit(f"{len(rows)} usable rows; the fit wants at least {len(FITTED)}")
    rule = fit(rows, base)
    print(", ".join(f"{name} {getattr(rule, name):.4g}" for name in FITTED))
    print(f"{'M':>6} {'d':>5} {'f':>6} {'active':>7} {'w_up_t':>6} {'measured ms':>11} {'model ms':>8} {'error':>6} "
          f"{'kernels':>7} {'rule':>6}")
    for r in rows:
        m, d, f, p = r["m"], r["d"], r["f"], r["measured_active_fraction"]
        for pretransposed in (False, True):
            measured = 1e3 * after_gate_seconds(r, pretransposed)
            model = 1e3 * float(rule.union_cost(p * m * f, m, d, f, ITEMSIZE, None, pretransposed))
            sparse = rule.sparse_predicted(m, d, f, ITEMSIZE, p, pretransposed, "blocked_union")
            ratio = r["pret_ratio"] if pretransposed else r["sparse_ratio"]
            print(f"{m:>6} {d:>5} {f:>6} {100 * p:>6.2f}% {'yes' if pretransposed else 'no':>6} {measured:>11.4f} "
                  f"{model:>8.4f} {100 * (model / measured - 1):>+5.1f}% {ratio:>6.2f}x {'sparse' if sparse else 'dense':>6}")


if __name__ == "__main__":
    main()
