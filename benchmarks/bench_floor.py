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

``--npz FILE ...`` adds rows on operands read from files (``common.save_npz``'s format,
family "npz", each file in each mode of ``--modes``): a trained model's FFN inputs and
weights, as ``benchmarks/trained_activations.py`` writes them. ``--anchor DIR`` also runs
the published kernels on every row's operands (``DIR/bench_public.py``, run with
``--anchor-python``, which needs PyTorch: their inference kernel in mode ``infer``, their
hybrid training op in mode ``train``) and puts their figures in the row under
``public``: their time (their protocol: the median of synchronised calls), PyTorch's dense
FFN or step, their relative error, and ``vs_public`` (their time over the default's;
above 1, ours is faster). Shapes their inference kernel does not take (d other than 2,048,
M not a multiple of 256) are skipped with the reason. The anchor shares the GPU with this
process, so XLA does not preallocate its memory when ``--anchor`` is given.

    python3 benchmarks/bench_floor.py                   # the default grid (GRID below)
    python3 benchmarks/bench_floor.py --configs 16384:4096:11008:0.005:tail,2048:2048:5632:1.0:uniform:train
    python3 benchmarks/bench_floor.py --modes infer --out floor.json
    python3 benchmarks/bench_floor.py --configs '' --npz trained/*.npz --anchor .anchor
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_patterns import FAMILIES, family_inputs  # noqa: E402
from common import load_npz, run_metadata, save_npz, time_interleaved, write_result  # noqa: E402

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


def public_figures(anchor: Path, python: str, inputs: tuple, mode: str, timeout: float) -> dict:
    """The published kernels on ``inputs`` (module docstring): their script's figures for
    ``mode``, ``{"skipped": why}`` for a shape their inference kernel does not take, or
    ``{"error": ...}`` where their script did not give a result."""
    (m, d) = inputs[0].shape
    if mode == "infer" and (d != 2048 or m % 256):
        return dict(skipped=f"their inference kernel takes d = 2048 and M a multiple of 256 (d={d}, M={m})")
    script = Path(anchor) / "bench_public.py"
    if not script.is_file():
        return dict(error=f"no {script}")
    their_mode = "inference" if mode == "infer" else "training"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "inputs.npz"
        save_npz(path, *inputs)
        try:
            proc = subprocess.run([python, str(script), str(path), "--mode", their_mode],
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return dict(error=f"no result within {timeout:g} s")
    for line in reversed(proc.stdout.splitlines()):
        try:
            out = json.loads(line)
        except ValueError:
            continue
        return out.get(their_mode, {}) if isinstance(out, dict) else dict(error=line[:300])
    return dict(error=f"exit status {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-500:]}")


def run_inputs(name: str, family: str, inputs: tuple, mode: str, *, key, min_seconds: float, floor: float,
               anchor: dict | None = None, **fields) -> dict:
    """Times the default call against XLA's on the bf16 operands ``inputs`` (``x [M, d]``,
    ``w_gate, w_up [d, f]``, ``w_down [f, d]``) in ``mode`` (module docstring), the
    published kernels too where ``anchor`` (``public_figures``' arguments but the inputs
    and the mode) is given; prints one line and returns the row, ``fields`` included."""
    x, w_gate, w_up, w_down = inputs
    (m, d), f = x.shape, w_gate.shape[1]
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
        name=name, m=m, d=d, f=f, **fields, family=family, mode=mode,
        density=float(row_active.mean() / f), row_active_max=int(row_active.max()),
        rows_over_10pct=int((row_active > 0.1 * f).sum()),
        ms={k: v[0] * 1e3 for k, v in times.items()}, spread={k: v[1] for k, v in times.items()},
        ratio=ratio, rel_error=err, holds=bool(ratio >= floor),
    )
    public = ""
    if anchor is not None:
        row["public"] = public_figures(inputs=inputs, mode=mode, **anchor)
        if "public_ms" in row["public"]:
            row["public"]["vs_public"] = row["public"]["public_ms"] / row["ms"]["default"]
            public = f"  published {row['public']['public_ms']:8.3f} ms ({row['public']['vs_public']:.2f}x)"
        else:
            public = f"  published: {next(iter(row['public'].values()), '')}"[:120]
    print(f"{mode:5s} {name:30s} act {row['density'] * 100:6.2f}% max {row['row_active_max']:5d}  "
          f"xla {row['ms']['xla']:8.3f} ms  default {row['ms']['default']:8.3f} ms  "
          f"{ratio:5.2f}x  err {err:.1e}{'' if row['holds'] else '  BELOW'}{public}", flush=True)
    return row


def run_config(m: int, d: int, f: int, p: float, family: str, mode: str, *, min_seconds: float,
               floor: float, anchor: dict | None = None) -> dict:
    """Times one configuration (module docstring); returns its row."""
    key = jax.random.key(m * 7 + d + f + FAMILIES.index(family) + int(p * 1e4))
    inputs = family_inputs(key, m, d, f, p, family)
    return run_inputs(f"M={m} d={d} f={f} {family} p={p:g}", family, inputs, mode, key=key, min_seconds=min_seconds,
                      floor=floor, anchor=anchor, density_target=p)


def run_npz(path: Path, mode: str, *, min_seconds: float, floor: float, anchor: dict | None = None) -> dict:
    """Times the operands in ``path`` (``common.save_npz``'s format) in ``mode``; returns the row."""
    return run_inputs(path.stem, "npz", load_npz(path), mode, key=jax.random.key(0), min_seconds=min_seconds,
                      floor=floor, anchor=anchor, source=path.name)


def main(argv: list[str] | None = None) -> int:
    """Command line (module docstring); returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=GRID, help="comma-separated M:d:f:density:family[:mode] (default: the grid)")
    ap.add_argument("--npz", type=Path, nargs="+", default=[], metavar="FILE",
                    help="operands from files (common.save_npz's format), each run in every mode of --modes")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of infer,train to run")
    ap.add_argument("--floor", type=float, default=0.97, help="the ratio to XLA every row must reach")
    ap.add_argument("--min-seconds", type=float, default=0.03)
    ap.add_argument("--anchor", type=Path, default=None, metavar="DIR",
                    help="the published kernels' folder (its bench_public.py): their figures on every row's inputs")
    ap.add_argument("--anchor-python", default="python3", help="the Python (with PyTorch) that runs the anchor (default: %(default)s)")
    ap.add_argument("--anchor-seconds", type=float, default=600, help="time limit of one anchor run (default: %(default)s)")
    ap.add_argument("--out", default=None, help="result JSON (default: benchmarks/results/floor_<commit>.json)")
    a = ap.parse_args(argv)
    modes = set(a.modes.split(","))
    if not modes <= set(MODES):
        ap.error(f"--modes: unknown {', '.join(sorted(modes - set(MODES)))}; choose from {', '.join(MODES)}")
    missing = [str(p) for p in a.npz if not p.is_file()]
    if missing:
        ap.error(f"--npz: no such file: {', '.join(missing)}")
    if a.anchor is not None and not (a.anchor / "bench_public.py").is_file():
        ap.error(f"--anchor: no bench_public.py in {a.anchor}")
    configs = [c for c in parse_configs(a.configs) if c[5] in modes]
    files = [(p, mode) for p in a.npz for mode in MODES if mode in modes]
    if not configs and not files:
        ap.error("no configuration to run")
    anchor = None
    if a.anchor is not None:
        # the anchor's PyTorch needs GPU memory beside this process (read when JAX's GPU
        # backend starts, which is below)
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        anchor = dict(anchor=a.anchor, python=a.anchor_python, timeout=a.anchor_seconds)
    result = dict(run_metadata("bench_floor"), floor=a.floor, rows=[], failed=[])
    jobs = [(f"{m}:{d}:{f}:{p}:{family}:{mode}", lambda c=(m, d, f, p, family, mode): run_config(
                *c, min_seconds=a.min_seconds, floor=a.floor, anchor=anchor))
            for m, d, f, p, family, mode in configs]
    jobs += [(f"{path}:{mode}", lambda path=path, mode=mode: run_npz(
                path, mode, min_seconds=a.min_seconds, floor=a.floor, anchor=anchor))
             for path, mode in files]
    start = time.perf_counter()
    path = None
    for i, (spec, job) in enumerate(jobs):
        print(f"[{i + 1}/{len(jobs)}, {time.perf_counter() - start:.0f} s]", end=" ", flush=True)
        try:
            result["rows"].append(job())
        except Exception as e:  # a configuration that cannot run is reported, the sweep goes on
            result["failed"].append(dict(config=spec, error=f"{type(e).__name__}: {e}"[:2000]))
            print(f"{spec}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        path = write_result(result, a.out, "floor")
    below = [r for r in result["rows"] if not r["holds"]]
    print(f"wrote {path}: {len(result['rows'])} rows, {len(below)} below {a.floor}x, {len(result['failed'])} failed")
    for r in below:
        print(f"  below: {r['mode']} {r['name']}: {r['ratio']:.3f}x")
    return 1 if below or result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
