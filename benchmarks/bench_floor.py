"""The "never slower than dense" sweep: the default calls against XLA's dense FFN over a
grid of sizes, shapes, densities and row families, inference and training step.

Each configuration ``M:d:f:density:family[:mode]`` builds bf16 operands whose rows fire
as ``family`` says (``bench_patterns.family_rates``: uniform, tail, pareto, lognormal,
full16; ``density`` is the bulk rate, 1.0 every neuron) and times, interleaved in rounds
with XLA's dense program of the same kind in the same process:

- mode ``infer``: ``jax_twell.sparse_ffn(x, w_gate, w_up, w_down)`` against
  ``jax_twell.ops.xla.ffn``;
- mode ``train``: one training step, ``jax.value_and_grad`` of ``sum(y * cot) + 1e-3 * l1``
  over x and the three weights, through ``jax_twell.sparse_ffn_train`` with no arguments
  against the same through ``implementation="xla"``.

Every row records both times, their ratio (XLA's time / the default's), the relative
error of the default's output against XLA's, and whether the ratio clears ``--floor``
(0.97 by default). The run prints the rows below the floor at the end and exits with
status 1 if there are any (status 0 otherwise), so a script can gate on it. The result
is written after each configuration: a run cut short keeps what it measured.

    python3 benchmarks/bench_floor.py                   # the default grid (GRID below)
    python3 benchmarks/bench_floor.py --configs 16384:4096:11008:0.005:tail,2048:2048:5632:1.0:uniform:train
    python3 benchmarks/bench_floor.py --modes infer --out floor.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_patterns import FAMILIES, family_inputs  # noqa: E402
from common import run_metadata, time_interleaved, write_result  # noqa: E402

import jax_twell as jt  # noqa: E402
from jax_twell.ops import xla  # noqa: E402

MODES = ("infer", "train")
L1 = 1e-3

# M:d:f:density:family:mode. Sizes from decode to long prefill, the paper's shapes and two
# that no kernel was tuned on (d past the warp kernel's 2,048; d and f multiples of 8 but
# not of 64), densities from empty to fully active, every row family.
GRID = ",".join([
    *(f"{m}:2048:5632:0.005:uniform:infer" for m in (1, 4, 64, 512, 2048, 4096, 16384, 65536, 131072)),
    *(f"16384:2048:5632:{p}:uniform:infer" for p in (0.0, 0.02, 0.1, 0.5, 1.0)),
    *(f"16384:2048:5632:0.005:{fam}:infer" for fam in ("tail", "pareto", "lognormal", "full16")),
    "4096:2048:5632:0.005:tail:infer", "8192:2048:5632:1.0:uniform:infer", "2048:2048:5632:1.0:uniform:infer",
    *(f"16384:4096:11008:{p}:{fam}:infer" for p, fam in ((0.005, "uniform"), (0.005, "tail"), (1.0, "uniform"))),
    *(f"16384:1000:2728:0.005:{fam}:infer" for fam in ("uniform", "tail")),
    "8192:512:1408:0.005:lognormal:infer",
    *(f"{m}:2048:5632:0.005:uniform:train" for m in (2048, 16384, 65536)),
    *(f"16384:2048:5632:0.005:{fam}:train" for fam in ("tail", "lognormal")),
    *(f"16384:2048:5632:{p}:uniform:train" for p in (0.05, 1.0)),
    "16384:4096:11008:0.005:tail:train", "16384:1000:2728:0.005:uniform:train",
])


def parse_configs(text: str) -> list[tuple[int, int, int, float, str, str]]:
    """``M:d:f:density:family[:mode]`` items (mode ``infer`` when left out), checked."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        if len(parts) == 5:
            parts.append("infer")
        try:
            if len(parts) != 6:
                raise ValueError
            m, d, f, p = int(parts[0]), int(parts[1]), int(parts[2]), float(parts[3])
        except ValueError:
            raise SystemExit(f"--configs: {item!r} is not M:d:f:density:family[:mode] "
                             "(e.g. 16384:2048:5632:0.005:tail:train)") from None
        family, mode = parts[4], parts[5]
        if family not in FAMILIES:
            raise SystemExit(f"--configs: {item!r}: family must be one of {', '.join(FAMILIES)}")
        if mode not in MODES:
            raise SystemExit(f"--configs: {item!r}: mode must be one of {', '.join(MODES)}")
        if min(m, d, f) < 1 or not 0.0 <= p <= 1.0:
            raise SystemExit(f"--configs: {item!r}: M, d, f must be positive and the density in [0, 1]")
        out.append((m, d, f, p, family, mode))
    return out


def inference_functions():
    """``{"xla": ..., "default": ...}``: jitted ``(x, wg, wu, wd) -> y``."""
    return {"xla": jax.jit(xla.ffn), "default": jax.jit(lambda x, wg, wu, wd: jt.sparse_ffn(x, wg, wu, wd))}


def training_functions():
    """``{"xla": ..., "default": ...}``: jitted training steps ``(x, wg, wu, wd, cot) ->
    (loss, grads)``, the loss ``sum(y * cot) + L1 * aux.l1`` (``cot`` f32 ``[M, d]``, an
    argument: captured as a constant, XLA spends minutes folding it), grads of the four
    operands."""
    def step(implementation):
        def loss(x, wg, wu, wd, cot):
            y, aux = jt.sparse_ffn_train(x, wg, wu, wd, implementation=implementation)
            return jnp.sum(y.astype(jnp.float32) * cot) + L1 * aux.l1
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    return {"xla": step("xla"), "default": step(None)}


def rel_error(got, want) -> float:
    """Relative Frobenius error of ``got`` against ``want`` (trees of arrays, compared leaf by leaf; the largest)."""
    errs = []
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        errs.append(float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)))
    return max(errs)


def run_config(m: int, d: int, f: int, p: float, family: str, mode: str, *, min_seconds: float,
               floor: float) -> dict:
    """Times one configuration (module docstring); returns its row."""
    key = jax.random.key(m * 7 + d + f + FAMILIES.index(family) + int(p * 1e4))
    x, w_gate, w_up, w_down = family_inputs(key, m, d, f, p, family)
    g = jax.jit(lambda x, w: jnp.matmul(x, w, preferred_element_type=jnp.float32) > 0)(x, w_gate)
    row_active = np.asarray(g.sum(axis=1))
    args = (x, w_gate, w_up, w_down)
    if mode == "infer":
        fns = inference_functions()
    else:
        fns = training_functions()
        args += (jax.random.normal(jax.random.fold_in(key, 2), (m, d), jnp.float32),)
    err = rel_error(fns["default"](*args), fns["xla"](*args))
    max_reps = 2000 if m <= 4096 else 200
    times = time_interleaved(fns, args, min_seconds=min_seconds, max_reps=max_reps, rounds=7)
    ratio = times["xla"][0] / times["default"][0]
    row = dict(
        m=m, d=d, f=f, density_target=p, family=family, mode=mode,
        density=float(row_active.mean() / f), row_active_max=int(row_active.max()),
        rows_over_10pct=int((row_active > 0.1 * f).sum()),
        ms={k: v[0] * 1e3 for k, v in times.items()}, spread={k: v[1] for k, v in times.items()},
        ratio=ratio, rel_error=err, holds=bool(ratio >= floor),
    )
    print(f"{mode:5s} M={m:<6d} d={d:<5d} f={f:<5d} {family:9s} p={p:<6g} act {row['density'] * 100:6.2f}% "
          f"max {row['row_active_max']:5d}  xla {row['ms']['xla']:8.3f} ms  default {row['ms']['default']:8.3f} ms  "
          f"{ratio:5.2f}x  err {err:.1e}{'' if row['holds'] else '  BELOW'}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    """Command line (module docstring); returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=GRID, help="comma-separated M:d:f:density:family[:mode] (default: the grid)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of infer,train to run")
    ap.add_argument("--floor", type=float, default=0.97, help="the ratio to XLA every row must reach")
    ap.add_argument("--min-seconds", type=float, default=0.03)
    ap.add_argument("--out", default=None, help="result JSON (default: benchmarks/results/floor_<commit>.json)")
    a = ap.parse_args(argv)
    modes = set(a.modes.split(","))
    if not modes <= set(MODES):
        ap.error(f"--modes: unknown {', '.join(sorted(modes - set(MODES)))}; choose from {', '.join(MODES)}")
    configs = [c for c in parse_configs(a.configs) if c[5] in modes]
    if not configs:
        ap.error("no configuration to run")
    result = dict(run_metadata("bench_floor"), floor=a.floor, rows=[], failed=[])
    start = time.perf_counter()
    for i, (m, d, f, p, family, mode) in enumerate(configs):
        spec = f"{m}:{d}:{f}:{p}:{family}:{mode}"
        print(f"[{i + 1}/{len(configs)}, {time.perf_counter() - start:.0f} s]", end=" ", flush=True)
        try:
            result["rows"].append(run_config(m, d, f, p, family, mode, min_seconds=a.min_seconds, floor=a.floor))
        except Exception as e:  # a configuration that cannot run is reported, the sweep goes on
            result["failed"].append(dict(config=spec, error=f"{type(e).__name__}: {e}"[:2000]))
            print(f"{spec}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        path = write_result(result, a.out, "floor")
    below = [r for r in result["rows"] if not r["holds"]]
    print(f"wrote {path}: {len(result['rows'])} rows, {len(below)} below {a.floor}x, {len(result['failed'])} failed")
    for r in below:
        print(f"  below: {r['mode']} M={r['m']} d={r['d']} f={r['f']} {r['family']} p={r['density_target']}: {r['ratio']:.3f}x")
    return 1 if below or result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
