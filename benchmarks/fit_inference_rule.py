"""Fits the inference rule's "blocked_union" constants (``jax_twell.ops.DenseCrossover``)
to ``bench_inference.py`` results, and shows how the refit decides each point.

Two models, each linear in its constants' inverses, fitted by relative least squares to
the after-gate time of uniform rows (the forced call less a third of XLA's dense call, the
gate matmul, one of its three), each row giving two points: without ``w_up_t``
(``sparse_call_ms``) and with it (``pret_call_ms``). Rows below ``union_min_tokens`` are
left out (the rule does not price union products there).

- ``--model stationary`` (default): the down step with the weight stationary in shared
  memory: the up product's union rows of Wu^T, the active pairs times the waves of 16-column
  CTAs (of 8-column CTAs where f > 7,264: a constant of its own), the tokens, a fixed part
  and the up weight's transpose (``STATIONARY``). Reads the points that ran it: a row's
  ``down_stationary`` / ``down_stationary_pret`` where recorded, else kernel
  "blocked_union" on a shape ``DenseCrossover.stationary_runs`` takes (results measured
  since it is the default, 59e8f0d).
- ``--model union``: both steps as union products: the union rows of Wu^T and Wd read per
  64-token block (``1 - (1 - p)^64`` of f at ``p`` active, the uniform pattern's union), a
  fixed part and the transpose (``UNION``). Reads the points of "blocked_union_nostat" and
  the other points of "blocked_union"; with ``--before-stationary``, every "blocked_union"
  point (results measured before 59e8f0d).
A constant with no point to fit it (no 8-column rows, say) keeps its current value.

Usage: python benchmarks/fit_inference_rule.py [--model stationary|union] lab/results/inference_*.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

from jax_twell.ops import layout
from jax_twell.ops.costs import DenseCrossover

UNION = ("union_row_bandwidth", "union_fixed_overhead", "union_transpose_bandwidth")
STATIONARY = ("stationary_up_bandwidth", "stationary_pair_seconds", "stationary_pair_seconds_8",
              "stationary_token_seconds", "stationary_fixed_overhead", "stationary_transpose_bandwidth")
RATES = {"union_row_bandwidth", "union_transpose_bandwidth", "stationary_up_bandwidth",
         "stationary_transpose_bandwidth"}  # fitted as seconds per byte, stored as their inverse
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


def ran_stationary(r: dict, base: DenseCrossover, pretransposed: bool, before_stationary: bool = False) -> bool:
    """Whether the row's forced call (with ``w_up_t`` or not) ran the stationary down step."""
    key = "down_stationary_pret" if pretransposed else "down_stationary"
    if key in r:
        return bool(r[key])
    return r.get("kernel") == "blocked_union" and not before_stationary and base.stationary_runs(r["m"], r["d"], r["f"])


def usable(rows: list[dict], base: DenseCrossover, model: str, before_stationary: bool = False) -> list[tuple]:
    """The points ``model`` reads (module docstring), as ``(row, pretransposed)``: uniform
    rows of the union kernels, enough tokens, forced timings."""
    out = []
    for r in rows:
        if (r["pattern"] != "uniform" or "pret_call_ms" not in r or r["m"] < base.union_min_tokens
                or r.get("kernel") not in ("blocked_union", "blocked_union_nostat")):
            continue
        for pretransposed in (False, True):
            if ran_stationary(r, base, pretransposed, before_stationary) == (model == "stationary"):
                out.append((r, pretransposed))
    return out


def after_gate_seconds(r: dict, pretransposed: bool) -> float:
    """The forced kernels' call less a third of the dense call (seconds)."""
    call = r["pret_call_ms"] if pretransposed else r["sparse_call_ms"]
    return 1e-3 * (call - r["dense_call_ms"] / 3.0)


def features(r: dict, base: DenseCrossover, model: str, pretransposed: bool) -> list[float]:
    """The row's terms, one per constant of ``model`` (in the order of UNION / STATIONARY)."""
    m, d, f, p = r["m"], r["d"], r["f"], r["measured_active_fraction"]
    union_bytes = base.union_row_bytes(m, d, f, ITEMSIZE, layout.uniform_union(p))
    transpose = 0.0 if pretransposed else 2.0 * d * f * ITEMSIZE
    if model == "union":
        return [union_bytes, 1.0, transpose]
    cols = layout.walk_cols(f)
    pairs = p * m * f * -(-d // (cols * base.stationary_sms))
    return [0.5 * union_bytes, pairs if cols == 16 else 0.0, pairs if cols == 8 else 0.0, float(m), 1.0, transpose]


def fit(points: list[tuple], base: DenseCrossover, model: str = "stationary") -> DenseCrossover:
    """``base`` with the constants of ``model`` fitted to ``points`` (:func:`usable` ones);
    a constant whose term is zero at every point keeps its value."""
    names = STATIONARY if model == "stationary" else UNION
    y = np.asarray([after_gate_seconds(r, pret) for r, pret in points])
    a = np.asarray([features(r, base, model, pret) for r, pret in points])
    if (y <= 0).any():
        raise ValueError("a forced call measured below a third of the dense call: not a usable point")
    used = np.abs(a).sum(axis=0) > 0
    w = 1.0 / y
    coef, *_ = np.linalg.lstsq(a[:, used] * w[:, None], y * w, rcond=None)
    fitted = [n for n, u in zip(names, used) if u]
    if (coef <= 0).any():
        raise ValueError(f"the fit is not physical ({dict(zip(fitted, coef))}): more points needed")
    values = {n: (1.0 / float(c) if n in RATES else float(c)) for n, c in zip(fitted, coef)}
    return dataclasses.replace(base, **values)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+",
                        help="bench_inference.py JSONs (--kernels blocked_union[,blocked_union_nostat])")
    parser.add_argument("--model", choices=("stationary", "union"), default="stationary")
    parser.add_argument("--before-stationary", action="store_true",
                        help="the results were measured before the stationary down step (59e8f0d): "
                             "their blocked_union rows ran union products")
    args = parser.parse_args()
    base = DenseCrossover()
    names = STATIONARY if args.model == "stationary" else UNION
    points = usable(load_rows(args.results), base, args.model, args.before_stationary)
    if len(points) < len(names):
        raise SystemExit(f"{len(points)} usable points; the {args.model} fit wants at least {len(names)}")
    rule = fit(points, base, args.model)
    print(", ".join(f"{name} {getattr(rule, name):.4g}" for name in names))
    print(f"{'M':>6} {'d':>5} {'f':>6} {'active':>7} {'w_up_t':>6} {'measured ms':>11} {'model ms':>8} {'error':>6} "
          f"{'kernels':>7} {'rule':>6}")
    price = rule._stationary_seconds if args.model == "stationary" else rule._union_model_seconds
    for r, pretransposed in points:
        m, d, f, p = r["m"], r["d"], r["f"], r["measured_active_fraction"]
        measured = 1e3 * after_gate_seconds(r, pretransposed)
        model = 1e3 * float(price(p * m * f, m, d, f, ITEMSIZE, layout.uniform_union(p), pretransposed))
        sparse = rule.sparse_predicted(m, d, f, ITEMSIZE, p, pretransposed, "blocked_union")
        ratio = r["pret_ratio"] if pretransposed else r["sparse_ratio"]
        side = "sparse" if sparse else "dense"
        print(f"{m:>6} {d:>5} {f:>6} {100 * p:>6.2f}% {'yes' if pretransposed else 'no':>6} {measured:>11.4f} "
              f"{model:>8.4f} {100 * (model / measured - 1):>+5.1f}% {ratio:>6.2f}x {side:>6}")


if __name__ == "__main__":
    main()
