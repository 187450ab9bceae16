"""What the training step's conditionals cost: the default step against the same step with
each ``lax.switch`` of the training op replaced, at trace time, by the branch these rows
take (no host read of the index; exact only for rows that take that branch, checked here
against XLA's step), XLA's dense step beside them in the same rounds.

Usage: python lab/sync_probe.py [--m 16384] [--family uniform] [--branch 1] [--out r.json]

``--branch``: the switch index the rows take: 1 is the sparse side with no backed-up rows,
1 + i the sparse side with the i-th size of ``layout.train_backup_buckets`` (the tail
family's 328 rows at M=16,384 take i = 2, 512 rows). Run it again with XLA_FLAGS set to see
what XLA's own options change (the JSON records the flags).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

from bench_floor import L1, rel_error  # noqa: E402
from bench_patterns import family_inputs  # noqa: E402
from common import run_metadata, time_interleaved  # noqa: E402

import jax_twell as jt  # noqa: E402


@contextlib.contextmanager
def fixed_branch(index: int):
    """``jax.lax.switch`` runs branch ``index`` outright while tracing under it."""
    switch = jax.lax.switch
    jax.lax.switch = lambda _, branches, *ops: branches[index](*ops)
    try:
        yield
    finally:
        jax.lax.switch = switch


def step(implementation, args, branch=None):
    def loss(x, wg, wu, wd, cot):
        y, aux = jt.sparse_ffn_train(x, wg, wu, wd, implementation=implementation)
        return jnp.sum(y.astype(jnp.float32) * cot) + L1 * aux.l1
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    with fixed_branch(branch) if branch is not None else contextlib.nullcontext():
        return fn.lower(*args).compile()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--f", type=int, default=5632)
    ap.add_argument("--density", type=float, default=0.005)
    ap.add_argument("--family", default="uniform")
    ap.add_argument("--branch", type=int, default=1)
    ap.add_argument("--min-seconds", type=float, default=0.05)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out")
    a = ap.parse_args()
    key = jax.random.key(0)
    inputs = family_inputs(key, a.m, a.d, a.f, a.density, a.family)
    args = (*inputs, jax.random.normal(jax.random.fold_in(key, 2), (a.m, a.d), jnp.float32))
    fns = {"xla": step("xla", args), "default": step(None, args), "fixed_branch": step(None, args, a.branch)}
    want = fns["xla"](*args)
    errs = {k: rel_error(fn(*args), want) for k, fn in fns.items() if k != "xla"}
    times = time_interleaved(fns, args, min_seconds=a.min_seconds, max_reps=200, rounds=a.rounds)
    row = dict(**run_metadata("sync_probe"), xla_flags=os.environ.get("XLA_FLAGS", ""), m=a.m, d=a.d, f=a.f,
               density=a.density, family=a.family, branch=a.branch,
               ms={k: v[0] * 1e3 for k, v in times.items()}, spread={k: v[1] for k, v in times.items()},
               rel_error=errs)
    print(json.dumps(row))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(row, fh, indent=1)


if __name__ == "__main__":
    main()
