"""Inference FFN on activation patterns with tails, against XLA's dense FFN in the same
process (and, on the GPU machine, beside the published kernels on the same inputs).

Families (per-row firing rates; the gate's control feature sets each row's rate):
  uniform    every row at the mean rate p
  tail       rows at p, and 2% of the tokens at U(10%, 50%) of f
  pareto     Pareto (alpha 1.5) row rates with mean p, clipped to 60%
  lognormal  log-normal (sigma 1.5) row rates with mean p, clipped to 60%
  full16     rows at p, and 16 tokens active on every neuron

  python3 benchmarks/bench_patterns.py --configs 2048:2048:5632:uniform,16384:2048:5632:tail \
      [--density 0.005] [--npz-dir DIR] [--out FILE]
  python3 benchmarks/bench_patterns.py --npz trained/*.npz [--configs ...] [--out FILE]

Each configuration times, interleaved: "xla" (XLA's dense FFN), "default" (``sparse_ffn``
with no arguments), "blocked_union" (the union/stationary kernels with their per-call
choice, the default before the warp path) and, where the warp kernel takes d,
"warp_cached" (the fused gate, then the warp kernel with the dense backup, ``w_up.T``
given, as a serving model keeps it) and "per_call" (the default's per-call form with no
token floor: XLA's gate, the pack, the choice on the device). With ``--npz-dir`` each
configuration's inputs are written there (x, w_gate, w_up, w_down as bf16 bits) for the
published kernels' script.

``--npz`` times the same functions on inputs read from files of that format (family
"npz", named after the file), such as a trained model's FFN inputs and weights written by
``benchmarks/trained_activations.py``; at least one of ``--configs`` and ``--npz`` is needed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import load_npz, run_metadata, save_npz, time_interleaved, write_result  # noqa: E402

import jax_twell as jt  # noqa: E402
from jax_twell.ops import xla  # noqa: E402
from jax_twell.ops.ffn import cuda, sparse_ffn_for_layer, warp  # noqa: E402
from jax_twell.ops.costs import DenseCrossover  # noqa: E402
from jax_twell.ops.plan import FFNOptions, Kernel  # noqa: E402
from jax_twell.testing import synthetic_ffn_inputs  # noqa: E402

FAMILIES = ("uniform", "tail", "pareto", "lognormal", "full16")


def family_rates(key, m: int, p: float, family: str) -> jax.Array:
    """Per-row firing rates ``[m]`` of one family (module docstring)."""
    k1, k2 = jax.random.split(key)
    if family in ("uniform", "full16"):
        r = jnp.full((m,), p)
        return r.at[:16].set(1.0) if family == "full16" else r
    if family == "tail":
        heavy = jax.random.uniform(k1, (m,)) < 0.02
        return jnp.where(heavy, jax.random.uniform(k2, (m,), minval=0.10, maxval=0.50), p)
    if family == "pareto":
        alpha = 1.5
        xm = p * (alpha - 1) / alpha
        return jnp.clip(xm * jax.random.uniform(k1, (m,), minval=1e-6) ** (-1 / alpha), 1e-6, 0.6)
    if family == "lognormal":
        s = 1.5
        return jnp.clip(p * jnp.exp(s * jax.random.normal(k1, (m,)) - s * s / 2), 1e-6, 0.6)
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def family_inputs(key, m: int, d: int, f: int, p: float, family: str):
    """FFN operands (bf16) whose rows fire at :func:`family_rates`."""
    inp = synthetic_ffn_inputs(key, m, d, f, density=p, pattern="uniform", dtype=jnp.float32)
    rates = family_rates(jax.random.fold_in(key, 1), m, p, family)
    # Rate 1 (fully active rows): a control value far below every pre-activation; rate 0
    # (empty rows) as 1e-7 (a finite control value: no Inf in x).
    ctrl = jnp.where(rates >= 1.0, -50.0, jax.scipy.special.ndtri(1.0 - jnp.clip(rates, 1e-7, 0.999)))
    x = inp.x.at[:, 0].set(ctrl)
    return tuple(a.astype(jnp.bfloat16) for a in (x, inp.w_gate, inp.w_up, inp.w_down))


FUNCTIONS = ("xla", "default", "blocked_union", "warp_cached", "per_call")


def warp_ffn(x, w_gate, w_up, w_down, w_up_t=None):
    """The warp path with the fused gate and ``w_up_t`` given ("warp_cached")."""
    act = cuda.gate_twell(x, w_gate, tile=256, capacity=32)
    return warp.ffn_from_gate(x, act, w_gate, w_up, w_down, w_up_t=w_up_t)


def run_inputs(name: str, family: str, x, w_gate, w_up, w_down, min_seconds: float,
               functions: tuple[str, ...] | None = None, **fields) -> dict:
    """Times every function of the module docstring on the bf16 operands ``x [M, d]``,
    ``w_gate, w_up [d, f]``, ``w_down [f, d]`` (errors against XLA's dense FFN, the
    operands' activity) and prints one line; returns the result row, ``fields`` included."""
    (m, d), f = x.shape, w_gate.shape[1]
    g = jax.jit(lambda x, w: jnp.maximum(jnp.matmul(x, w, preferred_element_type=jnp.float32), 0))(x, w_gate)
    row_active = np.asarray((g > 0).sum(axis=1))
    w_up_t = jnp.asarray(w_up.T)
    union = FFNOptions(kernel=Kernel.BLOCKED_UNION)
    fns = {
        "xla": jax.jit(lambda x, wg, wu, wd, wut: xla.ffn(x, wg, wu, wd)),
        "default": jax.jit(lambda x, wg, wu, wd, wut: jt.sparse_ffn(x, wg, wu, wd)),
        "blocked_union": jax.jit(lambda x, wg, wu, wd, wut: sparse_ffn_for_layer(x, wg, wu, wd, options=union)),
    }
    args = (x, w_gate, w_up, w_down, w_up_t)
    if warp.supported(d, x.dtype):
        fns["warp_cached"] = jax.jit(warp_ffn)
        # The per-call form with no token floor (the default's from the floor up).
        no_floor = FFNOptions(rule=DenseCrossover(per_call_min_tokens=0, per_call_min_d=0))
        fns["per_call"] = jax.jit(lambda x, wg, wu, wd, wut: sparse_ffn_for_layer(x, wg, wu, wd, options=no_floor))
    if functions is not None:  # "xla" always: the ratios are to it
        fns = {k: v for k, v in fns.items() if k == "xla" or k in functions}
    want = np.asarray(fns["xla"](*args), np.float32)
    errors = {}
    for fn_name, fn in fns.items():
        got = np.asarray(fn(*args), np.float32)
        errors[fn_name] = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
    max_reps = 2000 if m <= 4096 else 200
    times = time_interleaved(fns, args, min_seconds=min_seconds, max_reps=max_reps)
    act = cuda.gate_twell(x, w_gate, tile=256, capacity=32) if warp.supported(d, x.dtype) else None
    backed = int(warp.backed_up(act, warp.ROW_BUDGET).sum()) if act is not None else None
    row = dict(
        name=name, m=m, d=d, f=f, family=family, **fields,
        density=float(row_active.mean() / f), row_active_max=int(row_active.max()),
        rows_over_10pct=int((row_active > 0.1 * f).sum()), rows_backed_up=backed,
        backup_size=warp.backup_size(m),
        ms={k: v[0] * 1e3 for k, v in times.items()}, spread={k: v[1] for k, v in times.items()},
        speedup_vs_xla={k: times["xla"][0] / v[0] for k, v in times.items()},
        rel_error_vs_xla=errors,
    )
    print(f"{name:32s} dens {row['density']*100:5.2f}% backed {backed}  " +
          "  ".join(f"{k} {v:7.3f}ms ({row['speedup_vs_xla'][k]:.2f}x)" for k, v in row["ms"].items()), flush=True)
    return row


def run_config(m: int, d: int, f: int, family: str, p: float, npz_dir: Path | None, min_seconds: float,
               functions: tuple[str, ...] | None = None) -> dict:
    """One synthetic configuration (:func:`family_inputs`), its inputs written to
    ``npz_dir`` when given; the row of :func:`run_inputs`."""
    key = jax.random.key(m * 7 + d + f + FAMILIES.index(family))
    x, w_gate, w_up, w_down = family_inputs(key, m, d, f, p, family)
    name = f"{family}_m{m}_d{d}_f{f}"
    if npz_dir is not None:
        npz_dir.mkdir(parents=True, exist_ok=True)
        save_npz(npz_dir / f"{name}.npz", x, w_gate, w_up, w_down)
    return run_inputs(name, family, x, w_gate, w_up, w_down, min_seconds, functions, density_target=p)


def run_npz(path: Path, min_seconds: float, functions: tuple[str, ...] | None = None) -> dict:
    """The inputs in ``path`` (:func:`common.save_npz`'s format), named after the file,
    family "npz"; the row of :func:`run_inputs`."""
    x, w_gate, w_up, w_down = load_npz(path)
    return run_inputs(path.stem, "npz", x, w_gate, w_up, w_down, min_seconds, functions, source=path.name)


def main(argv: list[str] | None = None) -> None:
    """Command line (module docstring); writes the result JSON."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=None, help="comma-separated M:d:f:family (synthetic inputs)")
    ap.add_argument("--npz", type=Path, nargs="+", default=[], metavar="FILE",
                    help="input files (x, w_gate, w_up, w_down as bf16 bits), e.g. from trained_activations.py")
    ap.add_argument("--density", type=float, default=0.005, help="mean (bulk) rate p of the synthetic configs")
    ap.add_argument("--npz-dir", type=Path, default=None, help="write each synthetic configuration's inputs here")
    ap.add_argument("--min-seconds", type=float, default=0.05)
    ap.add_argument("--functions", default=None,
                    help=f"comma-separated subset of {', '.join(FUNCTIONS)} to time (xla always; default all)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not a.configs and not a.npz:
        ap.error("give --configs (synthetic inputs), --npz FILE [FILE ...] (inputs from files), or both")
    missing = [str(p) for p in a.npz if not p.is_file()]
    if missing:
        ap.error(f"--npz: no such file: {', '.join(missing)}")
    functions = None
    if a.functions:
        functions = tuple(a.functions.split(","))
        unknown = sorted(set(functions) - set(FUNCTIONS))
        if unknown:
            ap.error(f"--functions: unknown {', '.join(unknown)}; choose from {', '.join(FUNCTIONS)}")
    rows = []
    for spec in a.configs.split(",") if a.configs else []:
        m, d, f, family = spec.split(":")
        rows.append(run_config(int(m), int(d), int(f), family, a.density, a.npz_dir, a.min_seconds, functions))
    for path in a.npz:
        rows.append(run_npz(path, a.min_seconds, functions))
    result = dict(run_metadata("bench_patterns"), density=a.density, rows=rows)
    print("wrote", write_result(result, a.out, "patterns"))


if __name__ == "__main__":
    main()
