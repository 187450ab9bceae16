"""Metrics (FLOPs, MFU, bits per byte), the JSONL log, plots and the sweep table."""

import math
import types

import pytest

from jax_twell.train import metrics
from jax_twell.train.plot import plot_run
from jax_twell.train.sweep import markdown_table, plot_sweep


def test_flops_mfu_and_bits_per_byte():
    assert metrics.flops_per_token(1000, 2, 8, 16) == 6 * 1000 + 12 * 2 * 8 * 16
    assert metrics.mfu(100.0, 1e9, 1e12, 2) == pytest.approx(0.05)
    assert metrics.mfu(100.0, 1e9, None, 2) is None
    assert metrics.bits_per_byte(math.log(2), 10, 10) == pytest.approx(1.0)
    assert metrics.bits_per_byte(math.log(2), 10, 20) == pytest.approx(0.5)
    assert metrics.bits_per_byte(1.0, 10, 0) is None


@pytest.mark.parametrize(
    "kind, tflops", [("NVIDIA H200", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 80GB HBM3", 989.0),
                     ("NVIDIA A100-SXM4-80GB", 312.0), ("TPU v5 lite", 197.0), ("Mystery 9000", None)],
)
def test_peak_flops_table(kind, tflops):
    device = types.SimpleNamespace(platform="gpu", device_kind=kind)
    peak = metrics.peak_flops_per_device(device)
    assert peak == (None if tflops is None else tflops * 1e12)
    assert metrics.peak_flops_per_device(device, override_tflops=123.0) == 123e12


def test_cpu_has_no_peak_so_no_mfu_unless_given():
    cpu = types.SimpleNamespace(platform="cpu", device_kind="cpu")
    assert metrics.peak_flops_per_device(cpu) is None
    assert metrics.mfu(1e6, 1e6, metrics.peak_flops_per_device(cpu), 1) is None
    assert metrics.peak_flops_per_device(cpu, override_tflops=2.0) == 2e12


def _train_record(step, layers=3):
    return {"kind": "train", "step": step, "loss": 3.0 / step, "ce": 2.9 / step, "l1_term": 0.1 / step,
            "nnz_mean": [10.0 / step + i for i in range(layers)], "nnz_max": [50 + i for i in range(layers)],
            "active_fraction": 0.05 / step, "dead_fraction": [0.0, 0.1, 0.2][:layers], "dead_fraction_avg": 0.1,
            "nnz_mean_avg": 10.0 / step + 1, "tokens_per_s": 1000.0, "mfu": 0.1}


def test_log_truncates_to_the_resumed_step_and_skips_a_torn_line(tmp_path):
    log = metrics.MetricsLog(tmp_path)
    for step in (10, 20, 30):
        log.write(_train_record(step))
    with open(log.path, "a") as fh:
        fh.write('{"kind": "train", "st')  # a line cut by kill -9
    assert [r["step"] for r in metrics.read_log(log.path)] == [10, 20, 30]
    metrics.MetricsLog(tmp_path, resume_step=20)
    assert [r["step"] for r in metrics.read_log(log.path)] == [10, 20]
    metrics.MetricsLog(tmp_path)
    assert metrics.read_log(log.path) == []


def test_console_lines():
    line = metrics.format_train_record(_train_record(10))
    assert "step" in line and "nnz/token" in line and "MFU" in line
    assert "bits/byte" in metrics.format_eval_record({"step": 5, "ce": 1.0, "bits_per_byte": 1.4})


def test_plot_run_writes_pngs(tmp_path):
    log = metrics.MetricsLog(tmp_path)
    for step in (1, 2, 3):
        log.write(_train_record(step))
    log.write({"kind": "eval", "step": 3, "ce": 1.0, "bits_per_byte": 1.4, "tokens": 100})
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == ["loss.png", "sparsity.png", "sparsity_per_layer.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    metrics.MetricsLog(tmp_path / "empty")
    with pytest.raises(ValueError, match="no training records"):
        plot_run(tmp_path / "empty")


def test_dead_neuron_plot_is_a_readable_percentage_axis(tmp_path, monkeypatch):
    from jax_twell.train import plot

    figures = {}

    def keep(fig, path):
        figures[path.name] = fig
        return path

    monkeypatch.setattr(plot, "save_figure", keep)
    log = metrics.MetricsLog(tmp_path)
    log.write(dict(_train_record(1), dead_fraction=[0.0, 0.0, 0.0]))
    plot_run(tmp_path)
    dead_axis = figures["sparsity_per_layer.png"].axes[1]
    assert dead_axis.get_ylim() == (0.0, 1.0), "no +-0.04 axis around nothing"
    assert [t.get_text() for t in dead_axis.texts] == ["no dead neurons"]
    log.write(dict(_train_record(2), dead_fraction=[0.0, 0.5, 0.2]))
    plot_run(tmp_path)
    dead_axis = figures["sparsity_per_layer.png"].axes[1]
    assert dead_axis.get_ylim()[0] == 0 and dead_axis.get_ylim()[1] >= 50 and not dead_axis.texts
    with pytest.raises(FileNotFoundError, match="metrics.jsonl not found: is .* a jax-twell training run"):
        plot_run(tmp_path / "nothing")
    plot.plt.close("all")


def test_sweep_table_and_plot(tmp_path):
    rows = [{"l1": l1, "step": 10, "eval_ce": ce, "bits_per_byte": None if l1 else 1.2, "train_ce": ce,
             "active_pct": act, "nnz_mean": act, "nnz_mean_per_layer": [act, act * 2],
             "nnz_max_per_layer": [5, 9], "dead_pct": 1.0}
            for l1, ce, act in ((0.0, 0.85, 8.4), (1e-3, 0.83, 0.44))]
    table = markdown_table(rows)
    assert table.splitlines()[0] == "| L1 | 0 | 0.001 |"
    assert "| held-out CE (nats/token) | 0.850 | 0.830 |" in table and "| bits per byte | 1.200 | - |" in table
    assert plot_sweep(rows, tmp_path / "sweep.png").exists()
