"""Training metrics: model FLOPs and MFU, the JSONL log, and the console display.

MFU counts dense model FLOPs (what a dense model of the same shape would do, the usual
convention, so a sparse FFN that skips work shows up as higher throughput, not as more
FLOPs): per token 6 * N (forward + backward over all N parameters, the tied embedding
counting once for the output projection) plus 12 * L * T * d for attention scores and
values (non-causal count).

Peak throughput per device is looked up from the device kind (dense bf16 tensor-core
numbers from the vendors' data sheets). CPUs and unknown accelerators have no peak in
the table, so MFU is not reported for them; `TrainConfig.peak_tflops` sets the peak
where the table has none (or overrides it).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax

METRICS_FILE = "metrics.jsonl"
PLOTS_DIR = "plots"

# Dense bf16 peak TFLOP/s per device, matched by substring of `device.device_kind`
# (first match wins, so specific names come before generic ones).
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10G", 125.0),
    ("TPU v4", 275.0),
    ("TPU v5 lite", 197.0),
    ("TPU v5", 459.0),
    ("TPU v6 lite", 918.0),
)


def flops_per_token(num_params: int, num_layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) of the dense model."""
    return 6.0 * num_params + 12.0 * num_layers * d_model * seq_len


def peak_flops_per_device(device: jax.Device, override_tflops: float = 0.0) -> float | None:
    """Peak FLOP/s of one `device`; None for CPUs and unknown accelerators (MFU is then not reported)."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.platform == "cpu":
        return None
    for name, tflops in PEAK_TFLOPS:
        if name in device.device_kind:
            return tflops * 1e12
    return None


def mfu(tokens_per_second: float, flops_token: float, peak_per_device: float | None, num_devices: int) -> float | None:
    """Model FLOPs utilisation in [0, 1] (None when the peak is unknown)."""
    if peak_per_device is None:
        return None
    return tokens_per_second * flops_token / (peak_per_device * num_devices)


def bits_per_byte(ce_nats_per_token: float, tokens: int, num_bytes: int) -> float | None:
    """Bits per byte of text from a per-token cross-entropy; None when `num_bytes` is unknown (0)."""
    if num_bytes <= 0:
        return None
    return ce_nats_per_token * tokens / (num_bytes * math.log(2))


class MetricsLog:
    """Append-only JSONL log (one record per line, each with "kind" and "step").

    On resume from step s, records after s (written by the interrupted run after its last
    checkpoint) are dropped first, so the log reads as one uninterrupted run.
    """

    def __init__(self, workdir: str | Path, resume_step: int | None = None):
        self.path = Path(workdir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            kept = [r for r in read_log(self.path) if r["step"] <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def write(self, record: dict) -> None:
        """Appends ``record`` to the log as one JSON line."""
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")


def read_log(path: str | Path) -> list[dict]:
    """Records of a JSONL metrics log (a truncated last line from a killed run is skipped)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {path.parent} a jax-twell training run?")
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records


def format_train_record(r: dict) -> str:
    """One console line summarising a "train" record."""
    parts = [
        f"step {r['step']:>6}",
        f"loss {r['loss']:.4f} (ce {r['ce']:.4f} + l1 {r['l1_term']:.4f})",
        f"nnz/token {r['nnz_mean_avg']:.1f} ({100 * r['active_fraction']:.2f}%)",
        f"dead {100 * r['dead_fraction_avg']:.1f}%",
        f"{r['tokens_per_s']:,.0f} tok/s",
    ]
    if r.get("mfu") is not None:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    return " | ".join(parts)


def format_eval_record(r: dict) -> str:
    """One console line summarising an "eval" record."""
    bpb = f", {r['bits_per_byte']:.3f} bits/byte" if r.get("bits_per_byte") is not None else ""
    return f"eval step {r['step']}: held-out CE {r['ce']:.4f} nats/token{bpb}"
