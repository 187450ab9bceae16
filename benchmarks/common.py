"""Pieces every benchmark script shares: the timing loop, run metadata, the JSON file, the
FFN operands' .npz format.

Benchmarks run as scripts (``python3 benchmarks/bench_*.py``), so this module is imported
from the scripts' own folder.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

RESULTS = Path(__file__).parent / "results"


def time_calls(fn, args, *, min_seconds: float, max_reps: int, trials: int = 15) -> float:
    """Median seconds per call of ``fn(*args)``: after a warm-up call, each of ``trials``
    timings runs enough back-to-back calls (at most ``max_reps``) to last ``min_seconds``
    and waits for the last result (:func:`time_interleaved` with one function)."""
    return time_interleaved({"fn": fn}, args, min_seconds=min_seconds, max_reps=max_reps, rounds=trials)["fn"][0]


def time_interleaved(fns: dict, args, *, min_seconds: float, max_reps: int, rounds: int = 9) -> dict:
    """Per name of ``fns``: ``(median seconds per call, relative spread)`` of ``fn(*args)``,
    timed in interleaved rounds: each round times every function once (after one warm-up
    call each, enough back-to-back calls, at most ``max_reps``, to last ``min_seconds``).
    A slow drift of the GPU's clock then falls on all of them alike, not on whichever
    happened to run during it. Each round starts one function later than the one before,
    so no function always follows the same one (the default call, second after XLA's dense
    FFN in every round, measured 5-9% slower than the same program timed later in the
    round, and XLA's own program 0.91-0.95x of itself there: an order effect, likely the
    clocks after a batch of dense products). The spread is the interquartile range over
    the rounds divided by the median.

    The number of back-to-back calls comes from the fastest of three single calls after
    the warm-up: the first calls of a freshly compiled function can be many times slower
    than the rest (XLA captures its command buffer then), and a count set by one of them
    left so few calls per batch that the batch's time carried the host's dispatch gaps
    (the first configuration of a run measured 1.59 ms per call where it takes 1.27)."""
    result = {}
    for name, ts in round_times(fns, args, min_seconds=min_seconds, max_reps=max_reps, rounds=rounds).items():
        med = statistics.median(ts)
        result[name] = (med, _iqr(ts) / med)
    return result


def _iqr(values) -> float:
    if len(values) < 2:  # one round: no spread
        return 0.0
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


WARM_UP_SECONDS = 3.0


@functools.cache
def warm_up_device(seconds: float = WARM_UP_SECONDS) -> float:
    """Keeps a GPU busy with bf16 matmuls for ``seconds`` (once per process; nothing on a
    CPU) and returns the seconds spent. A freshly started machine's first benchmark read the
    latency-bound decode kernels ~25% slow over its first rounds (20.1 us where the next
    runs read 15.0-15.3; XLA's dense FFN, bandwidth-bound, the same in both), as a GPU
    whose clocks are still coming up from idle would; every timing starts after this."""
    if jax.default_backend() == "cpu":
        return 0.0
    a = jnp.ones((8192, 8192), jnp.bfloat16)
    step = jax.jit(lambda a: (a @ a) * jnp.bfloat16(1e-4))
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a = jax.block_until_ready(step(a))
    return time.perf_counter() - t0


def round_times(fns: dict, args, *, min_seconds: float, max_reps: int, rounds: int) -> dict:
    """Per name of ``fns``: the seconds per call of each round, in round order (the rounds
    of :func:`time_interleaved`), after :func:`warm_up_device`."""
    warm_up_device()
    reps = {}
    for name, fn in fns.items():
        jax.block_until_ready(fn(*args))
        single = []
        for _ in range(3):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            single.append(time.perf_counter() - t0)
        reps[name] = max(1, min(max_reps, int(min_seconds / max(min(single), 1e-6))))
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            fn = fns[name]
            t0 = time.perf_counter()
            for _ in range(reps[name]):
                out = fn(*args)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / reps[name])
    return times


def time_paired(fns: dict, args, *, baseline: str, min_seconds: float, max_reps: int, rounds: int = 15) -> dict:
    """Per name of ``fns``: ``(median seconds per call, relative spread, ratio, ratio
    spread)``, where ratio is the median over the rounds of the baseline's time in a round
    divided by the function's time in the same round (above 1: faster than the baseline).

    On a machine shared with other work the speed of a whole program drifts by 10-20%
    between minutes (two shared cores measured XLA's dense FFN 9.3 to 11.5 ms per call
    within one run); the functions of one round run within a fraction of a second of
    each other, so the ratio of a round carries little of the drift, and the median over
    the rounds less. The ratio spread is the interquartile range of the per-round ratios
    divided by their median."""
    times = round_times(fns, args, min_seconds=min_seconds, max_reps=max_reps, rounds=rounds)
    result = {}
    for name, ts in times.items():
        ratios = [b / t for b, t in zip(times[baseline], ts)]
        med, ratio = statistics.median(ts), statistics.median(ratios)
        result[name] = (med, _iqr(ts) / med, ratio, _iqr(ratios) / ratio)
    return result


def run_metadata(benchmark: str) -> dict:
    """Benchmark name, UTC date, GPU, jax/jaxlib versions and the commit measured.

    ``$JAX_TWELL_COMMIT``, when set, names the commit (a copied tree's git metadata may be
    stale); otherwise git's HEAD, marked ``+dirty`` when tracked files have local edits.
    """
    commit = os.environ.get("JAX_TWELL_COMMIT")
    if not commit:
        git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
        commit = "unknown"
        if git.returncode == 0:
            status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
            commit = git.stdout.strip() + ("+dirty" if status.stdout.strip() else "")
    return dict(
        benchmark=benchmark,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        gpu=jax.devices()[0].device_kind,
        jax=jax.__version__,
        jaxlib=jax.lib.__version__,
        commit=commit,
    )


def write_result(result: dict, out: str | None, prefix: str) -> Path:
    """Writes ``result`` as JSON to ``out`` or ``results/<prefix>_<commit>.json``."""
    path = Path(out) if out else RESULTS / f"{prefix}_{result['commit'][:8]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return path


NPZ_KEYS = ("x_bf16", "w_gate_bf16", "w_up_bf16", "w_down_bf16")


def save_npz(path, x, w_gate, w_up, w_down) -> None:
    """Writes one FFN's operands to ``path`` (.npz) as bf16 bit patterns (uint16) under
    :data:`NPZ_KEYS`: x ``[M, d]``, w_gate and w_up ``[d, f]``, w_down ``[f, d]``, each
    rounded to bf16 first where it is not bf16 already. The published kernels' script and
    :func:`load_npz` read this format."""
    bits = lambda a: np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(a).astype(jnp.bfloat16), jnp.uint16))
    arrays = dict(zip(NPZ_KEYS, (x, w_gate, w_up, w_down)))
    np.savez(path, **{key: bits(a) for key, a in arrays.items()})


def load_npz(path) -> tuple:
    """The operands ``(x, w_gate, w_up, w_down)`` that :func:`save_npz` wrote to ``path``,
    as bf16 JAX arrays. Raises ValueError for a file without those keys or whose shapes do
    not form an FFN (x ``[M, d]``, w_gate and w_up ``[d, f]``, w_down ``[f, d]``)."""
    with np.load(path) as z:
        missing = [k for k in NPZ_KEYS if k not in z]
        if missing:
            raise ValueError(f"{path}: no {', '.join(missing)} (an FFN's operands need {', '.join(NPZ_KEYS)})")
        raw = [np.asarray(z[k]) for k in NPZ_KEYS]
    if any(a.dtype != np.uint16 or a.ndim != 2 for a in raw):
        got = ", ".join(f"{a.dtype}{a.shape}" for a in raw)
        raise ValueError(f"{path}: the operands must be 2-D uint16 (bf16 bits), got {got}")
    (m, d), (dg, f) = raw[0].shape, raw[1].shape
    if dg != d or raw[2].shape != (d, f) or raw[3].shape != (f, d):
        raise ValueError(
            f"{path}: shapes x {raw[0].shape}, w_gate {raw[1].shape}, w_up {raw[2].shape}, w_down {raw[3].shape} "
            "are not x [M, d], w_gate and w_up [d, f], w_down [f, d]"
        )
    return tuple(jax.lax.bitcast_convert_type(jnp.asarray(a), jnp.bfloat16) for a in raw)


def add_shape_arguments(parser, *, m: int) -> None:
    """The profile scripts' shape options: --m (default ``m``), --d 2048, --f 5632,
    --density 0.005, --pattern uniform."""
    parser.add_argument("--m", type=int, default=m)
    parser.add_argument("--d", type=int, default=2048)
    parser.add_argument("--f", type=int, default=5632)
    parser.add_argument("--density", type=float, default=0.005)
    parser.add_argument("--pattern", default="uniform")
