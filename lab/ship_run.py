"""Moves a trained run's weights between machines in small files, and rebuilds a run from them.

  python lab/ship_run.py pack runs/small_gpu OUTDIR [--shard-mib 15]
      writes OUTDIR/config.json, OUTDIR/meta.json and OUTDIR/params-K.safetensors: the newest
      checkpoint's parameters rounded to bf16 (half the bytes), in shards of at most
      --shard-mib MiB.
  python lab/ship_run.py unpack INDIR runs/small_cpu
      builds a run directory: the config, and one checkpoint at the packed step whose
      parameters are the packed ones (back in the model's dtype), with a freshly initialised
      optimizer state and dead-neuron counters (enough to evaluate, generate and benchmark;
      not to resume training exactly).

The rounding to bf16 is the only change to the weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy

from jax_twell.train import config as config_lib
from jax_twell.train import grow, sharding, trainer


def _flat(params) -> dict[str, jax.Array]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}


def pack(workdir: str, out: str, shard_mib: float) -> None:
    cfg = trainer.load_run_config(workdir)
    setup, state = trainer.restore_run(cfg, None, shard_tokens=False, report=print)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(workdir) / trainer.CONFIG_FILE, out_dir / "config.json")
    tensors = {k: np.asarray(jnp.asarray(v, jnp.bfloat16)) for k, v in _flat(state.params).items()}
    limit = int(shard_mib * 2**20)
    shards: list[dict] = [{}]
    size = 0
    for name, arr in tensors.items():
        if arr.nbytes > limit:
            raise SystemExit(f"{name} has {arr.nbytes} bytes, over one shard of {limit}")
        if size + arr.nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    for i, shard in enumerate(shards):
        safetensors.numpy.save_file(shard, str(out_dir / f"params-{i}.safetensors"))
    meta = {"step": int(state.step), "shards": len(shards), "tensors": len(tensors)}
    (out_dir / "meta.json").write_text(json.dumps(meta))
    print(f"packed step {meta['step']}: {len(tensors)} tensors in {len(shards)} shards")


def unpack(indir: str, workdir: str) -> None:
    in_dir = Path(indir)
    meta = json.loads((in_dir / "meta.json").read_text())
    run = Path(workdir)
    if run.exists() and any(run.iterdir()):
        raise SystemExit(f"{run} is not empty")
    cfg = config_lib.validate(dataclasses.replace(config_lib.load(in_dir / "config.json"), workdir=str(run)))
    tensors: dict[str, np.ndarray] = {}
    for i in range(meta["shards"]):
        tensors.update(safetensors.numpy.load_file(str(in_dir / f"params-{i}.safetensors")))
    mesh = sharding.make_mesh(cfg.mesh)
    with sharding.mesh_context(mesh):
        abstract = trainer.setup_model(cfg.model, cfg.seed, trainer.make_optimizer(cfg.optim, cfg.steps), mesh).abstract_state
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract.params)
    names = [jax.tree_util.keystr(p) for p, _ in leaves]
    if set(names) != set(tensors):
        raise SystemExit(f"tensor names differ: {sorted(set(names) ^ set(tensors))[:8]}")
    params = jax.tree_util.tree_unflatten(treedef, [tensors[n] for n in names])
    setup, state = grow.run_state(cfg, params, step=meta["step"])
    grow.save_run(cfg, setup, state)
    print(f"rebuilt {run} at step {meta['step']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack")
    a.add_argument("workdir")
    a.add_argument("out")
    a.add_argument("--shard-mib", type=float, default=15.0)
    b = sub.add_parser("unpack")
    b.add_argument("indir")
    b.add_argument("workdir")
    args = p.parse_args()
    if args.cmd == "pack":
        pack(args.workdir, args.out, args.shard_mib)
    else:
        unpack(args.indir, args.workdir)


if __name__ == "__main__":
    sys.exit(main())
