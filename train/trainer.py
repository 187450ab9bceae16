"""The training loop: data -> sharded step -> metrics, evaluation and checkpoints.

`train(cfg)` runs a whole job in `cfg.workdir`:

    config.json       the exact configuration (read back by --resume, eval, generate)
    tokenizer.json    the BPE tokenizer, when data.tokenizer=bpe
    metrics.jsonl     one "train" record every log_every steps, one "eval" record per evaluation
    checkpoints/      orbax checkpoints every checkpoint_every steps, at the end, and on SIGTERM

Resuming (`resume=True`) restores the newest checkpoint; since the batch of step k is a
pure function of (seed, k) and the only randomness (gate re-initialisation) is keyed the
same way, the resumed run follows the uninterrupted one step for step.
"""

from __future__ import annotations

import dataclasses
import shutil
import signal
import threading
import time
from pathlib import Path

import jax
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from jax_twell.train import config as config_lib
from jax_twell.train import data, ffn_paths, metrics, sharding
from jax_twell.train.checkpoint import CHECKPOINT_DIR, Checkpointer
from jax_twell.train.config import seq_len_of
from jax_twell.train.evaluate import evaluate
from jax_twell.train.optimizer import learning_rate_schedule, make_optimizer
from jax_twell.train.state import setup_model
from jax_twell.train.step import make_eval_step, make_train_step
from jax_twell.train.tokenizer import BPE_FILE

CONFIG_FILE = "config.json"


class RunExistsError(RuntimeError):
    """The work directory already holds checkpoints of another run."""


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
    if seq_len_of(cfg) > cfg.model.max_seq_len:
        raise ValueError(f"seq_len={cfg.seq_len} exceeds the model's max_seq_len={cfg.model.max_seq_len}")
    if cfg.batch_size % cfg.grad_accum:
        raise ValueError(f"batch_size={cfg.batch_size} is not divisible by grad_accum={cfg.grad_accum}")
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if (cfg.batch_size // cfg.grad_accum) % shards:
        raise ValueError(
            f"micro-batch {cfg.batch_size // cfg.grad_accum} is not divisible by the {shards} data-parallel shards"
        )


def train(cfg: config_lib.TrainConfig, *, resume: bool = False, console: Console | None = None) -> dict:
    """Runs (or resumes) the training job `cfg`; returns the last train and eval records.

    Raises RunExistsError when `cfg.workdir` holds checkpoints and `resume` is False.
    """
    console = console or Console()
    lead = jax.process_index() == 0
    sharding.assert_same_across_processes({"config": config_lib.to_dict(cfg), "resume": resume}, "config or --resume")
    workdir = Path(cfg.workdir)
    mesh = sharding.make_mesh(cfg.mesh)
    _validate(cfg, mesh)
    checkpointer = Checkpointer(workdir, cfg.keep_checkpoints)
    restored_step = checkpointer.latest_step()
    if restored_step is not None and not resume:
        checkpointer.close()
        raise RunExistsError(
            f"{workdir} already holds checkpoints (step {restored_step}); resume with --resume, "
            "or choose another workdir=..."
        )
    if lead:
        workdir.mkdir(parents=True, exist_ok=True)
        config_lib.save(cfg, workdir / CONFIG_FILE)

    try:
        corpus = data.load_corpus(cfg.data, workdir, cfg.model.vocab_size, save_tokenizer=lead)
        return _loop(cfg, console, lead, mesh, checkpointer, restored_step, corpus)
    finally:
        checkpointer.wait()
        checkpointer.close()


def _loop(cfg, console, lead, mesh, checkpointer, restored_step, corpus) -> dict:
    """The loop proper of `train`, once the run is validated and its data loaded."""
    workdir, seq_len = Path(cfg.workdir), seq_len_of(cfg)
    tx = make_optimizer(cfg.optim, cfg.steps)
    schedule = learning_rate_schedule(cfg.optim, cfg.steps)
    rows = sharding.process_rows(cfg.batch_size, mesh, cfg.grad_accum)
    micro = cfg.batch_size // cfg.grad_accum
    batch_sharding = sharding.batch_sharding(mesh, 3)
    with sharding.mesh_context(mesh):
        setup = setup_model(cfg.model, cfg.seed, tx, mesh)
        if restored_step is not None:
            state = checkpointer.restore(setup.abstract_state)
        else:
            state = setup.init()
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
            timer_step, timer = start, time.perf_counter()
            for step in range(start, cfg.steps):
                batch = data.batch_at(
                    corpus.train, step, seed=cfg.seed, batch_size=cfg.batch_size, seq_len=seq_len, rows=rows
                )
                batch = batch.reshape(cfg.grad_accum, -1, seq_len + 1)
                tokens = sharding.put_batch(batch, batch_sharding)
                state, step_metrics = train_step(state, tokens)
                done = step + 1
                if step == start:
                    # Throughput excludes the first step, which includes compilation.
                    jax.block_until_ready(state.step)
                    if lead:
                        progress.console.print(f"first step (with compilation): {time.perf_counter() - timer:.1f} s")
                    timer_step, timer = done, time.perf_counter()
                if done % cfg.log_every == 0 or done == cfg.steps:
                    values = jax.device_get(step_metrics)
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
                stopping = sharding.any_process(stop.signal is not None)  # all processes stop together
                if done % cfg.checkpoint_every == 0 or done == cfg.steps or stopping:
                    checkpointer.save(done, state)
                progress.update(task, completed=done)
                if stopping:
                    if lead:
                        progress.console.print(f"stopping on signal {stop.signal}: checkpoint saved at step {done}")
                    break
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
    for name in (CHECKPOINT_DIR, metrics.PLOTS_DIR):
        shutil.rmtree(workdir / name, ignore_errors=True)


def restore_run(cfg: config_lib.TrainConfig, step: int | None = None, *, shard_tokens: bool = True):
    """(ModelSetup, TrainState) of checkpoint `step` (default newest) of the run `cfg`.

    shard_tokens: as in `setup_model` (False for generation). Use the returned state
    inside `sharding.mesh_context(setup.mesh)`.
    """
    mesh = sharding.make_mesh(cfg.mesh)
    with sharding.mesh_context(mesh):
        tx = make_optimizer(cfg.optim, cfg.steps)
        setup = setup_model(cfg.model, cfg.seed, tx, mesh, shard_tokens=shard_tokens)
        checkpointer = Checkpointer(cfg.workdir, cfg.keep_checkpoints, read_only=True)
        try:
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
    return dataclasses.replace(cfg, workdir=str(workdir))
