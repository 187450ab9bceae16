"""The workdir lock, the non-finite policy of the loop, and the CPU hint (no training)."""

import dataclasses
import os
import socket

import pytest

from jax_twell.train import config, trainer
from jax_twell.train.lock import LOCK_FILE, RunLockedError, WorkdirLock


def test_lock_refuses_a_second_holder_naming_it_and_releases_cleanly(tmp_path):
    with WorkdirLock(tmp_path) as held:
        assert held.taken_over is None
        text = (tmp_path / LOCK_FILE).read_text()
        assert f"pid={os.getpid()}" in text and f"host={socket.gethostname()}" in text
        with pytest.raises(RunLockedError, match=f"in use by another training run \\(pid {os.getpid()} on host"):
            WorkdirLock(tmp_path).acquire()
    assert (tmp_path / LOCK_FILE).read_text() == ""
    with WorkdirLock(tmp_path) as again:  # free once released; a clean exit is not reported as stale
        assert again.taken_over is None


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    (tmp_path / LOCK_FILE).write_text("pid=999999\nhost=elsewhere\n")  # written, never locked: its holder died
    with WorkdirLock(tmp_path) as lock:
        assert lock.taken_over == "pid 999999 on host elsewhere"
        assert f"pid={os.getpid()}" in (tmp_path / LOCK_FILE).read_text()


class _Flag:
    def __init__(self, value):
        self.value = value

    def is_ready(self):
        return True

    def __bool__(self):
        return self.value

    def __float__(self):
        return 1.0 if self.value else float("nan")


class _Progress:
    def __init__(self):
        self.completed = None

    def update(self, task, completed):
        self.completed = completed


def _metrics(finite):
    flag = _Flag(finite)
    return {"finite": flag, "loss": flag, "grad_norm": flag, "update_norm": flag, "lr": _Flag(True)}


def _steps(policy, limit=3):
    cfg = dataclasses.replace(config.PRESETS["tiny"], nonfinite=policy, nonfinite_skip_limit=limit)
    lines = []
    finished = trainer._FinishedSteps(cfg, _Progress(), 0, lines.append)
    finished.last_good_checkpoint = 4
    return finished, lines


def test_stop_policy_raises_at_the_first_non_finite_step():
    finished, _ = _steps("stop")
    finished.add(5, _metrics(True))
    finished.add(6, _metrics(False))
    with pytest.raises(trainer.DivergedError, match="step 6: loss nan.*not finite.*newest checkpoint is step 4"):
        finished.collect(0)
    assert finished._progress.completed == 5, "the bar counts finished good steps"


def test_skip_policy_skips_isolated_steps_and_stops_after_the_limit_in_a_row():
    finished, lines = _steps("skip", limit=3)
    for step, ok in enumerate([True, False, False, True, False, False], start=1):
        finished.add(step, _metrics(ok))
    finished.collect(0)
    assert finished.skipped == 4 and finished.skipped_in_a_row == 2
    assert sum("update skipped" in line for line in lines) == 4
    finished.add(7, _metrics(False))
    with pytest.raises(trainer.DivergedError, match="3 non-finite steps in a row"):
        finished.collect(0)


def test_collect_waits_only_beyond_the_in_flight_limit():
    finished, _ = _steps("stop")

    class Pending(_Flag):
        def is_ready(self):
            return False

    for step in (1, 2, 3):
        finished.add(step, {**_metrics(True), "finite": Pending(True)})
    finished.collect(limit=2)
    assert finished._progress.completed == 1 and len(finished._queue) == 2


def test_gpu_sized_runs_on_cpu_get_a_hint():
    small, tiny = config.PRESETS["small"], config.PRESETS["tiny"]
    flops = {name: trainer.metrics.flops_per_token(n, cfg.model.n_layers, cfg.model.d_model, cfg.model.max_seq_len)
             * cfg.batch_size * cfg.model.max_seq_len
             for name, cfg, n in (("small", small, 25_000_000), ("tiny", tiny, 850_000))}
    hint = trainer.hardware_hint(small, flops["small"], "cpu")
    assert hint and "meant for a GPU" in hint and "2,000 steps take hours" in hint
    assert trainer.hardware_hint(small, flops["small"], "gpu") is None
    assert trainer.hardware_hint(tiny, flops["tiny"], "cpu") is None
