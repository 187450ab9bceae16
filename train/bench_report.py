"""What `jax-twell bench` reports: the result's metrics and ratios, the PNG, the console table."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jax_twell.train import config as config_lib
from jax_twell.train import metrics as metrics_lib

BASELINES = ("swiglu", "dense_relu")
RATIO_MEANING = (
    "sparse value / baseline value of each metric: above 1 is better for tokens/s and MFU, below 1 is better "
    "for bytes and joules per token"
)
MEMORY_MEANING = (
    "what the compiled program holds on the device while it runs (XLA's buffer assignment: arguments, "
    "parameters and optimizer state included, + outputs + temporaries - donated buffers); serve: the largest "
    "of the model's prefill and decode programs"
)


def progress(console):
    """The rich progress display of a benchmark (a context manager)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console,
    )


def _metric(unit: str, better: str, values: dict, reason: str | None = None) -> dict:
    missing = [name for name, v in values.items() if v is None]
    if missing and reason is None:
        reason = f"not measured for {', '.join(missing)}"
    return {"unit": unit, "better": better, "values": values, "reason": reason if missing else None}


def metrics_of(cases: dict, names: list[str], *, peak_flops: float | None, device_kind: str, energy_reason: str | None) -> dict:
    """The flat metrics of the timed ``cases``: per case tokens/s and joules per token; for
    training MFU and peak bytes; the serving programs' largest peak bytes. Each metric:
    ``{"unit", "better": "higher" | "lower", "values": {model: value or None}, "reason"}``,
    ``reason`` saying why values are None (None when all are there)."""
    out = {}
    for case_name, case in cases.items():
        rows = case["models"]
        out[f"{case_name}_tokens_per_s"] = _metric("tokens/s", "higher", {n: rows[n]["tokens_per_s"] for n in names})
        out[f"{case_name}_joules_per_token"] = _metric(
            "J/token", "lower", {n: rows[n]["joules_per_token"] for n in names},
            energy_reason or "a timed window fell outside the power readings",
        )
    if "train" in cases:
        rows, flops = cases["train"]["models"], cases["train"]["flops_per_token"]
        out["train_mfu"] = _metric(
            "fraction of peak", "higher",
            {n: metrics_lib.mfu(rows[n]["tokens_per_s"], flops[n], peak_flops, 1) for n in names},
            f"no peak FLOP/s known for device {device_kind!r}; set peak_tflops=<dense bf16 TFLOP/s of one device>",
        )
        out["train_peak_bytes"] = _metric(
            "bytes", "lower", {n: rows[n]["peak_bytes"] for n in names}, "the backend gives no memory analysis"
        )
    serving = [c for c in cases.values() if c["kind"] in ("prefill", "decode")]
    if serving:
        peaks = {}
        for n in names:
            values = [c["models"][n]["peak_bytes"] for c in serving]
            peaks[n] = None if None in values else max(values)
        out["serve_peak_bytes"] = _metric("bytes", "lower", peaks, "the backend gives no memory analysis")
    return out


def ratios_of(metrics: dict, model: str = "sparse", baselines=BASELINES) -> dict:
    """``{"sparse/<baseline>": {metric: model's value / baseline's, or None}}``: None where
    either value is None or the baseline's is 0."""
    out = {}
    for base in baselines:
        row = {}
        for name, metric in metrics.items():
            a, b = metric["values"].get(model), metric["values"].get(base)
            row[name] = None if a is None or b is None or b == 0 else a / b
        out[f"{model}/{base}"] = row
    return out


def summarize(*, metadata, cfg, weights, data, options, shapes, notes, models, cases, peak_flops, device_memory, energy) -> dict:
    """The benchmark's result as one JSON-ready dictionary: metadata, what was measured and
    how, the raw cases, the flat metrics and the sparse/baseline ratios."""
    names = list(models)
    metrics = metrics_of(
        cases, names, peak_flops=peak_flops, device_kind=metadata["device"], energy_reason=energy["reason"]
    )
    return {
        "benchmark": "jax-twell bench",
        "metadata": metadata,
        "preset": cfg.preset,
        "model_config": config_lib.to_dict(cfg.model),
        "weights": weights,
        "data": data,
        "settings": {**dataclasses.asdict(options), **shapes, "train_batch": cfg.batch_size,
                     "grad_accum": cfg.grad_accum, "train_seq": config_lib.seq_len_of(cfg)},
        "notes": notes,
        "timing": "compiled ahead (never timed); warm-up calls; then in each round one timed window per model "
                  "(calls repeated to last min_seconds, waited on with block_until_ready); the median over the "
                  "rounds of seconds per call. decode tokens/s: new tokens over the whole generate call, whose "
                  "prompt prefill is included",
        "memory": MEMORY_MEANING,
        "device_memory": {**device_memory, "meaning": "the device allocator's figures for the whole process "
                          "(all three models and cases together): not attributable to one model"},
        "energy": {**energy, "meaning": "NVML power integrated over the timed windows, over the tokens in them"},
        "peak_flops_per_device": peak_flops,
        "models": models,
        "cases": cases,
        "metrics": metrics,
        "ratios": ratios_of(metrics),
        "ratio_meaning": RATIO_MEANING,
    }


def plot_ratios(result: dict, path: str | Path) -> Path:
    """A horizontal bar chart of the sparse/baseline ratio of every metric that has one,
    written to ``path`` (PNG); metrics without a ratio are listed under the chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios, metrics = result["ratios"], result["metrics"]
    shown = [m for m in metrics if any(ratios[k][m] is not None for k in ratios)]
    missing = [m for m in metrics if m not in shown]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.45 * max(len(shown), 1) * len(ratios) / 2 + 0.25 * bool(missing)))
    height = 0.8 / len(ratios)
    for i, (key, row) in enumerate(ratios.items()):
        ys = [j + (i - (len(ratios) - 1) / 2) * height for j in range(len(shown))]
        values = [row[m] if row[m] is not None else 0.0 for m in shown]
        bars = ax.barh(ys, values, height=height, label=key)
        for bar, value in zip(bars, (row[m] for m in shown)):
            ax.annotate("n/a" if value is None else f"{value:.2f}", (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                        xytext=(3, 0), textcoords="offset points", va="center", fontsize=7)
    ax.axvline(1.0, color="black", linewidth=0.8)
    largest = max([v for row in ratios.values() for v in row.values() if v is not None], default=1.0)
    ax.set_xlim(0, 1.15 * max(largest, 1.0))
    ax.set_yticks(range(len(shown)))
    ax.set_yticklabels([f"{m} ({metrics[m]['better']} is better)" for m in shown], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("sparse / baseline")
    meta = result["metadata"]
    ax.set_title(f"jax-twell bench: preset {result['preset']} on {meta['device']}, {result['weights']['source']} weights "
                 f"({meta['commit'][:12]})", fontsize=9, pad=22)
    if shown:
        ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(ratios), frameon=False)
    if missing:
        fig.text(0.01, 0.01, "no ratio: " + ", ".join(missing), fontsize=6, wrap=True)
    fig.tight_layout(rect=(0, 0.04 if missing else 0, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _format(value, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "bytes":
        return f"{value / 2**20:,.1f} MiB"
    if unit == "fraction of peak":
        return f"{100 * value:.1f}%"
    if unit == "J/token":
        return f"{value:.3g}"
    return f"{value:,.0f}"


def summary_table(result: dict):
    """A rich Table of every metric: the three models' values and the ratios."""
    from rich.table import Table

    table = Table(title=f"jax-twell bench, preset {result['preset']}, {result['weights']['source']} weights")
    names = list(result["models"])
    table.add_column("metric", overflow="fold")
    for name in names:
        table.add_column(name, justify="right", no_wrap=True)
    for key in result["ratios"]:
        table.add_column(key.replace("sparse/", "sparse/\n"), justify="right", no_wrap=True)
    for metric, entry in result["metrics"].items():
        ratios = [result["ratios"][k][metric] for k in result["ratios"]]
        table.add_row(
            metric, *(_format(entry["values"][n], entry["unit"]) for n in names),
            *("-" if r is None else f"{r:.3f}" for r in ratios),
        )
    return table
