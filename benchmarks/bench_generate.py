"""Generation benchmark: a trained run's model as ``generate`` serves it by default, against
the same weights on XLA's dense FFN, tokens/s in one process (CPU or GPU).

The run's newest checkpoint (or ``--step``) is restored as ``jax-twell generate`` restores
it and bound as it binds it (``ModelSetup.bind``: no calibration, no kept layouts; the
sparse FFNs take the library's default path). The dense side is the same parameters in the
same model with ``ffn_implementation="xla"``: XLA's dense FFN, the formula the sparse path
must equal. For each batch in ``--batch``: greedy ``models.generate`` of ``--new-tokens``
after a ``--prompt``-token prompt of the run's held-out text, called as a user calls it
(``generate``'s own programs, compiled by a first untimed call; with ``--compiled``, the
call jitted whole and compiled ahead instead, the form of the results before this option:
a traced call cannot measure its prompt, so it serves only what the model knows of its
layers), timed in interleaved rounds (``common.time_paired``: the speed-up is the median
of each round's own dense / default ratio); tokens/s counts the new tokens over the whole
call (the prompt's prefill included). The generated tokens of the two sides are compared:
at temperature 0 they must be identical.

Also recorded: the machine's logical CPU count and processor, each FFN layer's fraction of
active neurons on the prompts (``TransformerLM.measure_ffn``), and the run's step.

Usage: python benchmarks/bench_generate.py --workdir runs/small [--batch 1,8]
       [--prompt 64] [--new-tokens 128] [--rounds 7] [--compiled] [--out results.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(__file__))
from common import run_metadata, time_paired, write_result  # noqa: E402

from jax_twell.models import TransformerLM, generate  # noqa: E402
from jax_twell.train import sharding, trainer  # noqa: E402
from jax_twell.train.bench import _Tokens  # noqa: E402


def processor() -> str:
    """The CPU's model name (Linux), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build(workdir: str, step: int | None):
    """(config, step, {"default": model, "dense": model}) of the run's checkpoint."""
    cfg = trainer.load_run_config(workdir)
    if cfg.model.ffn != "sparse_relu":
        raise SystemExit(f"the run's FFN is {cfg.model.ffn!r}: this compares a sparse_relu model's two paths")
    setup, state = trainer.restore_run(cfg, step, shard_tokens=False, report=lambda m: print(f"note: {m}"))
    with sharding.mesh_context(setup.mesh):
        default = setup.bind(state.params)
        dense_cfg = dataclasses.replace(cfg.model, ffn_implementation="xla")
        graphdef = nnx.split(nnx.eval_shape(lambda: TransformerLM(dense_cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)[0]
        dense = nnx.merge(graphdef, state.params, setup.rest)
    return cfg, int(state.step), setup, {"default": default, "dense": dense}


def active_fractions(model: TransformerLM, tokens) -> list[float]:
    """Each FFN layer's mean fraction of active neurons per token on ``tokens``."""
    stats, _ = nnx.jit(TransformerLM.measure_ffn)(model, jnp.asarray(tokens, jnp.int32))
    return [float(v) / model.cfg.d_ff for v in np.asarray(stats.nnz_mean, np.float64)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", required=True, help="a sparse_relu training run (its config and checkpoints)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest that loads)")
    p.add_argument("--batch", default="1", help="comma-separated batch sizes (default: %(default)s)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=128, help="generated tokens (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (default: %(default)s)")
    p.add_argument("--min-seconds", type=float, default=1.0, help="shortest timed window (default: %(default)s)")
    p.add_argument("--compiled", action="store_true",
                   help="time generate jitted whole and compiled ahead (default: called as a user calls it)")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    cfg, step, setup, models = build(args.workdir, args.step)
    if args.prompt + args.new_tokens > cfg.model.max_seq_len:
        raise SystemExit(f"--prompt + --new-tokens must be at most the model's max_seq_len={cfg.model.max_seq_len}")
    tokens = _Tokens(cfg, "corpus", args.workdir)
    result = dict(
        **run_metadata("generate"),
        cpu_count=os.cpu_count(),
        processor=processor(),
        workdir=args.workdir,
        step=step,
        model=dict(d_model=cfg.model.d_model, d_ff=cfg.model.d_ff, n_layers=cfg.model.n_layers, dtype=str(cfg.model.dtype)),
        run=dict(preset=cfg.preset, batch_size=cfg.batch_size, seq_len=cfg.seq_len, l1_coef=cfg.l1_coef, steps=cfg.steps),
        prompt=args.prompt,
        timed="generate jitted whole, compiled ahead" if args.compiled else "generate as called",
        new_tokens=args.new_tokens,
        cases=[],
    )
    with sharding.mesh_context(setup.mesh):
        for batch in (int(b) for b in args.batch.split(",")):
            ids = jnp.asarray(tokens.get(batch, args.prompt, index=3))
            fns = {}
            for name, model in models.items():
                if not args.compiled:
                    fns[name] = lambda ids, model=model: generate(model, ids, args.new_tokens, temperature=0.0)
                    continue
                graphdef, state = nnx.split(model)
                fn = jax.jit(lambda state, ids, graphdef=graphdef: generate(
                    nnx.merge(graphdef, state), ids, args.new_tokens, temperature=0.0))
                compiled = fn.lower(state, ids).compile()
                fns[name] = (lambda ids, compiled=compiled, state=state: compiled(state, ids))
            outputs = {name: np.asarray(jax.device_get(fn(ids))) for name, fn in fns.items()}
            same = bool(np.array_equal(outputs["default"], outputs["dense"]))
            first_diff = None if same else int(np.argmax((outputs["default"] != outputs["dense"]).any(axis=0)))
            timed = time_paired(fns, (ids,), baseline="dense", min_seconds=args.min_seconds, max_reps=1000,
                                rounds=args.rounds)
            case = dict(
                batch=batch,
                active_fraction=active_fractions(models["default"], ids),
                identical_tokens=same,
                first_differing_position=first_diff,
                **{f"{name}_s": timed[name][0] for name in fns},
                **{f"{name}_spread": timed[name][1] for name in fns},
                **{f"{name}_tokens_per_s": batch * args.new_tokens / timed[name][0] for name in fns},
                speedup=timed["default"][2],
                speedup_spread=timed["default"][3],
            )
            result["cases"].append(case)
            print(f"batch {batch}: default {case['default_tokens_per_s']:.1f} tok/s, dense "
                  f"{case['dense_tokens_per_s']:.1f} tok/s, {case['speedup']:.2f}x, identical tokens: {same}",
                  flush=True)
    print(f"wrote {write_result(result, args.out, 'generate')}")


if __name__ == "__main__":
    main()
