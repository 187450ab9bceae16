"""Kernel-by-kernel profile of lab/device_backup.py's variants (the GPU trace of a few
back-to-back calls, and the host time to dispatch one call).

Usage: python lab/backup_profile.py --configs 16384:uniform:1.0,2048:uniform
       --only backup_all,backup_all_gemm [--calls 8] [--out p.json]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(__file__))
import device_backup  # noqa: E402
from timeline import dispatch_us, summarise, traced  # noqa: E402


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
        m, family, density, args = device_backup.config_inputs(spec, a.d, a.f, 0.005)
        for name in a.only.split(","):
            fn = jax.jit(vs[name])
            s = summarise(traced(fn, args, a.calls), a.calls, f"{name} {family}@{density} m={m}")
            s["dispatch_us"] = dispatch_us(fn, args)
            out.append(s)
            top = list(s.get("kernels_us", {}).items())[:9]
            print(f"{s['label']}: span {s.get('span_us_per_call', 0):.0f} us, busy {s.get('busy_us_per_call', 0):.0f}, "
                  f"dispatch {s['dispatch_us']:.0f}; " + "; ".join(f"{k[:60]} {v:.0f}" for k, v in top), flush=True)
    device_backup.write_rows(a.out, out)


if __name__ == "__main__":
    main()
