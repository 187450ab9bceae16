"""Multi-host training, proven with several processes on one machine (train/sharding.py).

Two `jax-twell train` processes on localhost, each with two CPU host devices, form one
job through jax.distributed (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID;
CPU collectives over gloo) and train a tiny model on a (data=1, fsdp=2, tensor=2) mesh
over the four devices, so parameters, optimizer state and every batch are split across
the two processes. The test asserts that

- the losses equal those of one process with four host devices step for step, bit for bit
  (measured so with jax 0.10: both jobs compile the same partitioned program, and the
  cross-process collectives over gloo sum in the order of the in-process ones; should a
  later XLA or gloo sum in another order, float32 rounding, rtol 1e-6, is the bound to
  fall back to);
- at every step each process loaded a disjoint half of the global batch, together all of it;
- a checkpoint written by the two-process job resumes in a one-process job, and the
  reverse, with the same next losses;
- processes started with different configs stop with a clear error.

Several processes on one machine run the same program as several hosts; this is the CPU
stand-in for a multi-GPU, multi-host job. Deselect with `-m "not multihost"`.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multihost

WORKER = Path(__file__).with_name("multihost_worker.py")
BATCH, STEPS = 8, 4
RUN = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.head_dim=16", "model.d_ff=64",
       "model.max_seq_len=32", f"steps={STEPS}", f"batch_size={BATCH}", "seq_len=32", "log_every=1",
       f"eval_every={STEPS}", "eval_batches=1", "checkpoint_every=2", "data.eval_percent=20",
       "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"]
TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(num_processes: int, workdir: Path, extra: list[str] = (), resume: bool = False,
           rank_extra: dict[int, list[str]] | None = None) -> list:
    """Starts `jax-twell train` as `num_processes` processes of one job (4 devices in all);
    `rank_extra` adds overrides to single processes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_", "OMPI_"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={4 // num_processes}")
    # The resumed jobs run the programs the first jobs compiled: a shared compilation cache
    # keeps the test short on small CI machines.
    env.update(JAX_COMPILATION_CACHE_DIR=str(workdir.parent / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    port = _free_port()
    procs = []
    for rank in range(num_processes):
        if num_processes > 1:
            env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(num_processes),
                       JAX_PROCESS_ID=str(rank))
        env["JAX_TWELL_ROWS_LOG"] = str(workdir.parent / f"{workdir.name}.rows{rank}.json")
        log = open(workdir.parent / f"{workdir.name}.out{rank}.txt", "w")
        args = ["train", "--sample-tokens", "0", *(["--resume"] if resume else []), *RUN, *extra,
                *(rank_extra or {}).get(rank, []), f"workdir={workdir}"]
        procs.append((subprocess.Popen([sys.executable, str(WORKER), *args], env=dict(env), stdout=log,
                                       stderr=subprocess.STDOUT), log))
    return procs


def _finish(procs) -> list[int]:
    """Waits for the processes of one job; their exit statuses."""
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=TIMEOUT_S))
        except subprocess.TimeoutExpired:
            for other, _ in procs:
                other.kill()
            raise
        finally:
            log.close()
    return codes


def _output(workdir: Path, rank: int) -> str:
    return (workdir.parent / f"{workdir.name}.out{rank}.txt").read_text()


def _check(procs, workdir: Path) -> None:
    codes = _finish(procs)
    for rank, code in enumerate(codes):
        assert code == 0, f"process {rank} of {workdir.name} exited {code}:\n{_output(workdir, rank)[-3000:]}"


def _losses(workdir: Path) -> dict[int, float]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"}


def _rows(workdir: Path, rank: int) -> dict[int, list[int]]:
    loaded = json.loads((workdir.parent / f"{workdir.name}.rows{rank}.json").read_text())
    return {int(step): rows for step, rows in loaded.items()}


def _resumable_copy(src: Path, dst: Path, step: int) -> None:
    """A copy of the run `src` reduced to its checkpoint `step` (as if stopped there)."""
    shutil.copytree(src, dst)
    for ckpt in (dst / "checkpoints").iterdir():
        if ckpt.is_dir() and ckpt.name.isdigit() and int(ckpt.name) != step:
            shutil.rmtree(ckpt)


@pytest.mark.slow  # two training processes end to end (~110 s on two cores)
def test_two_processes_train_like_one_and_share_checkpoints(tmp_path, corpus):
    # One test, not several on a shared fixture: under pytest-xdist (-n auto) tests of a
    # module may land on different workers, and each would start the four jobs again.
    data = [f"data.source={corpus}"]
    one, two = tmp_path / "one", tmp_path / "two"
    jobs = [(_start(1, one, data), one), (_start(2, two, data), two)]
    for procs, workdir in jobs:
        _check(procs, workdir)
    # Each resumes at step 2 from the other's checkpoint, with the other process count.
    two_then_one, one_then_two = tmp_path / "two_then_one", tmp_path / "one_then_two"
    _resumable_copy(two, two_then_one, 2)
    _resumable_copy(one, one_then_two, 2)
    jobs = [(_start(1, two_then_one, data, resume=True), two_then_one),
            (_start(2, one_then_two, data, resume=True), one_then_two)]
    for procs, workdir in jobs:
        _check(procs, workdir)

    # The same losses, step for step, bit for bit (float32 values, exact in JSON).
    reference = _losses(one)
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert reference[STEPS] < reference[1], "the model learns"
    assert _losses(two) == reference

    # Every global batch split into disjoint halves, one per process, together all of it.
    rows = [_rows(two, rank) for rank in range(2)]
    assert sorted(rows[0]) == sorted(rows[1]) == list(range(STEPS))
    for step in range(STEPS):
        first, second = set(rows[0][step]), set(rows[1][step])
        assert len(first) == len(second) == BATCH // 2 and not first & second, step
        assert first | second == set(range(BATCH)), step
    assert _rows(one, 0) == {step: list(range(BATCH)) for step in range(STEPS)}

    # Checkpoints resume across process counts with the uninterrupted run's next losses.
    for resumed in (two_then_one, one_then_two):
        losses = _losses(resumed)
        assert "resumed at step 2" in _output(resumed, 0), resumed.name
        assert sorted(s for s in losses if s > 2) == [3, 4], resumed.name
        assert [losses[3], losses[4]] == [reference[3], reference[4]], resumed.name

    # Process 0 alone writes the log and reports; process 1 prints only JAX's own lines.
    assert "mesh={'data': 1, 'fsdp': 2, 'tensor': 2}" in _output(two, 0)
    for text in ("jax-twell train", "step      4", "run directory"):
        assert text in _output(two, 0) and text not in _output(two, 1), text


def test_processes_with_different_configs_stop_with_a_clear_error(tmp_path, corpus):
    workdir = tmp_path / "mismatch"
    codes = _finish(_start(2, workdir, [f"data.source={corpus}"], rank_extra={1: ["optim.lr=0.01"]}))
    assert codes == [2, 2]
    for rank in range(2):
        assert "processes disagree on the config" in _output(workdir, rank)
    assert not (workdir / "checkpoints").exists()
