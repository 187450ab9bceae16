"""The `jax-twell` command: train, evaluate, sample from and plot sparse-FFN language models."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

TRAIN_EPILOG = """\
Any config field can be overridden as key=value, nested fields with dots:
  jax-twell train                                   tiny preset, byte-level, Python stdlib corpus
  jax-twell train steps=1000 l1_coef=3e-3 optim.lr=2e-3
  jax-twell train --preset small data.source=~/my_texts
  jax-twell train model.n_layers=2 batch_size=32 grad_accum=2 mesh.tensor=2
  jax-twell train --resume                          continue runs/tiny from its last checkpoint
Presets: {presets}. Fields (defaults of the chosen preset): jax-twell train --show-config
The run directory (workdir=, default runs/<preset>) receives config.json, metrics.jsonl,
checkpoints/ and, with `jax-twell plot`, plots/. SIGTERM or Ctrl-C saves a checkpoint and stops.
"""


def _add_workdir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", default="runs/tiny", help="run directory written by `jax-twell train` (default: %(default)s)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step to load (default: the newest)")


def _parser() -> argparse.ArgumentParser:
    from jax_twell.train.config import PRESETS

    parser = argparse.ArgumentParser(
        prog="jax-twell",
        description="Train and use transformer language models with activation-sparse (ReLU + L1) FFN blocks.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser(
        "train",
        help="train a model (default: tiny preset on the Python standard library, a few minutes on CPU)",
        description="Train a language model with a sparse FFN; logs loss, CE, L1 term, tokens/s, MFU, "
        "non-zeros per token per layer and dead neurons.",
        epilog=TRAIN_EPILOG.format(presets=", ".join(PRESETS)),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--preset", default="tiny", choices=list(PRESETS), help="configuration preset (default: %(default)s)")
    mode = train.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue the run in workdir from its newest checkpoint")
    mode.add_argument("--fresh", action="store_true", help="delete the previous run in workdir first")
    train.add_argument("--show-config", action="store_true", help="print the resulting configuration and exit")
    train.add_argument("--sample-tokens", type=int, default=200, help="print a sample of this many tokens at the end (0: none)")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")

    evaluate = commands.add_parser("eval", help="held-out cross-entropy and bits per byte of a trained run")
    _add_workdir(evaluate)
    evaluate.add_argument("--batches", type=int, default=None, help="held-out batches (default: the run's eval_batches)")

    generate = commands.add_parser("generate", help="sample text from a trained run")
    _add_workdir(generate)
    generate.add_argument("--prompt", default="def ", help="text to continue (default: %(default)r)")
    generate.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate (default: %(default)s)")
    generate.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default: %(default)s)")
    generate.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest tokens, 0: all (default: %(default)s)")
    generate.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")

    plot = commands.add_parser("plot", help="write PNG plots (loss, sparsity curves, sparsity per layer) of a run")
    plot.add_argument("--workdir", default="runs/tiny", help="run directory (default: %(default)s)")
    plot.add_argument("--out", default=None, help="output folder (default: <workdir>/plots)")

    sweep = commands.add_parser(
        "sweep",
        help="train once per L1 coefficient; write a table (sweep.md, sweep.json) and sweep.png",
        epilog="Example: jax-twell sweep --preset small --l1 0,2e-5,1e-4,3e-4,1e-3,3e-3 steps=2000\n"
        "Runs trained separately (e.g. in parallel, workdir=runs/sweep/l1_X l1_coef=X):\n"
        "  jax-twell sweep --report --workdir runs/sweep",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sweep.add_argument("--preset", default="tiny", choices=list(PRESETS), help="configuration preset (default: %(default)s)")
    sweep.add_argument("--l1", help="comma-separated L1 coefficients (required unless --report)")
    sweep.add_argument("--report", action="store_true", help="train nothing: tabulate the runs already under the sweep directory")
    sweep.add_argument("--workdir", default=None, help="sweep directory (default: runs/sweep-<preset>)")
    sweep.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every run")
    return parser


def _train(args, console) -> int:
    from jax_twell.train import config as config_lib
    from jax_twell.train import trainer

    cfg = config_lib.get_config(args.preset, args.overrides)
    if args.resume and (Path(cfg.workdir) / trainer.CONFIG_FILE).exists():
        cfg = trainer.load_run_config(cfg.workdir, args.overrides)
    if args.show_config:
        console.print_json(data=config_lib.to_dict(cfg))
        return 0
    if args.fresh:
        trainer.clear_run(cfg.workdir)
    try:
        trainer.train(cfg, resume=args.resume, console=console)
    except trainer.RunExistsError as e:
        console.print(f"[red]{e}[/] (or start over with --fresh)")
        return 2
    console.print(
        f"run directory: {cfg.workdir}  (next: jax-twell plot --workdir {cfg.workdir}; "
        f"jax-twell generate --workdir {cfg.workdir})",
        soft_wrap=True,
    )
    if args.sample_tokens > 0:
        _print_sample(cfg, None, "def ", args.sample_tokens, 0.8, 40, 0, console)
    return 0


def _print_sample(cfg, step, prompt, max_new_tokens, temperature, top_k, seed, console) -> None:
    from jax_twell.train import sharding, trainer
    from jax_twell.train.evaluate import sample
    from jax_twell.train.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.workdir)
    if tokenizer is None:
        raise SystemExit(f"{cfg.workdir}: no tokenizer to encode the prompt (set data.tokenizer to a tokenizer.json)")
    setup, state = trainer.restore_run(cfg, step, shard_tokens=False)
    max_new_tokens = min(max_new_tokens, cfg.model.max_seq_len - len(tokenizer.encode(prompt.encode("utf-8"))))
    with sharding.mesh_context(setup.mesh):
        text = sample(
            setup, state.params, tokenizer, prompt,
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
        )
    console.rule(f"sample (step {int(state.step)}, temperature {temperature})")
    console.print(text, markup=False, highlight=False)
    console.rule()


def _eval(args, console) -> int:
    from jax_twell.train import data, sharding, trainer
    from jax_twell.train.evaluate import evaluate
    from jax_twell.train.metrics import format_eval_record
    from jax_twell.train.step import make_eval_step

    cfg = trainer.load_run_config(args.workdir)
    setup, state = trainer.restore_run(cfg, args.step)
    corpus = data.load_corpus(cfg.data, cfg.workdir, cfg.model.vocab_size, save_tokenizer=False)
    with sharding.mesh_context(setup.mesh):
        result = evaluate(
            make_eval_step(setup), state.params, corpus,
            num_batches=args.batches or cfg.eval_batches,
            batch_size=cfg.batch_size // cfg.grad_accum,
            seq_len=trainer.seq_len_of(cfg), mesh=setup.mesh,
        )
    console.print(format_eval_record({"step": int(state.step), **result}) + f" over {result['tokens']:,} tokens")
    return 0


def _generate(args, console) -> int:
    from jax_twell.train import trainer

    cfg = trainer.load_run_config(args.workdir)
    _print_sample(cfg, args.step, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed, console)
    return 0


def _plot(args, console) -> int:
    from jax_twell.train.plot import plot_run

    for path in plot_run(args.workdir, args.out):
        console.print(f"wrote {path}")
    return 0


def _sweep(args, console) -> int:
    from jax_twell.train import config as config_lib
    from jax_twell.train.sweep import markdown_table, report_existing, run_sweep

    sweep_dir = args.workdir or f"runs/sweep-{args.preset}"
    if args.report:
        rows = report_existing(sweep_dir)
    elif not args.l1:
        raise ValueError("--l1 is required (or --report to tabulate existing runs)")
    else:
        l1_values = [float(x) for x in args.l1.split(",") if x.strip()]
        rows = run_sweep(config_lib.get_config(args.preset, args.overrides), l1_values, sweep_dir, console)
    console.print(markdown_table(rows), markup=False)
    console.print(f"wrote {sweep_dir}/sweep.json, sweep.md, sweep.png")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jax-twell` console script."""
    args = _parser().parse_args(argv)
    # orbax reports routine events (read-only managers, async saves) as absl warnings.
    logging.getLogger("absl").setLevel(logging.ERROR)
    from rich.console import Console

    from jax_twell.train.sharding import is_lead, maybe_initialize_distributed

    several = args.command in ("train", "eval", "generate", "sweep") and maybe_initialize_distributed()
    console = Console(quiet=several and not is_lead())  # several processes: process 0 reports (errors: all)
    handler = {"train": _train, "eval": _eval, "generate": _generate, "plot": _plot, "sweep": _sweep}[args.command]
    try:
        return handler(args, console)
    except (KeyError, ValueError, FileNotFoundError) as e:
        console.quiet = False
        console.print(f"[red]error:[/] {e}", markup=True, highlight=False)
        return 2


if __name__ == "__main__":
    sys.exit(main())
