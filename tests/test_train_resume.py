"""Kill -9 and SIGTERM during training, then --resume: the loss curve matches an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

STEPS = 120
# Tiny model, every step logged, frequent checkpoints; dead-neuron re-init and the L1
# warm-up on, so resuming must also restore their state (counters, step-keyed noise).
OVERRIDES = [
    "model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.head_dim=32", "model.d_ff=128",
    "model.max_seq_len=64", "batch_size=8", f"steps={STEPS}", "log_every=1", "eval_every=100000",
    "eval_batches=1", "checkpoint_every=10", "data.eval_percent=20", "dead_reinit=true", "dead_window=5",
    "l1_warmup_steps=50",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "x", "y", "(", ")", ":"]
    for i in range(40):
        (root / f"doc{i}.txt").write_text(" ".join(rng.choice(words, 800)))
    return root


def _cmd(workdir: Path, corpus: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "jax_twell.cli", "train", "--sample-tokens", "0", *extra,
            *OVERRIDES, f"data.source={corpus}", f"workdir={workdir}"]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _losses(workdir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in records if r["kind"] == "train"]
    assert steps == sorted(set(steps)), "each step is logged exactly once"
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def _run_until(cmd: list[str], workdir: Path, min_step: int, sig: int) -> int:
    """Starts `cmd`, sends `sig` once step `min_step` is logged; returns the exit code."""
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = workdir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if log.exists() and any(f'"step": {min_step},' in line for line in log.read_text().splitlines()):
            proc.send_signal(sig)
            break
        time.sleep(0.01)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode is not None
    if sig == signal.SIGTERM:
        assert proc.returncode == 143, out
        assert "stopped on SIGTERM: checkpoint saved at step" in out, out
    return proc.returncode


def test_kill9_and_sigterm_then_resume_match_uninterrupted(tmp_path, corpus):
    reference = tmp_path / "reference"
    subprocess.run(_cmd(reference, corpus), env=_env(), check=True, capture_output=True)
    expected = _losses(reference)
    assert sorted(expected) == list(range(1, STEPS + 1))

    run = tmp_path / "interrupted"
    assert _run_until(_cmd(run, corpus), run, 30, signal.SIGKILL) == -signal.SIGKILL
    killed_at = max(_losses(run))
    assert (run / "checkpoints").exists()

    assert _run_until(_cmd(run, corpus, "--resume"), run, 70, signal.SIGTERM) == 143
    stopped_at = max(_losses(run))
    assert stopped_at < STEPS, "SIGTERM should stop the run early"
    assert (run / "checkpoints" / str(stopped_at)).is_dir(), "SIGTERM saves a checkpoint at the stop step"

    out = subprocess.run(_cmd(run, corpus, "--resume"), env=_env(), check=True, capture_output=True, text=True).stdout
    assert f"resumed at step {stopped_at}" in out
    got = _losses(run)
    assert sorted(got) == list(range(1, STEPS + 1)), (killed_at, stopped_at)
    np.testing.assert_allclose([got[s] for s in sorted(got)], [expected[s] for s in sorted(expected)], rtol=1e-6)
