"""The training op's backup, old form against new, in one process: the default training step
traced with the backed-up rows computed as ``xla.backup_forward`` / ``xla.backup_vjp`` write
them (new), and as before 52f9760 (old: autodiff of the dense formula over the gathered rows,
the weights' sums with the kernels' gradients in f32), XLA's dense step beside them,
interleaved in rounds (``common.time_interleaved``).

Usage: python lab/backup_ab.py [--m 16384] [--family tail] [--fine] [--out r.json]

``--fine`` adds the new form with sizes at every half step between the op's (M/64, 3M/128,
M/32, 3M/64, ... M/4; "new_fine"): the tail family's 328 rows then take 384, not 512.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

from bench_floor import L1, rel_error  # noqa: E402
from bench_patterns import family_inputs  # noqa: E402
from common import run_metadata, time_interleaved  # noqa: E402

import jax_twell as jt  # noqa: E402
from jax_twell.ops import layout, xla  # noqa: E402


def old_forward(x, w_gate, w_up, w_down, *, m):
    y, l1, _, fired = xla.ffn_with_aux(x, w_gate, w_up, w_down)
    return y, l1 * (x.shape[0] / max(m, 1)), fired


def old_vjp(x, w_gate, w_up, w_down, dy, dl1, *, m, grads):
    db = xla.ffn_with_aux_vjp(x, w_gate, w_up, w_down, dy, dl1 * (x.shape[0] / max(m, 1)))
    add = lambda a, b: None if a is None else (a.astype(jnp.float32) + b.astype(jnp.float32)).astype(a.dtype)
    return (db[0], *(add(a, b) for a, b in zip(grads, db[1:])))


def fine_buckets(m: int, capacity: int | None = None) -> tuple[int, ...]:
    cap = m if capacity is None else min(m, capacity)
    return tuple(sorted({min(cap, -(-(m * j // 128 or 1) // 8) * 8) for j in (2, 3, 4, 6, 8, 12, 16, 24, 32)} | {0}))


@contextlib.contextmanager
def patched(obj, **attrs):
    saved = {k: getattr(obj, k) for k in attrs}
    for k, v in attrs.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(obj, k, v)


@contextlib.contextmanager
def old_backup():
    saved = xla.backup_forward, xla.backup_vjp
    xla.backup_forward, xla.backup_vjp = old_forward, old_vjp
    try:
        yield
    finally:
        xla.backup_forward, xla.backup_vjp = saved


def step(implementation, args, old=False, fine=False):
    def loss(x, wg, wu, wd, cot):
        y, aux = jt.sparse_ffn_train(x, wg, wu, wd, implementation=implementation)
        return jnp.sum(y.astype(jnp.float32) * cot) + L1 * aux.l1
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    with old_backup() if old else contextlib.nullcontext():
        with patched(layout, train_backup_buckets=fine_buckets) if fine else contextlib.nullcontext():
            return fn.lower(*args).compile()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--f", type=int, default=5632)
    ap.add_argument("--density", type=float, default=0.005)
    ap.add_argument("--family", default="tail")
    ap.add_argument("--min-seconds", type=float, default=0.05)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--fine", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    key = jax.random.key(0)
    inputs = family_inputs(key, a.m, a.d, a.f, a.density, a.family)
    args = (*inputs, jax.random.normal(jax.random.fold_in(key, 2), (a.m, a.d), jnp.float32))
    variants = {"xla": ("xla", {}), "old": (None, dict(old=True)), "new": (None, {})}
    if a.fine:
        variants["new_fine"] = (None, dict(fine=True))
    fns, compile_s = {}, {}
    for name, (impl, kw) in variants.items():
        t0 = time.perf_counter()
        fns[name] = step(impl, args, **kw)
        compile_s[name] = time.perf_counter() - t0
    want = fns["xla"](*args)
    errs = {k: rel_error(fn(*args), want) for k, fn in fns.items() if k != "xla"}
    times = time_interleaved(fns, args, min_seconds=a.min_seconds, max_reps=200, rounds=a.rounds)
    row = dict(**run_metadata("backup_ab"), m=a.m, d=a.d, f=a.f, density=a.density, family=a.family,
               ms={k: v[0] * 1e3 for k, v in times.items()}, spread={k: v[1] for k, v in times.items()},
               rel_error=errs, compile_s=compile_s)
    print(json.dumps(row))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(row, fh, indent=1)


if __name__ == "__main__":
    main()
