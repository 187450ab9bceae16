"""L1 sweep: one training run per L1 coefficient, then a table and plots.

    jax-twell sweep --preset small --l1 0,2e-5,1e-4,3e-4,1e-3,3e-3 [key=value ...]
    jax-twell sweep --report --workdir runs/sweep     table of runs trained some other way

Each run lives in `<sweep dir>/l1_<value>` and is resumed if present (an interrupted sweep
continues where it stopped; finished runs are only read). `--report` trains nothing: it
reads every run directory under the sweep dir (for example runs started in parallel with
`jax-twell train ... workdir=runs/sweep/l1_X l1_coef=X`), taking L1 from each run's
config. Written into the sweep dir:

    sweep.json   one row per L1: held-out CE, bits per byte, active %, non-zeros per
                 token (mean over layers, and per layer mean / max), dead %
    sweep.md     the same as a Markdown table, the calibration table of docs/design.md,
                 section 6 (Model and training recipe)
    sweep.png    held-out CE and active fraction against L1; non-zeros per layer
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from rich.console import Console

from jax_twell.train import trainer
from jax_twell.train.config import TrainConfig
from jax_twell.train.metrics import METRICS_FILE, read_log
from jax_twell.train.plot import plt, save_figure


def run_dir(sweep_dir: Path, l1: float) -> Path:
    """The directory of the sweep's run at L1 coefficient ``l1``."""
    return sweep_dir / f"l1_{l1:g}"


def summarize_run(workdir: str | Path, l1: float) -> dict:
    """The sweep row of one finished run, from its metrics log."""
    records = read_log(Path(workdir) / METRICS_FILE)
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if not train or not evals:
        raise ValueError(f"{workdir}: no training and evaluation records")
    last, final_eval = train[-1], evals[-1]
    return {
        "l1": l1,
        "step": last["step"],
        "eval_step": final_eval["step"],
        "eval_ce": final_eval["ce"],
        "bits_per_byte": final_eval["bits_per_byte"],
        "train_ce": last["ce"],
        "active_pct": 100 * last["active_fraction"],
        "nnz_mean": last["nnz_mean_avg"],
        "nnz_mean_per_layer": last["nnz_mean"],
        "nnz_max_per_layer": last["nnz_max"],
        "dead_pct": 100 * last["dead_fraction_avg"],
    }


def markdown_table(rows: list[dict]) -> str:
    """Rows of `summarize_run` as a Markdown table, one column per L1."""
    bpb = ["-" if r["bits_per_byte"] is None else f"{r['bits_per_byte']:.3f}" for r in rows]
    lines = [
        ("L1", [f"{r['l1']:g}" for r in rows]),
        ("held-out CE (nats/token)", [f"{r['eval_ce']:.3f}" for r in rows]),
        ("bits per byte", bpb),
        ("active", [f"{r['active_pct']:.2f}%" for r in rows]),
        ("non-zeros per token (mean over layers)", [f"{r['nnz_mean']:.1f}" for r in rows]),
        ("max non-zeros per token (worst layer)", [str(max(r["nnz_max_per_layer"])) for r in rows]),
        ("dead neurons", [f"{r['dead_pct']:.1f}%" for r in rows]),
    ]
    out = [f"| {lines[0][0]} | " + " | ".join(lines[0][1]) + " |", "|---" * (len(rows) + 1) + "|"]
    out += [f"| {name} | " + " | ".join(values) + " |" for name, values in lines[1:]]
    return "\n".join(out) + "\n"


def plot_sweep(rows: list[dict], path: Path) -> Path:
    """Held-out CE and active % against L1 (symlog axis, so L1 = 0 shows), nnz per layer."""
    fig, (ce_ax, act_ax, layer_ax) = plt.subplots(1, 3, figsize=(15, 4.5))
    l1s = [r["l1"] for r in rows]
    positive = [x for x in l1s if x > 0]
    linthresh = min(positive) if positive else 1e-5
    ce_ax.plot(l1s, [r["eval_ce"] for r in rows], "o-")
    ce_ax.set(xlabel="L1 coefficient", ylabel="held-out CE (nats/token)", title="quality")
    act_ax.plot(l1s, [r["active_pct"] for r in rows], "o-")
    act_ax.set(xlabel="L1 coefficient", ylabel="active FFN neurons (%)", yscale="log", title="sparsity")
    for ax in (ce_ax, act_ax):
        ax.set_xscale("symlog", linthresh=linthresh)
        ax.set_xlim(left=-0.1 * linthresh)  # no negative decades (log y makes matplotlib pad them)
        ax.grid(alpha=0.3)
    for r in rows:
        layer_ax.plot(range(len(r["nnz_mean_per_layer"])), r["nnz_mean_per_layer"], "o-", label=f"L1 {r['l1']:g}")
    layer_ax.set(xlabel="layer", ylabel="non-zeros per token (mean)", yscale="log", title="per layer")
    layer_ax.grid(alpha=0.3)
    layer_ax.legend(fontsize="small")
    return save_figure(fig, path)


def write_report(rows: list[dict], sweep_dir: Path) -> None:
    """Writes sweep.json, sweep.md and sweep.png for `rows` into `sweep_dir`."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / "sweep.json").write_text(json.dumps(rows, indent=2) + "\n")
    (sweep_dir / "sweep.md").write_text(markdown_table(rows))
    plot_sweep(rows, sweep_dir / "sweep.png")


def run_sweep(base: TrainConfig, l1_values: list[float], sweep_dir: str | Path, console: Console | None = None) -> list[dict]:
    """Trains `base` once per L1 value (resuming existing runs), then writes the report."""
    console = console or Console()
    sweep_dir = Path(sweep_dir)
    rows = []
    for l1 in l1_values:
        cfg = dataclasses.replace(base, l1_coef=l1, workdir=str(run_dir(sweep_dir, l1)))
        console.rule(f"L1 = {l1:g}")
        trainer.train(cfg, resume=True, console=console)
        rows.append(summarize_run(cfg.workdir, l1))
    write_report(rows, sweep_dir)
    return rows


def report_existing(sweep_dir: str | Path) -> list[dict]:
    """Report of every run directory directly under `sweep_dir`, ordered by L1."""
    sweep_dir = Path(sweep_dir)
    runs = sorted(p.parent for p in sweep_dir.glob(f"*/{trainer.CONFIG_FILE}"))
    if not runs:
        raise FileNotFoundError(f"no training runs (*/{trainer.CONFIG_FILE}) under {sweep_dir}")
    rows = sorted((summarize_run(run, trainer.load_run_config(run).l1_coef) for run in runs), key=lambda r: r["l1"])
    write_report(rows, sweep_dir)
    return rows
