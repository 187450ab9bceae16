"""Fault injection: the training loop never loses a good checkpoint, and says why it stops.

kill -9 at random moments (and in the middle of a save), SIGTERM, two runs on one
directory, a corrupted newest checkpoint, a diverging run, a refused --resume override and
every out-of-range config value. Each case asserts the exit code and what the run kept.
Real processes run where the case needs one (signals, a concurrent run); they share a
persistent compilation cache so that each starts in seconds. Deselect with -m "not faults".
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_train_resume import corpus  # noqa: F401  (the shared text corpus fixture)

from jax_twell.cli import main
from jax_twell.train import config as config_lib
from jax_twell.train.checkpoint import Checkpointer
from jax_twell.train.lock import LOCK_FILE

pytestmark = pytest.mark.faults

MODEL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.head_dim=16", "model.d_ff=64",
         "model.max_seq_len=48"]
BASE = [*MODEL, "batch_size=8", "seq_len=32", "eval_batches=1", "data.eval_percent=20", "eval_every=100000",
        "log_every=1"]
TRAINED_STEPS = 6  # the shared run: checkpoints 3 and 6


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    """Environment of the child processes: one CPU device, a shared compilation cache, and
    a console wide enough that no message the tests look for is wrapped (long temporary
    paths would break a line in the middle of one)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(
        COLUMNS="1000",
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
    )
    return env


def train_args(workdir: Path, corpus: Path, *extra: str, sample: int = 0) -> list[str]:
    return ["train", "--sample-tokens", str(sample), *BASE, f"data.source={corpus}", f"workdir={workdir}", *extra]


def spawn(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jax_twell.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def run(args: list[str], env: dict) -> tuple[int, str]:
    proc = spawn(args, env)
    out, _ = proc.communicate(timeout=240)
    return proc.returncode, out


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus, env) -> Path:
    workdir = tmp_path_factory.mktemp("trained") / "run"
    code, out = run(train_args(workdir, corpus, f"steps={TRAINED_STEPS}", "checkpoint_every=3"), env)
    assert code == 0, out
    return workdir


def copy_run(trained: Path, tmp_path: Path) -> Path:
    workdir = tmp_path / "run"
    shutil.copytree(trained, workdir)
    return workdir


def saved_steps(workdir: Path) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def verify_checkpoints(workdir: Path) -> list[int]:
    """Restores every checkpoint the run lists (each must load, hold its step, be finite)."""
    from jax_twell.train import sharding, trainer
    from jax_twell.train.optimizer import make_optimizer
    from jax_twell.train.state import setup_model

    cfg = trainer.load_run_config(workdir)
    mesh = sharding.make_mesh(cfg.mesh)
    reader = Checkpointer(workdir, 0, read_only=True)
    try:
        with sharding.mesh_context(mesh):
            setup = setup_model(cfg.model, cfg.seed, make_optimizer(cfg.optim, cfg.steps), mesh)
            for step in reader.all_steps():
                assert int(reader.restore(setup.abstract_state, step).step) == step  # raises unless it verifies
        return reader.all_steps()
    finally:
        reader.close()


def train_records(workdir: Path) -> list[int]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    steps = [r["step"] for r in map(json.loads, filter(None, lines)) if r["kind"] == "train"]
    assert steps == sorted(set(steps)), "each step logged once"
    return steps


# --- every out-of-range value is refused before anything is written --------------------------------

BAD_VALUES = [
    ("steps=0", "steps=0: must be an integer >= 1"),
    ("steps=-5", "steps=-5: must be an integer >= 1"),
    ("l1_coef=-0.5", "l1_coef=-0.5: must be a finite number >= 0"),
    ("l1_warmup_steps=-1", "l1_warmup_steps=-1: must be an integer >= 0"),
    ("optim.warmup_steps=-1", "optim.warmup_steps=-1: must be an integer >= 0"),
    ("optim.lr=nan", "optim.lr=nan: must be a finite number >= 0"),
    ("optim.lr=-1e-3", "optim.lr=-0.001: must be a finite number >= 0"),
    ("optim.b2=1.5", "optim.b2=1.5: must be a finite number >= 0 and < 1"),
    ("optim.eps=0", "optim.eps=0.0: must be a finite number > 0"),
    ("optim.grad_clip=0", "optim.grad_clip=0.0: must be a finite number > 0"),
    ("optim.final_lr_ratio=2", "optim.final_lr_ratio=2.0: must be a finite number >= 0 and <= 1"),
    ("log_every=0", "log_every=0: must be an integer >= 1"),
    ("checkpoint_every=0", "checkpoint_every=0: must be an integer >= 1"),
    ("eval_every=0", "eval_every=0: must be an integer >= 1"),
    ("eval_batches=0", "eval_batches=0: must be an integer >= 1"),
    ("grad_accum=0", "grad_accum=0: must be an integer >= 1"),
    ("batch_size=0", "batch_size=0: must be an integer >= 1"),
    ("seq_len=-1", "seq_len=-1: must be an integer >= 0"),
    ("seq_len=1000", "seq_len=1000: must be <= model.max_seq_len=48"),
    ("grad_accum=3", "batch_size=8: must be a multiple of grad_accum=3"),
    ("keep_checkpoints=-1", "keep_checkpoints=-1: must be an integer >= 0"),
    ("dead_window=0", "dead_window=0: must be an integer >= 1"),
    ("data.eval_percent=0", "data.eval_percent=0.0: must be a finite number > 0 and < 100"),
    ("data.token_dtype=float32", "data.token_dtype='float32': must be one of"),
    ("mesh.data=0", "mesh.data=0: must be an integer >= 1, or -1"),
    ("peak_tflops=-1", "peak_tflops=-1.0: must be a finite number >= 0"),
    ("nonfinite=ignore", "nonfinite='ignore': must be one of 'stop', 'skip'"),
    ("nonfinite_skip_limit=0", "nonfinite_skip_limit=0: must be an integer >= 1"),
    ("seed=-1", "seed=-1: must be an integer >= 0 and <= 4294967295"),
    ("model.d_model=0", "config key 'model.d_model': d_model must be a positive int, got 0"),
    ("model.d_ff=0", "config key 'model.d_ff': d_ff must be a positive int, got 0"),
    ("model.norm_eps=0", "model.norm_eps=0.0: must be a finite number > 0"),
]


@pytest.mark.parametrize("override, message", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_each_bad_config_value_is_refused_naming_field_and_range(tmp_path, corpus, capsys, override, message):
    workdir = tmp_path / "run"
    assert main(train_args(workdir, corpus, override)) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert message in out, out
    assert not workdir.exists(), "a refused run writes nothing"


# --- the shared run: refusals that must leave it intact ----------------------------------------------


def test_resume_with_an_incompatible_override_writes_nothing(trained, tmp_path, corpus, capsys):
    workdir = copy_run(trained, tmp_path)
    before = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
    assert main(train_args(workdir, corpus, "--resume", "model.d_model=64")) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "--resume cannot change model.d_model (saved run: 32, requested: 64)" in out
    assert {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()} == before, "nothing written"
    # The run is still usable: its config reads back, a missing step is named, generate refuses bad input.
    assert config_lib.load(workdir / "config.json").model.d_model == 32
    assert main(["eval", "--workdir", str(workdir), "--step", "999"]) == 2
    assert "no checkpoint of step 999" in capsys.readouterr().out
    assert main(["generate", "--workdir", str(workdir), "--temperature", "nan"]) == 2
    assert "--temperature must be a finite number >= 0" in capsys.readouterr().out
    assert main(["generate", "--workdir", str(workdir), "--prompt", "x" * 60]) == 2
    assert "the prompt is 60 tokens; the model's context is max_seq_len=48" in capsys.readouterr().out
    assert main(train_args(workdir, corpus)) == 2, "an existing run is never overwritten without --resume"
    assert "--resume" in capsys.readouterr().out


def test_corrupted_newest_checkpoint_falls_back_to_the_newest_that_loads(trained, tmp_path, corpus, env):
    workdir = copy_run(trained, tmp_path)
    data_files = [p for p in (workdir / "checkpoints" / "6").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert data_files
    for path in data_files:
        path.write_bytes(b"\x00garbage" * 4)
    # A reader (eval) falls back without touching the run, saying so.
    code, out = run(["eval", "--workdir", str(workdir)], env)
    assert code == 0, out
    assert "checkpoint 6 does not load" in out and "falling back to checkpoint 3" in out and "eval step 3" in out
    assert saved_steps(workdir) == [3, 6]
    # The resumed run sets the broken checkpoint aside, starts from 3 and saves 6 again.
    code, out = run(train_args(workdir, corpus, "--resume", f"steps={TRAINED_STEPS}", "checkpoint_every=3"), env)
    assert code == 0, out
    assert "checkpoint 6 does not load" in out and "resumed at step 3" in out
    assert (workdir / "broken_checkpoints" / "6").is_dir()
    assert verify_checkpoints(workdir) == [3, 6]
    assert train_records(workdir) == list(range(1, TRAINED_STEPS + 1))


def test_divergence_stops_without_checkpointing_and_keeps_the_good_ones(trained, tmp_path, corpus, env):
    workdir = copy_run(trained, tmp_path)
    good = verify_checkpoints(workdir)
    # keep_checkpoints=1 and a checkpoint every step: one bad save would rotate step 6 out.
    code, out = run(train_args(workdir, corpus, "--resume", "steps=12", "optim.lr=1e30", "keep_checkpoints=1",
                               "checkpoint_every=1"), env)
    out = " ".join(out.split())
    assert code == 3, out
    assert "step 7: loss" in out and "not finite" in out and "the newest checkpoint is step 6" in out
    assert saved_steps(workdir) == good == [3, 6], "the good checkpoints are kept, no bad one is added"
    assert verify_checkpoints(workdir) == [3, 6]
    assert train_records(workdir) == list(range(1, TRAINED_STEPS + 1)), "the diverged step is not logged as trained"


# --- real processes: kill -9 at random moments, mid-save, a concurrent run, SIGTERM -------------------


def wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}: {proc.stdout.read()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def logged_since(workdir: Path, since: float) -> bool:
    """Whether the run logged a training step after time `since` (older lines may remain)."""
    try:
        lines = (workdir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return False
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("kind") == "train":
            return record["time"] > since
    return False


def saving(workdir: Path) -> bool:
    try:
        return any("tmp" in p.name for p in (workdir / "checkpoints").iterdir())
    except OSError:
        return False


@pytest.mark.slow  # repeated kill -9 of real training runs (~110 s on two cores)
def test_kill9_at_random_moments_sigterm_and_a_concurrent_run_lose_nothing(tmp_path, corpus, env):
    workdir = tmp_path / "run"
    args = train_args(workdir, corpus, "steps=100000", "checkpoint_every=1", "keep_checkpoints=3", "--resume")
    newest, killed_pid = 0, None
    for seed, moment in ((0, "random"), (1, "mid-save"), (2, "random")):
        rng = random.Random(seed)
        started = time.time()
        proc = spawn(args, env)
        wait_for(lambda: logged_since(workdir, started), proc, "training progress")
        if moment == "mid-save":
            wait_for(lambda: saving(workdir), proc, "a save in progress")
        else:
            time.sleep(rng.uniform(0, 0.5))
        if seed == 1:  # a second run on the live directory refuses, naming the holder, and writes nothing
            log_before = (workdir / "metrics.jsonl").read_text()
            code, out = run(args, env)
            assert code == 2 and f"in use by another training run (pid {proc.pid} on host" in out, out
            assert (workdir / "metrics.jsonl").read_text().startswith(log_before)
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL, out
        if killed_pid is not None:  # the previous incarnation's lock was stale: taken over, from its checkpoint
            assert f"taking over the lock of pid {killed_pid}" in out, out
            assert (f"resumed at step {newest}" if newest else "holds no checkpoint yet") in out, out
        assert f"pid={proc.pid}" in (workdir / LOCK_FILE).read_text(), "a killed holder leaves its lock file"
        steps = verify_checkpoints(workdir)  # everything listed loads and verifies
        # keep_checkpoints=3, plus one where the kill fell between a save and the rotation
        # that follows it (the next run's first save rotates it out).
        assert len(steps) <= 4 and (steps or [0])[-1] >= newest, (seed, moment, steps, newest)
        newest, killed_pid = (steps or [0])[-1], proc.pid
    assert newest > 0, "the runs got far enough to checkpoint"

    # SIGTERM: saves the step it stops at, exits 143, prints no sample, suggests --resume.
    started = time.time()
    proc = spawn(train_args(workdir, corpus, "steps=100000", "checkpoint_every=1", "--resume", sample=5), env)
    wait_for(lambda: logged_since(workdir, started), proc, "training progress")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out
    stopped = int(out.split("checkpoint saved at step ")[1].split()[0])
    assert "jax-twell train --resume" in out and "sample (step" not in out and "generate" not in out
    assert stopped > newest and verify_checkpoints(workdir)[-1] == stopped
    assert (workdir / LOCK_FILE).read_text() == "", "a clean stop releases and empties the lock"
    assert train_records(workdir)[-1] >= stopped
