"""Kernel-by-kernel profile of lab/device_backup.py's variants (the GPU trace of a few
back-to-back calls, and the host time to dispatch one call).

Usage: python lab/backup_profile.py --configs 16384:uniform:1.0,2048:uniform
       --only backup_all,backup_all_gemm [--calls 8] [--out p.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
import device_backup  # noqa: E402
from timeline import dispatch_us, summarise, traced  # noqa: E402

from jax_twell.ops.common import finite_columns  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="16384:uniform:1.0,2048:uniform")
    p.add_argument("--only", default="xla,backup_all,backup_all_gemm")
    p.add_argument("--d", type=int, default=2048)
    p.add_argument("--f", type=int, default=5632)
    p.add_argument("--calls", type=int, default=8)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    out = []
    vs = device_backup.variants()
    for spec in a.configs.split(","):
        parts = spec.split(":")
        m, family = int(parts[0]), parts[1]
        density = float(parts[2]) if len(parts) > 2 else 0.005
        key = jax.random.key(m * 7 + a.d + a.f + device_backup.FAMILIES.index(family))
        x, wg, wu, wd = device_backup.family_inputs(key, m, a.d, a.f, density, family)
        args = (x, wg, wu, wd, jnp.asarray(wu.T), finite_columns(wu, wd))
        for name in a.only.split(","):
            fn = jax.jit(vs[name])
            s = summarise(traced(fn, args, a.calls), a.calls, f"{name} {family}@{density} m={m}")
            s["dispatch_us"] = dispatch_us(fn, args)
            out.append(s)
            top = list(s.get("kernels_us", {}).items())[:9]
            print(f"{s['label']}: span {s.get('span_us_per_call', 0):.0f} us, busy {s.get('busy_us_per_call', 0):.0f}, "
                  f"dispatch {s['dispatch_us']:.0f}; " + "; ".join(f"{k[:60]} {v:.0f}" for k, v in top), flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(dict(jax=jax.__version__, device=str(jax.devices()[0]),
                           commit=os.environ.get("JAX_TWELL_COMMIT"), rows=out), fh, indent=1)


if __name__ == "__main__":
    main()
