"""What the training step's two conditionals cost: the CUDA training FFN with its forward's
and backward's ``lax.cond`` replaced by their sparse branches (not exact past the entry
budget or on non-finite operands: a ceiling, not a path), against the default and the
forced op, with XLA's dense step beside them.

Prediction, written before the first run: a ``lax.cond`` whose branches hold cuBLAS
products or FFI calls reads its predicate on the host (lab/conditionals.py), so each
costs a round trip, 45-100 us a call at M=2,048-16,384 in the inference op
(ffi/notes/limits.md). The training step has two (forward, backward): at M=16,384 about
0.1-0.2 ms of a ~2.7 ms step, so the step ratio would move from ~1.93x to ~2.0-2.07x; at
M=65,536 (GPU-bound) nothing.

Usage: python lab/nocond_train.py [--tokens 16384,65536] [--patterns uniform,heavy]
       [--density 0.005] [--out r.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import types

import jax
import jax.numpy as jnp

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")]

import jax_twell as jt  # noqa: E402
from common import time_interleaved  # noqa: E402
from jax_twell.ops import xla  # noqa: E402
from jax_twell.ops.ffn_train import vjp  # noqa: E402
from jax_twell.ops.plan import LayerInfo, Side, TrainOptions  # noqa: E402
from jax_twell.testing import synthetic_ffn_inputs  # noqa: E402

L1 = 2e-5


class _TrueBranchJax(types.ModuleType):
    """``jax`` as vjp.py sees it, with ``lax.cond`` running its first branch only."""

    def __init__(self):
        super().__init__("jax")
        self.lax = types.SimpleNamespace(**{k: getattr(jax.lax, k) for k in dir(jax.lax) if not k.startswith("__")})
        self.lax.cond = lambda pred, true_fn, false_fn, *ops: true_fn(*ops)

    def __getattr__(self, name):
        return getattr(jax, name)


def step(op, *, no_cond: bool = False):
    """jit(value_and_grad) of ``sum(y * cot) + L1 * l1``; ``no_cond``: traced (forward and
    the custom_vjp's backward alike) with vjp.py's conditionals replaced by their sparse
    branches."""

    def loss(x, wg, wu, wd, cot):
        y, l1 = op(x, wg, wu, wd)[:2]
        return (y.astype(jnp.float32) * cot).sum() + L1 * l1

    grad = jax.value_and_grad(loss, (0, 1, 2, 3))
    if not no_cond:
        return jax.jit(grad)

    def patched(*args):
        real = vjp.jax
        vjp.jax = _TrueBranchJax()
        try:
            return grad(*args)
        finally:
            vjp.jax = real

    return jax.jit(patched)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="16384,65536")
    p.add_argument("--patterns", default="uniform,heavy")
    p.add_argument("--density", type=float, default=0.005)
    p.add_argument("--min-seconds", type=float, default=0.25)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    forced = functools.partial(vjp.ffn_with_aux, layer=LayerInfo(side=Side.SPARSE), options=TrainOptions())
    variants = {
        "xla": step(xla.ffn_with_aux),
        "default": step(lambda x, wg, wu, wd: jt.sparse_ffn_train(x, wg, wu, wd)),
        "forced": step(forced),
        "forced_no_cond": step(forced, no_cond=True),
    }
    rows = []
    for m in (int(v) for v in a.tokens.split(",")):
        for pattern in a.patterns.split(","):
            inp = synthetic_ffn_inputs(jax.random.key(m + 3), m, 2048, 5632, density=a.density, pattern=pattern)
            cot = jax.random.normal(jax.random.key(1), (m, 2048), jnp.float32)
            args = (*inp, cot)
            t = time_interleaved(variants, args, min_seconds=a.min_seconds, max_reps=200)
            row = dict(m=m, pattern=pattern, density=a.density, ms={k: v[0] * 1e3 for k, v in t.items()},
                       spread={k: v[1] for k, v in t.items()}, speedup={k: t["xla"][0] / v[0] for k, v in t.items()})
            rows.append(row)
            print(f"{pattern} m={m}: " + "  ".join(f"{k} {v:.3f}ms ({row['speedup'][k]:.2f}x)"
                                                for k, v in row["ms"].items()), flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(dict(jax=jax.__version__, device=str(jax.devices()[0]), commit=os.environ.get("JAX_TWELL_COMMIT"),
                           rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
