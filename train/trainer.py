"""The training loop: data -> sharded step -> metrics, evaluation and checkpoints.

`train(cfg)` runs a whole job in `cfg.workdir`:

    config.json       the exact configuration (read back by --resume, eval, generate)
    tokenizer.json    the BPE tokenizer, when data.tokenizer=bpe
    metrics.jsonl     one "train" record every log_every steps, one "eval" record per evaluation
    checkpoints/      orbax checkpoints every checkpoint_every steps, at the end, and on SIGTERM
    train.lock        held while a run is live: a second run on the directory refuses
    broken_checkpoints/  checkpoints that failed to restore, set aside by a resume

Resuming (`resume=True`) restores the newest checkpoint that loads (falling back past
damaged ones, saying so); since the batch of step k is a pure function of (seed, k) and
the only randomness (gate re-initialisation) is keyed the same way, the resumed run
follows the uninterrupted one step for step. Nothing is written before the run is known
to be able to go on: the config is validated (and, on resume, checked against the saved
one) and the state restored before config.json is (re)written.

A step whose loss, gradient norm or update is not finite never reaches a checkpoint: the
step itself keeps the state it started from, and the loop stops with `DivergedError`
(cfg.nonfinite="stop") or goes on without that step's update (cfg.nonfinite="skip", up to
cfg.nonfinite_skip_limit such steps in a row).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import shutil
import signal
import threading
import time
from pathlib import Path

import jax
import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from jax_twell.train import config as config_lib
from jax_twell.train import data, ffn_paths, metrics, sharding
from jax_twell.train.checkpoint import BROKEN_DIR, CHECKPOINT_DIR, Checkpointer
from jax_twell.train.config import seq_len_of
from jax_twell.train.evaluate import evaluate
from jax_twell.train.lock import WorkdirLock
from jax_twell.train.optimizer import learning_rate_schedule, make_optimizer
from jax_twell.train.state import setup_model
from jax_twell.train.step import make_eval_step, make_train_step
from jax_twell.train.tokenizer import BPE_FILE

CONFIG_FILE = "config.json"


CPU_FLOPS_PER_STEP_HINT = 1e12  # above this, a run started on CPU is told it is meant for a GPU
MAX_STEPS_IN_FLIGHT = 2  # dispatched, unfinished steps: the progress bar counts finished ones


class RunExistsError(RuntimeError):
    """The work directory already holds checkpoints of another run."""


class DivergedError(RuntimeError):
    """The run stopped on non-finite steps (cfg.nonfinite); no such state was checkpointed."""


class Interrupted(RuntimeError):
    """The run stopped on SIGTERM or SIGINT after checkpointing step `step`; resume it with
    `resume=True` (`jax-twell train --resume`)."""

    def __init__(self, signum: int, step: int, workdir: str):
        self.signal, self.step = signum, step
        name = signal.Signals(signum).name
        super().__init__(f"stopped on {name}: checkpoint saved at step {step} in {workdir}")


class _StopRequest:
    """Turns SIGTERM / SIGINT into a request to checkpoint and stop after the current step."""

    def __init__(self):
        self.signal: int | None = None
        self._previous = {}

    def __enter__(self):
        # Signal handlers can only be installed from the main thread.
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.signal = signum
        # A second Ctrl-C falls through to the default behaviour.
        signal.signal(signal.SIGINT, self._previous[signal.SIGINT])

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _validate(cfg: config_lib.TrainConfig, mesh) -> None:
    config_lib.validate(cfg)
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if (cfg.batch_size // cfg.grad_accum) % shards:
        raise config_lib.ConfigError(
            f"batch_size={cfg.batch_size}: the micro-batch batch_size / grad_accum = {cfg.batch_size // cfg.grad_accum} "
            f"must be a multiple of the {shards} data-parallel shards (mesh.data x mesh.fsdp)"
        )


def train(
    cfg: config_lib.TrainConfig, *, resume: bool = False, fresh: bool = False, console: Console | None = None
) -> dict:
    """Runs (or resumes) the training job `cfg`; returns the last train and eval records.

    fresh: delete the previous run in `cfg.workdir` first (`clear_run`), under the lock.
    Raises (before writing anything): `config.ConfigError` for out-of-range values or,
    on resume, overrides the saved run cannot take; `lock.RunLockedError` when another
    live process trains in `cfg.workdir`; `RunExistsError` when it holds checkpoints and
    `resume` is False; `checkpoint.RestoreError` when no checkpoint restores. During the
    run: `DivergedError` on non-finite steps, `Interrupted` after a SIGTERM / SIGINT stop
    (its checkpoint saved).
    """
    console = console or Console()
    lead = jax.process_index() == 0
    sharding.assert_same_across_processes({"config": config_lib.to_dict(cfg), "resume": resume}, "config or --resume")
    workdir = Path(cfg.workdir)
    mesh = sharding.make_mesh(cfg.mesh)
    _validate(cfg, mesh)
    # One process writes the run's files; the lock keeps a second run out of the directory.
    with WorkdirLock(workdir) if lead else contextlib.nullcontext() as lock:
        if lock is not None and lock.taken_over:
            console.print(escape(f"taking over the lock of {lock.taken_over}, which is no longer running"))
        if fresh and lead:
            clear_run(workdir)
        if resume and (workdir / CONFIG_FILE).exists():
            config_lib.check_resume(config_lib.load(workdir / CONFIG_FILE), cfg)
        checkpointer = Checkpointer(workdir, cfg.keep_checkpoints)
        try:
            saved = checkpointer.all_steps()
            if saved and not resume:
                raise RunExistsError(
                    f"{workdir} already holds checkpoints (step {saved[-1]}); resume with --resume, "
                    "or choose another workdir=..."
                )
            if resume and not saved and lead:
                console.print(f"{workdir} holds no checkpoint yet: starting from step 0")
            timer = time.perf_counter()
            corpus = data.load_corpus(cfg.data, workdir, cfg.model.vocab_size, save_tokenizer=lead)
            _report_phase(console if lead else None, "data loaded (tokenizer included)", timer)
            return _loop(cfg, console, lead, mesh, checkpointer, bool(saved), corpus)
        finally:
            timer = time.perf_counter()
            checkpointer.wait()
            checkpointer.close()
            _report_phase(console if lead else None, "last checkpoint written", timer)


# Phases that take at least this long are reported with their time (data, model set-up,
# checkpoint writes): on large runs they are minutes that tokens/s does not show.
PHASE_REPORT_SECONDS = 2.0


def _report_phase(console, what: str, since: float) -> None:
    """Prints ``what`` with the seconds since ``since`` when they reach
    ``PHASE_REPORT_SECONDS`` (``console`` None: not the lead process, nothing printed)."""
    seconds = time.perf_counter() - since
    if console is not None and seconds >= PHASE_REPORT_SECONDS:
        console.print(f"{what}: {seconds:.1f} s")


def hardware_hint(cfg: config_lib.TrainConfig, flops_per_step: float, platform: str) -> str | None:
    """A note for runs started on hardware they are not meant for (a GPU-sized run on a CPU), else None."""
    if platform != "cpu" or flops_per_step <= CPU_FLOPS_PER_STEP_HINT:
        return None
    return (
        f"a step of this run is {flops_per_step:.1e} FLOP: tens of seconds or more on a CPU, so "
        f"{cfg.steps:,} steps take hours. It is meant for a GPU (preset {cfg.preset}: "
        f"{config_lib.PRESET_HARDWARE.get(cfg.preset, 'GPU')}); the tiny preset trains on a CPU in minutes."
    )


class _FinishedSteps:
    """Steps dispatched but not yet known finished, with their metrics (device arrays).

    `collect` takes finished steps off the queue in order (waiting for the oldest while
    more than `limit` are in flight), checks each step's finiteness flag against the
    non-finite policy and advances the progress bar; so the bar counts finished steps and
    a non-finite step is noticed within `MAX_STEPS_IN_FLIGHT` steps.
    """

    def __init__(self, cfg, progress, task, print_line):
        self._cfg, self._progress, self._task, self._print = cfg, progress, task, print_line
        self._queue = collections.deque()
        self.skipped_in_a_row = 0
        self.skipped = 0
        self.last_good_checkpoint: int | None = None

    def add(self, step: int, step_metrics: dict) -> None:
        self._queue.append((step, step_metrics))

    def collect(self, limit: int = MAX_STEPS_IN_FLIGHT) -> None:
        while self._queue and (len(self._queue) > limit or self._queue[0][1]["finite"].is_ready()):
            step, step_metrics = self._queue.popleft()
            if not bool(step_metrics["finite"]):
                self._nonfinite(step, step_metrics)
            else:
                self.skipped_in_a_row = 0
            self._progress.update(self._task, completed=step)

    def _nonfinite(self, step: int, step_metrics: dict) -> None:
        values = {k: float(step_metrics[k]) for k in ("loss", "grad_norm", "update_norm", "lr")}
        what = (
            f"step {step}: loss {values['loss']:.4g}, gradient norm {values['grad_norm']:.4g}, "
            f"update norm {values['update_norm']:.4g} (lr {values['lr']:.3g})"
        )
        self.skipped += 1
        self.skipped_in_a_row += 1
        if self._cfg.nonfinite == "skip" and self.skipped_in_a_row < self._cfg.nonfinite_skip_limit:
            self._print(f"[yellow]{escape(what)}: not finite, update skipped (nonfinite=skip)[/]")
            return
        kept = (
            f"the newest checkpoint is step {self.last_good_checkpoint}"
            if self.last_good_checkpoint is not None
            else "no checkpoint was saved"
        )
        cause = (
            f"{self.skipped_in_a_row} non-finite steps in a row (nonfinite_skip_limit={self._cfg.nonfinite_skip_limit})"
            if self._cfg.nonfinite == "skip"
            else "not finite"
        )
        raise DivergedError(
            f"{what}: {cause}; the run diverged and stops without checkpointing it ({kept}, untouched). "
            "Lower optim.lr or optim.grad_clip, or lengthen optim.warmup_steps, then continue with --resume "
            "and those overrides; nonfinite=skip drops isolated non-finite steps instead."
        )


def _loop(cfg, console, lead, mesh, checkpointer, has_checkpoints, corpus) -> dict:
    """The loop proper of `train`, once the run is validated and its data loaded."""
    workdir, seq_len = Path(cfg.workdir), seq_len_of(cfg)
    tx = make_optimizer(cfg.optim, cfg.steps)
    schedule = learning_rate_schedule(cfg.optim, cfg.steps)
    rows = sharding.process_rows(cfg.batch_size, mesh, cfg.grad_accum)
    micro = cfg.batch_size // cfg.grad_accum
    batch_sharding = sharding.batch_sharding(mesh, 3)
    with sharding.mesh_context(mesh):
        timer = time.perf_counter()
        setup = setup_model(cfg.model, cfg.seed, tx, mesh)
        restored_step = None
        if has_checkpoints:
            restored_step, state, failed = checkpointer.restore_newest(
                setup.abstract_state, report=lambda m: console.print(f"[yellow]{escape(m)}[/]") if lead else None
            )
            if failed and lead:
                aside = checkpointer.set_aside(failed)
                console.print(escape(f"set aside checkpoint(s) {', '.join(map(str, failed))} in {aside}"))
        else:
            state = setup.init()
        jax.block_until_ready(state)
        _report_phase(console if lead else None, "model set up" + (" (checkpoint restored)" if has_checkpoints else ""),
                      timer)
        if lead:  # the run can go on: only now is its configuration (re)written
            workdir.mkdir(parents=True, exist_ok=True)
            config_lib.save(cfg, workdir / CONFIG_FILE)
        eval_step = make_eval_step(setup)
        steps_by_paths = {}  # one jitted step per choice of sparse layers (ffn_paths)

        def train_step_for(paths: tuple[bool, ...]):
            if paths not in steps_by_paths:
                traced = ffn_paths.with_paths(setup, paths) if ffn_paths.enabled(cfg.model) else setup
                steps_by_paths[paths] = make_train_step(cfg, traced, tx, schedule)
            return steps_by_paths[paths]

        paths = tuple(bool(v) for v in jax.device_get(state.ffn_sparse))
        train_step = train_step_for(paths)
        if ffn_paths.enabled(cfg.model):  # the layers' sides, decided at log steps
            path_rule = ffn_paths.path_rule(cfg.model, mesh, micro, seq_len)
            union_probe = ffn_paths.make_union_probe(setup)
        log = metrics.MetricsLog(workdir, resume_step=restored_step) if lead else None
        flops_token = metrics.flops_per_token(setup.num_params, setup.num_layers, cfg.model.d_model, seq_len)
        peak = metrics.peak_flops_per_device(jax.devices()[0], cfg.peak_tflops)
        start = int(state.step)
        if lead:
            console.print(
                f"[bold]jax-twell train[/] preset={cfg.preset} params={setup.num_params:,} "
                f"devices={jax.device_count()} mesh={dict(mesh.shape)} data: {corpus.description}"
                + (f" | resumed at step {start}" if restored_step is not None else ""),
                soft_wrap=True,
            )
            hint = hardware_hint(cfg, flops_token * cfg.batch_size * seq_len, jax.devices()[0].platform)
            if hint:
                console.print(f"[yellow]note:[/] {escape(hint)}", soft_wrap=True)

        last = {"train": None, "eval": None}
        progress = Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            console=console,
            disable=not lead,
        )
        with _StopRequest() as stop, progress:
            task = progress.add_task("training", total=cfg.steps, completed=start, status="compiling...")
            finished = _FinishedSteps(cfg, progress, task, progress.console.print if lead else lambda _: None)
            finished.last_good_checkpoint = restored_step
            timer_step, timer = start, time.perf_counter()
            for step in range(start, cfg.steps):
                batch = data.batch_at(
                    corpus.train, step, seed=cfg.seed, batch_size=cfg.batch_size, seq_len=seq_len, rows=rows
                )
                batch = batch.reshape(cfg.grad_accum, -1, seq_len + 1)
                tokens = sharding.put_batch(batch, batch_sharding)
                state, step_metrics = train_step(state, tokens)
                done = step + 1
                finished.add(done, step_metrics)
                if step == start:
                    # Throughput excludes the first step, which includes compilation.
                    jax.block_until_ready(step_metrics)
                    if lead:
                        progress.console.print(f"first step (with compilation): {time.perf_counter() - timer:.1f} s")
                    # Compilation done: the remaining-time estimate starts from here, on finished steps.
                    progress.reset(task, total=cfg.steps, completed=done, status="")
                    timer_step, timer = done, time.perf_counter()
                finished.collect()
                if done % cfg.log_every == 0 or done == cfg.steps:
                    values = jax.device_get(step_metrics)
                    finished.collect(0)
                    now = time.perf_counter()
                    steps_timed = done - timer_step
                    tokens_per_s = steps_timed * cfg.batch_size * seq_len / (now - timer) if steps_timed else 0.0
                    if ffn_paths.enabled(cfg.model):  # layers move between sides at log steps
                        state, new_paths, unions = ffn_paths.update_sides(
                            state, setup, path_rule, union_probe, tokens[0], values["nnz_mean"]
                        )
                        values = dict(values, ffn_sparse=np.asarray(new_paths))
                        if unions is not None:  # measured at this log step (where it could move a layer)
                            values["union_fraction"] = unions
                        if new_paths != paths:
                            paths, train_step = new_paths, train_step_for(new_paths)
                            if lead:
                                progress.console.print(f"step {done}: {ffn_paths.describe(paths)} (re-jit)")
                        now = time.perf_counter()  # the union probe stays out of tokens/s
                    timer_step, timer = done, now
                    record = _train_record(done, values, tokens_per_s, setup.d_ff)
                    record["mfu"] = metrics.mfu(tokens_per_s, flops_token, peak, jax.device_count())
                    record["skipped_steps"] = finished.skipped
                    last["train"] = record
                    if lead:
                        log.write(record)
                        progress.console.print(metrics.format_train_record(record), soft_wrap=True)
                        progress.update(task, status=f"loss {record['loss']:.3f} nnz {record['nnz_mean_avg']:.1f}")
                if done % cfg.eval_every == 0 or done == cfg.steps:
                    result = evaluate(
                        eval_step, state.params, corpus, num_batches=cfg.eval_batches,
                        batch_size=micro, seq_len=seq_len, mesh=mesh,
                    )
                    last["eval"] = {"kind": "eval", "step": done, **result}
                    if lead:
                        log.write(last["eval"])
                        progress.console.print(metrics.format_eval_record(last["eval"]), soft_wrap=True)
                    timer_step, timer = done, time.perf_counter()  # keep evaluation out of tokens/s
                stop_signal = sharding.job_stop_signal(stop.signal)  # the processes stop together
                final = done == cfg.steps or stop_signal is not None
                if done % cfg.checkpoint_every == 0 or final:
                    finished.collect(0)  # every step up to `done` checked before its state is saved
                    # Amid skipped steps (nonfinite=skip) the periodic save waits for a good step,
                    # so a streak that ends the run never rotates out the checkpoints before it.
                    if final or not finished.skipped_in_a_row:
                        saving = time.perf_counter()
                        checkpointer.save(done, state)  # the copy to the host; the write goes on behind
                        finished.last_good_checkpoint = done
                        _report_phase(progress.console if lead else None, f"checkpoint {done} copied to the host",
                                      saving)
                        if not final:
                            timer_step, timer = done, time.perf_counter()  # keep the copy out of tokens/s
                if stop_signal is not None:
                    raise Interrupted(stop_signal, done, str(workdir))
    return last

def _train_record(step: int, values: dict, tokens_per_s: float, d_ff: int) -> dict:
    nnz_mean = np.asarray(values["nnz_mean"], np.float64)
    record = {"kind": "train", "step": step, "time": time.time(), "tokens_per_s": tokens_per_s}
    for key, value in values.items():
        value = np.asarray(value)
        record[key] = value.item() if value.ndim == 0 else value.tolist()
    record["nnz_mean_avg"] = float(nnz_mean.mean())
    record["active_fraction"] = float(nnz_mean.mean() / d_ff)
    record["dead_fraction_avg"] = float(np.mean(values["dead_fraction"]))
    return record


def clear_run(workdir: str | Path) -> None:
    """Deletes what `train` writes in `workdir` (and nothing else)."""
    workdir = Path(workdir)
    for name in (CONFIG_FILE, metrics.METRICS_FILE, BPE_FILE):
        (workdir / name).unlink(missing_ok=True)
    for name in (CHECKPOINT_DIR, BROKEN_DIR, metrics.PLOTS_DIR):
        shutil.rmtree(workdir / name, ignore_errors=True)


def restore_run(cfg: config_lib.TrainConfig, step: int | None = None, *, shard_tokens: bool = True, report=None):
    """(ModelSetup, TrainState) of checkpoint `step` (default: the newest that loads) of the run `cfg`.

    shard_tokens: as in `setup_model` (False for generation). report: called with a
    message for each newer checkpoint that fails to load. Use the returned state inside
    `sharding.mesh_context(setup.mesh)`. Raises `checkpoint.RestoreError`.
    """
    mesh = sharding.make_mesh(cfg.mesh)
    with sharding.mesh_context(mesh):
        tx = make_optimizer(cfg.optim, cfg.steps)
        setup = setup_model(cfg.model, cfg.seed, tx, mesh, shard_tokens=shard_tokens)
        checkpointer = Checkpointer(cfg.workdir, cfg.keep_checkpoints, read_only=True)
        try:
            if step is None:
                state = checkpointer.restore_newest(setup.abstract_state, report)[1]
            else:
                state = checkpointer.restore(setup.abstract_state, step)
        finally:
            checkpointer.close()
    return setup, state


def load_run_config(workdir: str | Path, overrides: list[str] = ()) -> config_lib.TrainConfig:
    """The config saved in `workdir` with `overrides` applied (workdir itself kept)."""
    path = Path(workdir) / CONFIG_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is {workdir} a jax-twell training run?")
    cfg = config_lib.apply_overrides(config_lib.load(path), list(overrides))
    return config_lib.validate(dataclasses.replace(cfg, workdir=str(workdir)))
