"""The warp path with the backup read on the device (ffi/twell_backup.cu) against the
``lax.switch`` form, as the per-call default and as a known layer runs it. Prediction
written before the first run: the per-call form loses the backup's host round trip
(20-50 us of the 45-100 us both conditionals cost at M=2,048-16,384); a known layer with
no conditional at all reaches the "no backup" floor of lab/nocond.py plus ~5-10 us (the
list kernel and two persistent launches that exit at once): ~0.18 ms at M=2,048 (1.3x).

Usage: python lab/device_backup.py [--configs 2048:uniform,16384:tail,8192:uniform:1.0]
       [--d 2048] [--f 5632] [--density 0.005] [--out r.json]

Variants, timed interleaved: xla (XLA's dense FFN), default (``sparse_ffn``), percall_switch
/ percall_device (the per-call form: XLA's gate, the sample's choice, the pack, the warp
kernel, the backup as a switch or on the device), known_switch (a known layer: the fused
gate, the warp kernel, the switch) and known_device (XLA's gate, the pack, the warp kernel,
the device backup: no conditional), known_device_kept (the same with ``w_up.T`` and the
weights' finite columns kept, as a serving layer keeps them), known_device_fused (the fused
gate, no g: the device backup recomputes its rows' gate), backup_empty (the device
backup alone on an activation with no row to back up) and backup_all (every row backed
up: the backup's products over all M rows); the *_gemm variants run the same on the
wgmma backup (ffi/twell_backup_gemm.cu); percall_flag is the per-call form with no
conditional at all (the sample's choice a device flag to that backup); percall_dense_if
(and _gemm) the per-call form with its dense side on cuBLAS in a CUDA graph's conditional
node (ffi/twell_dense_if.cu), no conditional either.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")]

import jax_twell as jt  # noqa: E402
from bench_patterns import family_inputs, FAMILIES  # noqa: E402
from common import time_interleaved  # noqa: E402
from jax_twell.formats import relu_matmul  # noqa: E402
from jax_twell.ops import xla  # noqa: E402
from jax_twell.ops.common import all_finite, as_dense_nonfinite, finite_columns  # noqa: E402
from jax_twell.ops.ffn import cuda, warp  # noqa: E402
from jax_twell.ops.pack.binding import pack_twell  # noqa: E402


def variants():
    def percall(device, kernel=warp.backup_rows, flag=False, dense_kernel=None, from_g=None):
        def fn(x, wg, wu, wd, wut, cols):
            if device:
                return warp.sparse_ffn(x, wg, wu, wd, backup_kernel=kernel, device_choice=flag,
                                       columns=lambda: finite_columns(wu, wd), dense_kernel=dense_kernel,
                                       rows_from_g=from_g)
            return warp.sparse_ffn(x, wg, wu, wd, finite=lambda: all_finite(x) & finite_columns(wu, wd).all())
        return fn

    def known_switch(x, wg, wu, wd, wut, cols):
        ok = all_finite(x) & finite_columns(wu, wd).all()
        act = cuda.gate_twell(x, wg, tile=256, capacity=32)
        return warp.ffn_from_gate(x, act, wg, wu, wd, finite=ok)

    def known_device(kept, kernel=warp.backup_rows):
        def fn(x, wg, wu, wd, wut, cols):
            g = relu_matmul(x, wg)
            act = pack_twell(g, tile=256, capacity=32)
            return warp.ffn_with_backup(x, g, act, wu, wd, cols if kept else finite_columns(wu, wd),
                                        w_up_t=wut if kept else None, backup_kernel=kernel)
        return fn

    def known_from_g(kept, kernel):
        def fn(x, wg, wu, wd, wut, cols):
            g = relu_matmul(x, wg)
            return warp.ffn_from_g_with_backup(x, g, wu, wd, cols if kept else finite_columns(wu, wd),
                                               w_up_t=wut if kept else None, backup_kernel=kernel)
        return fn

    def known_device_fused(kernel=warp.backup_rows):
        def fn(x, wg, wu, wd, wut, cols):
            act = cuda.gate_twell(x, wg, tile=256, capacity=32)
            return warp.ffn_with_backup(x, None, act, wu, wd, finite_columns(wu, wd), w_act=wg, backup_kernel=kernel)
        return fn

    def backup_only(budget, kernel=warp.backup_rows):
        def fn(x, wg, wu, wd, wut, cols):
            g = relu_matmul(x, wg)
            act = pack_twell(g, tile=256, capacity=32)
            if budget == 0:  # every row with an entry is backed up
                act = dataclasses.replace(act, counts=jnp.maximum(act.counts, 1))
            return kernel(x, g, act, wu, wd, jnp.zeros_like(x), row_budget=budget)
        return fn

    gemm = warp.backup_rows_gemm

    return {
        "xla": lambda x, wg, wu, wd, wut, cols: xla.ffn(x, wg, wu, wd),
        # the dense side the plan runs: the gate and up products kept apart (no concatenation)
        "xla_unmerged": lambda x, wg, wu, wd, wut, cols: xla.ffn_unmerged(x, wg, wu, wd),
        "default": lambda x, wg, wu, wd, wut, cols: jt.sparse_ffn(x, wg, wu, wd),
        "percall_switch": percall(False), "percall_device": percall(True),
        "known_switch": known_switch, "known_device": known_device(False), "known_device_kept": known_device(True),
        "known_device_fused": known_device_fused(),
        "backup_empty": backup_only(warp.ROW_BUDGET), "backup_all": backup_only(0),
        # the same on the wgmma backup (ffi/twell_backup_gemm.cu)
        "percall_gemm": percall(True, gemm), "percall_flag": percall(True, gemm, True), "known_kept_gemm": known_device(True, gemm),
        # the dense side on cuBLAS in a conditional graph node (ffi/twell_dense_if.cu), no conditional
        "percall_dense_if": percall(True, dense_kernel=warp.dense_ffn_if),
        "percall_dense_if_gemm": percall(True, gemm, dense_kernel=warp.dense_ffn_if),
        "known_fused_gemm": known_device_fused(gemm),
        # the rows listed from g by the warp kernel itself (no pack): ffn_rows_from_g
        "percall_from_g": percall(True, gemm, from_g=warp.ffn_rows_from_g),
        "known_kept_from_g": known_from_g(True, gemm),
        "backup_empty_gemm": backup_only(warp.ROW_BUDGET, gemm), "backup_all_gemm": backup_only(0, gemm),
    }


def config_inputs(spec: str, d: int, f: int, density: float):
    """``M:family[:density]`` -> (M, family, density, the variants' arguments): x and the
    weights of that family, ``w_up.T`` and the weights' finite columns."""
    parts = spec.split(":")
    m, family = int(parts[0]), parts[1]
    density = float(parts[2]) if len(parts) > 2 else density
    key = jax.random.key(m * 7 + d + f + FAMILIES.index(family))
    x, wg, wu, wd = family_inputs(key, m, d, f, density, family)
    return m, family, density, (x, wg, wu, wd, jnp.asarray(wu.T), finite_columns(wu, wd))


def write_rows(path: str | None, rows: list) -> None:
    """The rows as JSON with the jax version, the device and $JAX_TWELL_COMMIT (no path: nothing)."""
    if path:
        with open(path, "w") as fh:
            json.dump(dict(jax=jax.__version__, device=str(jax.devices()[0]),
                           commit=os.environ.get("JAX_TWELL_COMMIT"), rows=rows), fh, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="2048:uniform,2048:tail,8192:uniform,16384:uniform,16384:tail,"
                   "65536:uniform,2048:uniform:1.0,16384:uniform:1.0")
    p.add_argument("--d", type=int, default=2048)
    p.add_argument("--f", type=int, default=5632)
    p.add_argument("--density", type=float, default=0.005)
    p.add_argument("--min-seconds", type=float, default=0.25)
    p.add_argument("--only", default=None, help="comma-separated variant names (xla always)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = []
    for spec in a.configs.split(","):
        m, family, density, args = config_inputs(spec, a.d, a.f, a.density)
        vs = variants()
        if a.only:
            keep = {"xla", *a.only.split(",")}
            vs = {k: v for k, v in vs.items() if k in keep}
        fns = {k: jax.jit(v) for k, v in vs.items()}
        want = np.asarray(fns["xla"](*args), np.float32)
        err = {}
        for k, fn in fns.items():
            if k.startswith("backup_"):
                continue
            got = np.asarray(fn(*args), np.float32)
            err[k] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        t = time_interleaved(fns, args, min_seconds=a.min_seconds, max_reps=2000 if m <= 4096 else 200)
        row = dict(m=m, family=family, d=a.d, f=a.f, density=density, ms={k: v[0] * 1e3 for k, v in t.items()},
                   spread={k: v[1] for k, v in t.items()},
                   speedup={k: t["xla"][0] / v[0] for k, v in t.items()}, rel_error=err)
        rows.append(row)
        print(f"{family}@{density} m={m}: " + "  ".join(
            f"{k} {v:.3f}ms ({row['speedup'][k]:.2f}x{', err %.0e' % err[k] if k in err else ''})"
            for k, v in row["ms"].items()), flush=True)
    write_rows(a.out, rows)


if __name__ == "__main__":
    main()
