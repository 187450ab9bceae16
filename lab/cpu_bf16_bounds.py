"""The CPU kernel forced against the CPU's dense side for bf16 calls (plain, and with the
caches a serving layer keeps: w_up.T and the weights' finite columns), XLA's bf16 FFN and
the default call beside them: the measurement behind cpu.BF16_SPARSE_MAX_FRACTION.

    python lab/cpu_bf16_bounds.py OUT.json M:d:f:density ...
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import jax, jax.numpy as jnp
from bench_patterns import family_inputs
from common import run_metadata, time_interleaved
from jax_twell.ops import xla
from jax_twell.ops.common import finite_columns
from jax_twell.ops.ffn import cpu
rows = []
def forced(bound, cached):
    def fn(x, wg, wu, wd, wut, ok):
        old = cpu.SPARSE_MAX_FRACTION, cpu.BF16_SPARSE_MAX_FRACTION
        cpu.SPARSE_MAX_FRACTION = cpu.BF16_SPARSE_MAX_FRACTION = ((None, bound),)
        try:
            return cpu.sparse_ffn(x, wg, wu, wd, w_up_t=wut if cached else None, weights_finite=ok if cached else None)
        finally:
            cpu.SPARSE_MAX_FRACTION, cpu.BF16_SPARSE_MAX_FRACTION = old
    return fn
for cfg in sys.argv[2:]:
    m, d, f, p = cfg.split(":"); m, d, f, p = int(m), int(d), int(f), float(p)
    x, wg, wu, wd = (a.astype(jnp.bfloat16) for a in family_inputs(jax.random.key(m + d), m, d, f, p, "uniform"))
    args = (x, wg, wu, wd, wu.T, finite_columns(wu, wd))
    fns = dict(xla=lambda x, wg, wu, wd, wut, ok: xla.ffn(x, wg, wu, wd), default=lambda x, wg, wu, wd, wut, ok: cpu.sparse_ffn(x, wg, wu, wd),
               dense=forced(1e-9, False), sparse_plain=forced(0.999, False), sparse_cached=forced(0.999, True))
    fns = {k: jax.jit(v) for k, v in fns.items()}
    t = time_interleaved(fns, args, min_seconds=0.1, max_reps=500, rounds=7)
    ms = {k: v[0] * 1e3 for k, v in t.items()}
    rows.append(dict(m=m, d=d, f=f, p=p, ms=ms))
    print(f"{cfg:22s} " + "  ".join(f"{k} {v:8.3f}" for k, v in ms.items())
          + f"  plain/dense {ms['sparse_plain']/ms['dense']:.2f}  cached/dense {ms['sparse_cached']/ms['dense']:.2f}", flush=True)
    Path(sys.argv[1]).write_text(json.dumps(dict(run_metadata("cpu_bf16_bounds"), rows=rows), indent=1))
