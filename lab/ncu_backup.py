"""A few calls of one lab/device_backup.py variant, for ncu to profile kernel by kernel
(each launch's grid, duration and throughput; the GPU trace merges launches of one name).

Usage: ncu --kernel-name regex:'GemmUniversal|ListGather|Mix|Scatter' --launch-count 12 \
       python lab/ncu_backup.py --config 16384:tail --variant known_kept_gemm
Prints the rows the warp kernel leaves to the backup (the row budget, the tile capacity).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
import device_backup  # noqa: E402

from jax_twell.ops.ffn import warp  # noqa: E402
from jax_twell.formats import pack_twell_reference  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="16384:tail")
    p.add_argument("--variant", default="known_kept_gemm")
    p.add_argument("--calls", type=int, default=3)
    a = p.parse_args()
    m, family, density, args = device_backup.config_inputs(a.config, 2048, 5632, 0.005)
    x, wg = args[0], args[1]
    g = jax.nn.relu(x @ wg)
    nnz = jnp.sum(g != 0, axis=-1)
    act = pack_twell_reference(g, tile=256, capacity=32)
    over = jnp.any(act.counts > act.capacity, axis=-1) | (nnz > warp.ROW_BUDGET)
    print(f"{family}@{density} m={m}: rows backed up {int(jnp.sum(over))}, mean entries {float(jnp.mean(nnz)):.1f}")
    fn = jax.jit(device_backup.variants()[a.variant])
    for _ in range(a.calls):
        fn(*args).block_until_ready()


if __name__ == "__main__":
    main()
