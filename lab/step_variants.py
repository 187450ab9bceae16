"""Shared by the lab's training-step probes (sync_probe.py, backup_ab.py): the default
training step compiled under trace-time patches, its operands from a row family, and the
variants timed against XLA's dense step in the same rounds, written as one JSON row."""

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


@contextlib.contextmanager
def patched(obj, **attrs):
    """``obj``'s attributes set to ``attrs`` while tracing under it."""
    saved = {k: getattr(obj, k) for k in attrs}
    for k, v in attrs.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(obj, k, v)


def compiled_step(implementation, args, *patches):
    """``jax.value_and_grad`` of ``sum(y * cot) + L1 * l1`` through ``sparse_ffn_train``,
    traced and compiled under ``patches`` (context managers)."""
    def loss(x, wg, wu, wd, cot):
        y, aux = jt.sparse_ffn_train(x, wg, wu, wd, implementation=implementation)
        return jnp.sum(y.astype(jnp.float32) * cot) + L1 * aux.l1
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        return fn.lower(*args).compile()


def parser(doc: str, *, family: str, rounds: int) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--f", type=int, default=5632)
    ap.add_argument("--density", type=float, default=0.005)
    ap.add_argument("--family", default=family)
    ap.add_argument("--min-seconds", type=float, default=0.05)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--out")
    return ap


def step_args(a) -> tuple:
    """``(x, w_gate, w_up, w_down, cot)``: bf16 operands of ``a.family``, an f32 cotangent."""
    key = jax.random.key(0)
    inputs = family_inputs(key, a.m, a.d, a.f, a.density, a.family)
    return (*inputs, jax.random.normal(jax.random.fold_in(key, 2), (a.m, a.d), jnp.float32))


def run(benchmark: str, a, variants: dict, args, **fields) -> dict:
    """Compiles ``variants`` (name -> no-argument function returning a compiled step; "xla"
    among them), checks each against XLA's, times them in interleaved rounds, prints and
    writes (``a.out``) the row."""
    fns, compile_s = {}, {}
    for name, build in variants.items():
        t0 = time.perf_counter()
        fns[name] = build()
        compile_s[name] = time.perf_counter() - t0
    want = fns["xla"](*args)
    errs = {k: rel_error(fn(*args), want) for k, fn in fns.items() if k != "xla"}
    times = time_interleaved(fns, args, min_seconds=a.min_seconds, max_reps=200, rounds=a.rounds)
    row = dict(**run_metadata(benchmark), xla_flags=os.environ.get("XLA_FLAGS", ""), m=a.m, d=a.d, f=a.f,
               density=a.density, family=a.family, **fields,
               ms={k: v[0] * 1e3 for k, v in times.items()}, spread={k: v[1] for k, v in times.items()},
               rel_error=errs, compile_s=compile_s)
    print(json.dumps(row))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(row, fh, indent=1)
    return row
