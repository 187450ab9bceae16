"""The `jax-twell` command: train, evaluate, sample from, plot and benchmark sparse-FFN language models."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path

from rich.markup import escape

TRAIN_EPILOG = """\
Any config field can be overridden as key=value, nested fields with dots:
  jax-twell train                                   tiny preset, byte-level, Python stdlib corpus
  jax-twell train steps=1000 l1_coef=3e-3 optim.lr=2e-3
  jax-twell train --preset small data.source=~/my_texts
  jax-twell train model.n_layers=2 batch_size=32 grad_accum=2 mesh.tensor=2
  jax-twell train --resume                          continue runs/tiny from its last checkpoint
Presets: {presets}. Fields (defaults of the chosen preset): jax-twell train --show-config
Presets and the hardware they are meant for: {hardware}.
The run directory (workdir=, default runs/<preset>) receives config.json, metrics.jsonl,
checkpoints/ and, with `jax-twell plot`, plots/. One run at a time per directory (train.lock).
A non-finite loss or gradient stops the run (nonfinite=skip drops such steps instead);
no non-finite state is ever checkpointed. keep_checkpoints=0 keeps every checkpoint.
Exit status: 0 done; 2 refused (bad config value, directory in use or holding another run,
no checkpoint that loads, unreadable file); 3 diverged (non-finite loss or gradient);
143 / 130 stopped by SIGTERM / Ctrl-C after saving a checkpoint (continue with --resume).
"""


def _add_workdir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", default="runs/tiny", help="run directory written by `jax-twell train` (default: %(default)s)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step to load (default: the newest)")


def _parser() -> argparse.ArgumentParser:
    from jax_twell.train.config import PRESET_HARDWARE, PRESETS

    parser = argparse.ArgumentParser(
        prog="jax-twell",
        description="Train and use transformer language models with activation-sparse (ReLU + L1) FFN blocks.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser(
        "train",
        help="train a model (default: tiny preset on the Python standard library, a few minutes on a CPU; "
        "--preset small and larger are meant for GPUs)",
        description="Train a language model with a sparse FFN; logs loss, CE, L1 term, tokens/s, MFU (on "
        "accelerators with a known peak), non-zeros per token per layer and dead neurons.",
        epilog=TRAIN_EPILOG.format(
            presets=", ".join(PRESETS), hardware="; ".join(f"{k}: {v}" for k, v in PRESET_HARDWARE.items())
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--preset", default="tiny", choices=list(PRESETS), help="configuration preset (default: %(default)s)")
    mode = train.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue the run in workdir from its newest checkpoint")
    mode.add_argument("--fresh", action="store_true", help="delete the previous run in workdir first")
    train.add_argument("--show-config", action="store_true", help="print the resulting configuration and exit")
    train.add_argument("--sample-tokens", type=int, default=200, help="print a sample of this many tokens at the end (0: none)")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")

    evaluate = commands.add_parser(
        "eval", help="held-out cross-entropy and bits per byte of a trained run (on the hardware it trained on; "
        "seconds for tiny on a CPU)"
    )
    _add_workdir(evaluate)
    evaluate.add_argument("--batches", type=int, default=None, help="held-out batches (default: the run's eval_batches)")

    generate = commands.add_parser(
        "generate", help="sample text from a trained run (seconds for tiny on a CPU; GPU for the larger presets)"
    )
    _add_workdir(generate)
    generate.add_argument("--prompt", default="def ", help="text to continue (default: %(default)r)")
    generate.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate (default: %(default)s)")
    generate.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default: %(default)s)")
    generate.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest tokens, 0: all (default: %(default)s)")
    generate.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")

    plot = commands.add_parser(
        "plot", help="write PNG plots (loss, sparsity curves, sparsity per layer) of a run (any machine, seconds)"
    )
    plot.add_argument("--workdir", default="runs/tiny", help="run directory (default: %(default)s)")
    plot.add_argument("--out", default=None, help="output folder (default: <workdir>/plots)")

    sweep = commands.add_parser(
        "sweep",
        help="train once per L1 coefficient; write a table (sweep.md, sweep.json) and sweep.png "
        "(as train: tiny on a CPU, small and larger on a GPU)",
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
    _add_bench(commands, PRESETS)

    grow = commands.add_parser(
        "grow",
        help="a deeper model from a trained run whose every FFN reads what its trained layer read (for "
        "benchmarking shapes too large to train to sparsity; GPU for the paper's presets)",
        description="Make a run of a deeper shape from a trained run's layers: layer i of L is a copy of trained "
        "layer floor(i * L0 / L); embedding, final norm and head are the source's. In each block of copies the "
        "first keeps its attention output, the last its FFN output, and the others' outputs are scaled by 2^-64 "
        "(quiet): the grown model computes the source's function and each FFN sees its trained layer's "
        "activations token by token, at the deeper model's cost. --full-copies keeps every copy whole (depth "
        "up-scaling, a start for a fine-tune; later layers then fire less than their trained ones). Writes the "
        "run (config, tokenizer, a checkpoint at the source's step whose optimizer state, dead-neuron counters and "
        "training sides follow the same layer map) and grow.json: per layer, "
        "the source's and the grown model's fraction of active neurons and non-zeros per token (50th / 99th "
        "percentile, max) on the same held-out tokens.",
        epilog="Example: jax-twell grow --from runs/e2e/0.5b-sparse --preset 1.5b --workdir runs/e2e/1.5b-grown\n"
        "then: jax-twell bench --workdir runs/e2e/1.5b-grown   (label its figures: a grown model, not a trained one)\n"
        "Exit status: 0 done; 2 refused (another shape, fewer layers, a non-empty --workdir, no checkpoint, float16 parameters).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    grow.add_argument("--from", dest="source", required=True, help="the trained run directory")
    grow.add_argument("--step", type=int, default=None, help="its checkpoint step (default: the newest)")
    grow.add_argument("--preset", required=True, choices=list(PRESETS), help="the deeper shape (same widths as the source)")
    grow.add_argument("--workdir", required=True, help="the new run directory (must be new or empty)")
    grow.add_argument("--full-copies", action="store_true", help="every copy the whole trained layer (no quiet outputs)")
    grow.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides of the new run (e.g. model.n_layers=, steps=)")
    return parser


BENCH_EPILOG = """\
Examples:
  jax-twell bench --preset tiny                       fresh weights (figures meaningless for speed), CPU
  jax-twell bench --workdir runs/0.5b batch_size=64 grad_accum=4 --out bench/0.5b-h200.json
  jax-twell bench --preset tiny --prefill 1x64 --decode none --train-steps 0 model.n_layers=2
The three models, built from one preset in one process on the first device: sparse (SparseFFN,
ReLU gate, the run's implementation: by default the library's), swiglu and dense_relu (DenseFFN,
same shape, fresh weights). With --workdir the sparse model takes the run's checkpoint and
configuration, else fresh weights (the JSON says so). key=value overrides apply to that
configuration: batch_size, grad_accum and seq_len set the training case (default: the
preset's), peak_tflops the peak for MFU. Sequences longer than the model's context are cut to
it (the JSON notes each cut). Writes JSON (metadata, raw timings, metrics, sparse/baseline
ratios) and a PNG of the ratios. Where the device cannot measure (MFU without a known peak,
power off NVIDIA GPUs, the allocator's figures on CPU) the values are null with a reason.
Exit status: 0 done; 2 refused (bad value, no checkpoint that loads).
"""


def _shapes(text: str) -> tuple[tuple[int, int], ...]:
    """--prefill's value: comma-separated BATCHxSEQ, or none."""
    if text.strip().lower() == "none":
        return ()
    shapes = []
    for item in text.split(","):
        batch, sep, seq = item.strip().lower().partition("x")
        if not sep or not batch.isdigit() or not seq.isdigit() or int(batch) < 1 or int(seq) < 1:
            raise argparse.ArgumentTypeError(f"expected BATCHxSEQ[,BATCHxSEQ...] with positive integers (or none), got {item!r}")
        shapes.append((int(batch), int(seq)))
    return tuple(shapes)


def _batches(text: str) -> tuple[int, ...]:
    """--decode's value: comma-separated batch sizes, or none."""
    if text.strip().lower() == "none":
        return ()
    items = [t.strip() for t in text.split(",")]
    if not all(t.isdigit() and int(t) >= 1 for t in items):
        raise argparse.ArgumentTypeError(f"expected positive batch sizes B[,B...] (or none), got {text!r}")
    return tuple(int(t) for t in items)


def _count(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text!r}")
    return value


def _add_bench(commands, presets) -> None:
    bench = commands.add_parser(
        "bench",
        help="prefill, decode and training throughput, MFU, memory and energy per token of a sparse model "
        "against SwiGLU and dense-ReLU baselines of the same shape (JSON and PNG; GPU for the paper's presets)",
        description="Measure a sparse-FFN model and its dense baselines on the current device.",
        epilog=BENCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("--preset", default=None, choices=list(presets), help="configuration preset without --workdir (default: tiny)")
    bench.add_argument("--workdir", default=None, help="a run written by `jax-twell train`: its checkpoint and config (default: fresh weights)")
    bench.add_argument("--step", type=int, default=None, help="checkpoint step to load (default: the newest)")
    bench.add_argument("--prefill", type=_shapes, default="1x2048,8x2048,32x2048", metavar="BxT,...",
                       help="prefill shapes, or none (default: %(default)s)")
    bench.add_argument("--decode", type=_batches, default="1,8,64", metavar="B,...", help="decode batch sizes, or none (default: %(default)s)")
    bench.add_argument("--prompt", type=_count(1), default=512, help="decode prompt tokens (default: %(default)s)")
    bench.add_argument("--new-tokens", type=_count(1), default=256, help="decode new tokens (default: %(default)s)")
    bench.add_argument("--train-steps", type=_count(0), default=2, help="training steps per timed window at least, 0: no training case (default: %(default)s)")
    bench.add_argument("--repeats", type=_count(1), default=5, help="timed rounds (default: %(default)s)")
    bench.add_argument("--warmup", type=_count(1), default=2, help="untimed calls of each program first (default: %(default)s)")
    bench.add_argument("--min-seconds", type=_seconds, default=0.5, help="shortest timed window, calls repeated to fill it (default: %(default)s)")
    bench.add_argument("--power-interval", type=_seconds, default=0.01, help="seconds between power readings (default: %(default)s)")
    bench.add_argument("--data", choices=("auto", "corpus", "random"), default="auto",
                       help="tokens: the run's corpus, uniform random, or auto: corpus with --workdir (default: %(default)s)")
    bench.add_argument("--no-calibrate", action="store_true", help="serve the sparse model uncalibrated, without decode layouts")
    bench.add_argument("--out", default=None, help="JSON file (default: <workdir>/bench_<platform>.json, or bench/<preset>_<platform>.json)")
    bench.add_argument("--png", default=None, help="PNG of the ratios (default: the JSON's path with .png)")
    bench.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (batch_size=, grad_accum=, seq_len=, peak_tflops=, model.*)")


EXIT_REFUSED = 2  # the command cannot run as asked: bad value, locked or occupied directory, unreadable file
EXIT_DIVERGED = 3  # training stopped on non-finite steps


def _train(args, console) -> int:
    from jax_twell.train import config as config_lib
    from jax_twell.train import trainer

    cfg = config_lib.get_config(args.preset, args.overrides)
    if args.resume and (Path(cfg.workdir) / trainer.CONFIG_FILE).exists():
        cfg = trainer.load_run_config(cfg.workdir, args.overrides)
    if args.show_config:
        console.print_json(data=config_lib.to_dict(cfg))
        return 0
    try:
        trainer.train(cfg, resume=args.resume, fresh=args.fresh, console=console)
    except trainer.RunExistsError as e:
        console.print(f"[red]{escape(str(e))}[/] (or start over with --fresh)")
        return EXIT_REFUSED
    except trainer.Interrupted as e:
        console.print(
            f"{escape(str(e))}; continue with: jax-twell train --resume workdir={cfg.workdir}", soft_wrap=True
        )
        return 128 + e.signal
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

    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"--temperature must be a finite number >= 0 (0: greedy), got {temperature}")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.workdir)
    if tokenizer is None:
        raise SystemExit(f"{cfg.workdir}: no tokenizer to encode the prompt (set data.tokenizer to a tokenizer.json)")
    prompt_len, context = len(tokenizer.encode(prompt.encode("utf-8"))), cfg.model.max_seq_len
    if prompt_len >= context:
        raise ValueError(
            f"the prompt is {prompt_len} tokens; the model's context is max_seq_len={context} tokens, "
            f"so a prompt can have at most {context - 1}"
        )
    if prompt_len + max_new_tokens > context:
        console.print(
            f"[yellow]note:[/] --max-new-tokens {max_new_tokens} cut to {context - prompt_len}: the prompt "
            f"({prompt_len} tokens) and the new tokens must fit the model's context of {context} tokens",
            highlight=False,
        )
        max_new_tokens = context - prompt_len
    setup, state = trainer.restore_run(
        cfg, step, shard_tokens=False, report=lambda m: console.print(f"[yellow]{escape(m)}[/]", highlight=False)
    )
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

    if args.batches is not None and args.batches < 1:
        raise ValueError(f"--batches must be >= 1, got {args.batches}")
    cfg = trainer.load_run_config(args.workdir)
    setup, state = trainer.restore_run(
        cfg, args.step, report=lambda m: console.print(f"[yellow]{escape(m)}[/]", highlight=False)
    )
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


def _bench(args, console) -> int:
    import jax

    from jax_twell.train import config as config_lib
    from jax_twell.train import trainer
    from jax_twell.train.bench import BenchOptions, run_bench, write_outputs
    from jax_twell.train.bench_report import summary_table

    if args.workdir:
        cfg = trainer.load_run_config(args.workdir, args.overrides)
        if args.preset and args.preset != cfg.preset:
            raise ValueError(f"--preset {args.preset}: the run in {args.workdir} is of preset {cfg.preset}")
    else:
        if args.step is not None:
            raise ValueError("--step needs --workdir (a run's checkpoint)")
        cfg = config_lib.get_config(args.preset or "tiny", args.overrides)
    if args.power_interval <= 0:
        raise ValueError(f"--power-interval must be > 0, got {args.power_interval}")
    options = BenchOptions(
        prefill=args.prefill, decode=args.decode, prompt=args.prompt, new_tokens=args.new_tokens,
        train_steps=args.train_steps, repeats=args.repeats, warmup=args.warmup, min_seconds=args.min_seconds,
        power_interval=args.power_interval, data=args.data, calibrate=not args.no_calibrate,
    )
    if not (options.prefill or options.decode or options.train_steps):
        raise ValueError("nothing to measure: --prefill none, --decode none and --train-steps 0")
    platform = jax.devices()[0].platform
    out = Path(args.out or (Path(args.workdir) / f"bench_{platform}.json" if args.workdir else f"bench/{cfg.preset}_{platform}.json"))
    result = run_bench(cfg, options, workdir=args.workdir, step=args.step, console=console)
    json_path, png_path = write_outputs(result, out, args.png or out.with_suffix(".png"))
    console.print(summary_table(result))
    for reason in sorted({m["reason"] for m in result["metrics"].values() if m["reason"]}):
        console.print(f"[yellow]null:[/] {escape(reason)}", highlight=False, soft_wrap=True)
    if result["weights"].get("note"):
        console.print(f"[yellow]note:[/] {escape(result['weights']['note'])}", highlight=False, soft_wrap=True)
    console.print(f"wrote {json_path} and {png_path}", soft_wrap=True)
    return 0


def _grow(args, console) -> int:
    from rich.table import Table

    from jax_twell.train.grow import GROW_FILE, grow_run

    result = grow_run(
        args.source, args.preset, args.workdir, args.overrides, step=args.step, full_copies=args.full_copies,
        report=lambda m: console.print(escape(m), highlight=False, soft_wrap=True),
    )
    table = Table(title=f"FFN statistics on {result['tokens']:,} held-out tokens: grown layer <- trained layer ({result['layout']})")
    for name in ("layer", "from", "active %", "(trained)", "nnz p50", "(trained)", "nnz p99", "(trained)", "nnz max", "(trained)"):
        table.add_column(name, justify="right")
    for i, (src, row) in enumerate(zip(result["layer_sources"], result["layers"])):
        ref = result["source_layers"][src]
        table.add_row(
            str(i), str(src),
            f"{100 * row['active_fraction']:.3f}", f"{100 * ref['active_fraction']:.3f}",
            f"{row['nnz_p50']:g}", f"{ref['nnz_p50']:g}", f"{row['nnz_p99']:g}", f"{ref['nnz_p99']:g}",
            str(row["nnz_max"]), str(ref["nnz_max"]),
        )
    console.print(table)
    console.print(f"wrote {args.workdir} (checkpoint at step {result['source_step']}, the source's) and "
                  f"{Path(args.workdir) / GROW_FILE}", soft_wrap=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jax-twell` console script."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    # key=value overrides may follow options too (`train steps=10 --resume optim.lr=1e-3`).
    if rest and hasattr(args, "overrides") and all("=" in r and not r.startswith("-") for r in rest):
        args.overrides = [*args.overrides, *rest]
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    # orbax reports routine events (read-only managers, async saves) as absl warnings.
    logging.getLogger("absl").setLevel(logging.ERROR)
    from rich.console import Console

    from jax_twell.train.sharding import is_lead, maybe_initialize_distributed

    several = args.command in ("train", "eval", "generate", "sweep") and maybe_initialize_distributed()
    console = Console(quiet=several and not is_lead())  # several processes: process 0 reports (errors: all)
    handler = {"train": _train, "eval": _eval, "generate": _generate, "plot": _plot, "sweep": _sweep, "bench": _bench, "grow": _grow}
    handler = handler[args.command]
    from jax_twell.train.checkpoint import RestoreError
    from jax_twell.train.lock import RunLockedError
    from jax_twell.train.trainer import DivergedError, Interrupted

    try:
        return handler(args, console)
    except Interrupted as e:  # a sweep's run (train handles its own)
        console.print(f"{escape(str(e))}; run the same command again to continue", soft_wrap=True)
        return 128 + e.signal
    except DivergedError as e:
        console.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True, highlight=False)
        return EXIT_DIVERGED
    except (KeyError, ValueError, OSError, RestoreError, RunLockedError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        console.quiet = False  # every process reports its own error
        console.print(f"[red]error:[/] {escape(str(message))}", highlight=False, soft_wrap=True)
        return EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main())
