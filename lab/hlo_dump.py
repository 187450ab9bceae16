"""The optimized HLO of one lab/device_backup.py variant on the GPU, to name the fusions a
trace lists (lab/timeline.py reports kernels by their fusion names only).

Usage: python lab/hlo_dump.py --config 16384:uniform --variant default --out hlo.txt
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(__file__))
import device_backup  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="16384:uniform")
    p.add_argument("--variant", default="default")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    _, _, _, args = device_backup.config_inputs(a.config, 2048, 5632, 0.005)
    text = jax.jit(device_backup.variants()[a.variant]).lower(*args).compile().as_text()
    with open(a.out, "w") as fh:
        fh.write(text)
    print(f"{a.variant} {a.config}: {len(text.splitlines())} lines of HLO")


if __name__ == "__main__":
    main()
