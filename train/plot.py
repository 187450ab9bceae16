"""PNG plots of a run's metrics log (matplotlib, Agg backend: no display needed).

    loss.png               loss, cross-entropy and L1 term per step; held-out CE
    sparsity.png           non-zeros per token per layer, active and dead fractions per step
    sparsity_per_layer.png last logged mean and max non-zeros per token, dead fraction, per layer
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from jax_twell.train.metrics import METRICS_FILE, PLOTS_DIR, read_log  # noqa: E402


def _records(workdir: Path, kind: str) -> list[dict]:
    return [r for r in read_log(workdir / METRICS_FILE) if r.get("kind") == kind]


def plot_run(workdir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Writes the run's PNGs into `out_dir` (default `workdir/plots`); returns their paths."""
    workdir = Path(workdir)
    out_dir = Path(out_dir) if out_dir is not None else workdir / PLOTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    train, evals = _records(workdir, "train"), _records(workdir, "eval")
    if not train:
        raise ValueError(f"{workdir / METRICS_FILE} has no training records yet")
    steps = [r["step"] for r in train]
    num_layers = len(train[-1]["nnz_mean"])
    paths = []

    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(steps, [r["loss"] for r in train], label="loss")
    ax.plot(steps, [r["ce"] for r in train], label="cross-entropy (train)")
    ax.plot(steps, [r["l1_term"] for r in train], label="L1 term")
    if evals:
        ax.plot([r["step"] for r in evals], [r["ce"] for r in evals], "o-", label="cross-entropy (held-out)")
    ax.set(xlabel="step", ylabel="nats / token", title=f"{workdir.name}: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(save_figure(fig, out_dir / "loss.png"))

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 8), sharex=True)
    for layer in range(num_layers):
        top.plot(steps, [r["nnz_mean"][layer] for r in train], label=f"layer {layer}")
    top.set(ylabel="non-zeros per token (mean)", yscale="log", title=f"{workdir.name}: FFN sparsity")
    top.grid(alpha=0.3)
    top.legend(ncol=2, fontsize="small")
    bottom.plot(steps, [100 * r["active_fraction"] for r in train], label="active neurons (% of f, mean over layers)")
    bottom.plot(steps, [100 * r["dead_fraction_avg"] for r in train], label="dead neurons (%)")
    bottom.set(xlabel="step", ylabel="%")
    bottom.grid(alpha=0.3)
    bottom.legend()
    paths.append(save_figure(fig, out_dir / "sparsity.png"))

    last = train[-1]
    layers = list(range(num_layers))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    width = 0.4
    left.bar([i - width / 2 for i in layers], last["nnz_mean"], width, label="mean")
    left.bar([i + width / 2 for i in layers], last["nnz_max"], width, label="max")
    left.set(xlabel="layer", ylabel="non-zeros per token", yscale="log", title=f"step {last['step']}: per layer")
    left.set_xticks(layers)
    left.legend()
    dead = [100 * x for x in last["dead_fraction"]]
    right.bar(layers, dead)
    right.set(xlabel="layer", ylabel="dead neurons (%)", title="dead neurons per layer")
    right.set_xticks(layers)
    right.set_ylim(0, max(1.0, 1.1 * max(dead)))  # a percentage: never below 0, never a +-0.04 axis
    if not any(dead):
        right.text(0.5, 0.5, "no dead neurons", transform=right.transAxes, ha="center", va="center")
    paths.append(save_figure(fig, out_dir / "sparsity_per_layer.png"))
    return paths


def save_figure(fig, path: Path) -> Path:
    """Saves and closes `fig` as a PNG at `path`."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
