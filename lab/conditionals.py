"""Which conditionals XLA runs on the device, and which read their predicate on the host.

Usage: python lab/conditionals.py [--m 8192] [--d 2048] [--f 5632] [--calls 6] [--out c.json]
       (run it once per XLA_FLAGS setting to compare, for example with
       --xla_gpu_enable_command_buffer= and with ...,CONDITIONAL added)

On the GPU, XLA runs a ``lax.cond``/``lax.switch`` either as a conditional node inside a
command buffer (a CUDA graph; the branch is picked on the device) or as a host-side
conditional: the predicate is copied to the host (a device-to-host memcpy), the host waits
for it, then launches the branch, and the GPU idles meanwhile. The default sparse call
holds two such conditionals (the sampled choice and the backup's switch) and its trace
shows 11 memcpy events per call against 1 for a dense one.

Each case below is a small jitted program whose predicate is computed on the device from
its input, with branches made of one kind of operation: fusions only, cuBLAS products,
the pack kernel (an FFI custom call declared command-buffer compatible), a scatter, a
``jnp.nonzero`` with a static size, a ``lax.switch`` of fusions; then the library's
default call. For each: memcpy events per call in a profiler trace (``timeline.traced``),
the kernels per call, and the median time per call back to back. A case whose memcpy count
is zero runs its conditional on the device.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")]

import jax_twell as jt  # noqa: E402
from jax_twell.formats import relu_matmul  # noqa: E402
from jax_twell.ops.pack.binding import pack_twell  # noqa: E402
from jax_twell.testing import synthetic_ffn_inputs  # noqa: E402
from timeline import traced  # noqa: E402


def cases(m: int, d: int, f: int):
    """name -> (function, operands)."""
    inp = synthetic_ffn_inputs(jax.random.key(0), m, d, f, density=0.005)
    x, wg, wu, wd = inp
    g = relu_matmul(x, wg)
    pred = lambda a: jnp.sum(a.astype(jnp.float32)) > 0  # noqa: E731  (on the device)
    return {
        "fusion": (lambda x: jax.lax.cond(pred(x), lambda: x * 2 + 1, lambda: x - 1), (x,)),
        "gemm": (lambda x, w, v: jax.lax.cond(pred(x), lambda: x @ w, lambda: x @ v), (x, wg, wu)),
        "gemm_no_cond": (lambda x, w, v: jnp.where(pred(x), x @ w, x @ v), (x, wg, wu)),
        "custom_call": (lambda g: jax.lax.cond(pred(g), lambda: pack_twell(g, tile=256, capacity=32).counts,
                                               lambda: jnp.zeros((m, -(-f // 256)), jnp.int32)), (g,)),
        "scatter": (lambda x: jax.lax.cond(pred(x), lambda: x.at[jnp.arange(0, m, 7)].set(0), lambda: x), (x,)),
        "nonzero": (lambda x: jax.lax.cond(pred(x), lambda: jnp.nonzero(x[:, 0] > 0, size=m // 8, fill_value=m)[0],
                                           lambda: jnp.zeros((m // 8,), jnp.int32)), (x,)),
        "switch_fusion": (lambda x: jax.lax.switch(jnp.int32(pred(x)) + 1, [lambda: x, lambda: x * 2, lambda: x + 3]),
                          (x,)),
        "default_call": (jt.sparse_ffn, tuple(inp)),
    }


def per_call_ms(fn, args, calls: int = 50) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(calls)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) / calls * 1e3)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--m", type=int, default=8192)
    p.add_argument("--d", type=int, default=2048)
    p.add_argument("--f", type=int, default=5632)
    p.add_argument("--calls", type=int, default=6)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = []
    for name, (fn, args) in cases(a.m, a.d, a.f).items():
        fn = jax.jit(fn)
        try:
            events = traced(fn, args, a.calls)
        except Exception as e:  # a case this platform cannot run (the pack kernel on a CPU)
            row = dict(case=name, error=f"{type(e).__name__}: {str(e)[:200]}")
        else:
            memcpy = sum(1 for _, _, n in events if "memcpy" in n.lower()) / a.calls
            row = dict(case=name, memcpy_per_call=memcpy, kernels_per_call=len(events) / a.calls,
                       ms_per_call=per_call_ms(fn, args))
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = dict(xla_flags=os.environ.get("XLA_FLAGS", ""), jax=jax.__version__, device=str(jax.devices()[0]),
                  m=a.m, d=a.d, f=a.f, rows=rows)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
