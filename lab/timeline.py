"""GPU timeline of back-to-back calls: kernel time against idle gaps, sparse and dense.

Usage: python lab/timeline.py [--kernel blocked_union] [--rule forced] [--m 16384]
       [--d 2048] [--f 5632] [--density 0.005] [--pattern uniform] [--calls 6] [--train]
       [--out t.json]

Runs the op (forced sparse; or, with ``--rule auto``, under the default rule decided per
call on the device; with ``--rule layer``, under the default rule given ``--density`` as the
layer's known active fraction) and XLA's dense FFN ``--calls`` times back to back (as the
"call" clock of bench_inference.py does) under jax.profiler, reads the Perfetto trace the
profiler writes, and reports over the last half of the calls: the wall span on the GPU per
call, the summed kernel time, the idle time between kernels, the largest gaps with the
kernels on each side, and the time per kernel name; then, outside the profiler, the host
time for one call to return (its dispatch).

Read kernel times here as a profile, not as the benchmark's ratio: under the profiler the
host dispatches slowly, so calls may run with idle gaps between them on a cooler GPU than
the benchmark's sustained back-to-back load (ffi/notes/twell_ffn_blocked.md). Idle gaps
inside a call are not reliable either: the ~10 us gap the trace shows after each
``lax.cond``'s conditional node was worth 2-8 us of the call clock when the branch was
removed ("The entry budget's branch inside the handler", same notes).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from jax_twell.ops import xla
from jax_twell.ops.ffn import cuda as ffn_cuda
from jax_twell.ops.ffn_train import vjp as train_cuda
from jax_twell.ops.plan import FFNOptions, Kernel, LayerInfo, Side
from jax_twell.testing import synthetic_ffn_inputs

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))  # common.py

from common import add_shape_arguments, run_metadata


def device_events(trace: dict) -> list[tuple[float, float, str]]:
    """(start us, duration us, name) of every kernel on a GPU stream line of the trace
    (the device's derived lines, such as "XLA Ops", repeat the kernels and are left out)."""
    events = trace.get("traceEvents", [])
    names = {
        (e["pid"], e.get("tid")): str(e.get("args", {}).get("name", ""))
        for e in events
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name")
    }
    gpu = {pid for (pid, tid), n in names.items() if tid is None and "GPU" in n}
    streams = {(pid, tid) for (pid, tid), n in names.items() if pid in gpu and tid is not None and n.startswith("Stream")}
    out = [
        (float(e["ts"]), float(e.get("dur", 0.0)), e.get("name", "?"))
        for e in events
        if e.get("ph") == "X" and e.get("pid") in gpu and (not streams or (e["pid"], e.get("tid")) in streams)
    ]
    return sorted(out)


def summarise(events, calls: int, label: str) -> dict:
    """Span, busy time and gaps over the last half of ``calls`` equal calls."""
    if not events:
        return dict(label=label, error="no GPU events in the trace")
    per_call = len(events) // calls
    tail = events[-per_call * (calls // 2):]
    span = tail[-1][0] + tail[-1][1] - tail[0][0]
    # Busy time as the union of intervals (streams may overlap).
    busy, end = 0.0, -1e30
    for t, d, _ in tail:
        if t + d > end:
            busy += t + d - max(t, end)
            end = t + d
    gaps = []
    end, prev = tail[0][0] + tail[0][1], tail[0][2]
    for t, d, n in tail[1:]:
        if t > end:
            gaps.append((t - end, prev, n))
        if t + d >= end:
            end, prev = t + d, n
    gaps.sort(reverse=True)
    n = calls // 2
    per_kernel: dict[str, float] = {}
    for _, d, name in tail:  # names cut to 120 characters: kernels that share that prefix add up
        per_kernel[name[:120]] = per_kernel.get(name[:120], 0.0) + d / n
    return dict(
        label=label,
        kernels_per_call=per_call,
        span_us_per_call=span / n,
        busy_us_per_call=busy / n,
        idle_us_per_call=(span - busy) / n,
        largest_gaps=[dict(us=g, after=a[:90], before=b[:90]) for g, a, b in gaps[:8]],
        kernels_us=dict(sorted(per_kernel.items(), key=lambda kv: -kv[1])),
    )


def dispatch_us(fn, args, calls: int = 30) -> float:
    """Median host time for a call to return (the GPU idle before each call)."""
    times = []
    for _ in range(calls):
        jax.block_until_ready(fn(*args))
        t0 = time.perf_counter()
        out = fn(*args)
        times.append(1e6 * (time.perf_counter() - t0))
        jax.block_until_ready(out)
    return statistics.median(times)


def traced(fn, args, calls: int) -> list:
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            outs = [fn(*args) for _ in range(calls)]
            jax.block_until_ready(outs)
        files = glob.glob(os.path.join(tmp, "**", "perfetto_trace.json.gz"), recursive=True)
        if not files:
            raise SystemExit("the profiler wrote no perfetto_trace.json.gz")
        with gzip.open(files[0], "rt") as fh:
            return device_events(json.load(fh))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernel", default="blocked_union", choices=[k.value for k in Kernel])
    p.add_argument("--rule", default="forced", choices=("forced", "auto", "layer"),
                   help="forced sparse; the default rule per call; or with --density as the layer's fraction")
    p.add_argument("--calls", type=int, default=6)
    p.add_argument("--train", action="store_true", help="a training step (all gradients) instead of the forward")
    p.add_argument("--family", default=None, help="a bench_floor row family (tail, pareto, ...) instead of --pattern")
    p.add_argument("--out", default=None)
    add_shape_arguments(p, m=16384)
    a = p.parse_args()
    if a.family:  # bench_floor's row families (tail, pareto, lognormal, full16), bf16
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
        from bench_patterns import family_inputs
        inp = family_inputs(jax.random.key(0), a.m, a.d, a.f, a.density, a.family)
    else:
        inp = synthetic_ffn_inputs(jax.random.key(0), a.m, a.d, a.f, density=a.density, pattern=a.pattern)
    forced = a.rule == "forced"
    layer = LayerInfo(active_fraction=a.density if a.rule == "layer" else None,
                      side=Side.SPARSE if forced else Side.AUTO)
    sparse = jax.jit(
        lambda x, wg, wu, wd: ffn_cuda.sparse_ffn(x, wg, wu, wd, layer=layer, options=FFNOptions(kernel=a.kernel))
    )
    dense = jax.jit(xla.ffn)
    if a.train:  # one training step's gradients (x and every weight) instead of the forward
        # As bench_training.py's step: a random cotangent (with sum(y) it is a broadcast of
        # ones, which the sparse backward has to materialise as an operand) and
        # value_and_grad (the loss needs y, so XLA's dense step keeps its forward down matmul).
        cot = jax.random.normal(jax.random.key(1), (a.m, a.d), jnp.float32)

        def grads(ffn):
            loss = lambda x, wg, wu, wd, c: (ffn(x, wg, wu, wd).astype(jnp.float32) * c).sum()
            return jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3)))

        sparse = grads(lambda *w: train_cuda.ffn_with_aux(*w, layer=layer)[0])
        dense = grads(xla.ffn)
        inp = (*inp, cot)
    rows = [
        summarise(traced(sparse, inp, a.calls), a.calls, f"{a.rule} {a.kernel}"),
        summarise(traced(dense, inp, a.calls), a.calls, "dense xla"),
    ]
    rows[0]["dispatch_us"] = dispatch_us(sparse, inp)
    rows[1]["dispatch_us"] = dispatch_us(dense, inp)
    result = dict(
        **run_metadata("timeline_train" if a.train else "timeline_inference"),
        shape=dict(m=a.m, d=a.d, f=a.f, density=a.density, pattern=a.family or a.pattern, kernel=a.kernel, rule=a.rule),
        rows=rows,
    )
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(result, fh, indent=1)
    for r in rows:
        if "error" in r:
            print(f"{r['label']}: {r['error']}")
            continue
        print(
            f"{r['label']:>22}: {r['kernels_per_call']} kernels, span {r['span_us_per_call']:.1f} us/call, "
            f"busy {r['busy_us_per_call']:.1f}, idle {r['idle_us_per_call']:.1f}, host dispatch {r['dispatch_us']:.1f} us"
        )
        for g in r["largest_gaps"][:3]:
            print(f"{'':>24}gap {g['us']:.1f} us after {g['after'][:50]} before {g['before'][:50]}")
        for name, us in list(r["kernels_us"].items())[:8]:
            print(f"{'':>24}{us:8.1f} us  {name[:80]}")


if __name__ == "__main__":
    main()
