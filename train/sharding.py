"""Device mesh over (data, fsdp, tensor), parameter shardings from logical axes, multi-host start.

The same code runs on one CPU, one GPU, many GPUs and many hosts: the mesh is built from
all global devices, parameters are placed by mapping the model's logical axis names
(`embed`, `mlp`, `heads`, ...) through `jax_twell.models.LOGICAL_AXIS_RULES` (see
`jax_twell.models.param_shardings`), and batches
are split over (data, fsdp).

Several processes (hosts) form one job through `jax.distributed`
(`maybe_initialize_distributed`); each loads only the batch rows its devices hold
(`process_rows`), the processes check that they run the same config
(`assert_same_across_processes`) and stop together (`job_stop_signal`), and process 0 alone
reports (`is_lead`). docs/multihost.md describes launching and what is tested.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_twell.models import LOGICAL_AXIS_RULES
from jax_twell.train.config import MeshConfig

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def maybe_initialize_distributed() -> bool:
    """Starts `jax.distributed` when the environment describes a multi-process job.

    Recognised: JAX_COORDINATOR_ADDRESS (with JAX_NUM_PROCESSES and JAX_PROCESS_ID),
    SLURM with more than one task, Open MPI with more than one rank. Returns whether it
    initialised. Must run before anything touches a jax device.
    """
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        jax.distributed.initialize(
            coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(env["JAX_NUM_PROCESSES"]) if "JAX_NUM_PROCESSES" in env else None,
            process_id=int(env["JAX_PROCESS_ID"]) if "JAX_PROCESS_ID" in env else None,
        )
        return True
    if int(env.get("SLURM_NTASKS", "1")) > 1 or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        jax.distributed.initialize()
        return True
    return False


def make_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all global devices).

    One axis may be -1 to take the remaining devices. Raises ValueError when the shape
    does not match the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = [cfg.data, cfg.fsdp, cfg.tensor]
    if shape.count(-1) > 1:
        raise ValueError(f"mesh: at most one axis may be -1, got {dict(zip(MESH_AXES, shape))}")
    known = int(np.prod([s for s in shape if s != -1]))
    if -1 in shape:
        if len(devices) % known:
            raise ValueError(f"mesh {dict(zip(MESH_AXES, shape))} does not divide {len(devices)} devices")
        shape[shape.index(-1)] = len(devices) // known
    if int(np.prod(shape)) != len(devices):
        raise ValueError(f"mesh {dict(zip(MESH_AXES, shape))} needs {int(np.prod(shape))} devices, have {len(devices)}")
    if len(devices) == len(jax.devices()):
        return jax.make_mesh(tuple(shape), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


@contextlib.contextmanager
def mesh_context(mesh: Mesh):
    """Makes `mesh` current and maps the model's logical axis names onto it.

    Trace (first call of) every jitted model function inside this context.
    """
    with jax.set_mesh(mesh), nnx.logical_axis_rules(LOGICAL_AXIS_RULES):
        yield


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Sharding of a [..., batch, seq] token array: batch over (data, fsdp), the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(*([None] * (ndim - 2)), BATCH_AXES, None))


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding that keeps a full copy on every device of ``mesh``."""
    return NamedSharding(mesh, PartitionSpec())


def put_batch(batch: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """Places this process's rows of a global batch ([..., B_local, T] int32) on the mesh."""
    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)
    return jax.make_array_from_process_local_data(sharding, batch)


def process_rows(global_batch: int, mesh: Mesh | None = None, grad_accum: int = 1) -> slice | np.ndarray:
    """The rows of a step's global batch that this process loads.

    Without `mesh`: an even split over processes (a slice). With `mesh`: exactly the rows
    that this process's devices hold under `batch_sharding(mesh, 3)` once the global batch
    [global_batch, T] is reshaped to [grad_accum, global_batch / grad_accum, T], as an index
    array in that order, so that `batch[rows].reshape(grad_accum, -1, T)` is this
    process's block of the global array (what `put_batch` expects). Processes whose devices
    hold different rows read disjoint rows; processes that are replicas along the batch
    (a mesh whose tensor axis spans hosts) read the same rows.
    """
    if mesh is None:
        per_process, rem = divmod(global_batch, jax.process_count())
        if rem:
            raise ValueError(f"batch_size {global_batch} is not divisible by {jax.process_count()} processes")
        start = jax.process_index() * per_process
        return slice(start, start + per_process)
    micro, rem = divmod(global_batch, grad_accum)
    if rem:
        raise ValueError(f"batch_size {global_batch} is not divisible by grad_accum={grad_accum}")
    spans = {
        index[0].indices(micro)[:2]
        for index in batch_sharding(mesh, 2).addressable_devices_indices_map((micro, 1)).values()
    }
    start, stop = min(a for a, _ in spans), max(b for _, b in spans)
    covered = np.zeros(stop - start, bool)
    for a, b in spans:
        covered[a - start : b - start] = True
    if not covered.all():
        raise ValueError(f"this process's devices hold non-contiguous rows {sorted(spans)} of the batch")
    return (np.arange(grad_accum)[:, None] * micro + np.arange(start, stop)[None, :]).reshape(-1)


def is_lead() -> bool:
    """Whether this is process 0, the one that logs, shows progress and writes run files."""
    return jax.process_index() == 0


def assert_same_across_processes(value, what: str = "config") -> None:
    """Raises ValueError on every process unless all processes pass an equal `value`.

    `value` is any JSON-serialisable object (e.g. `config.to_dict(cfg)`); the processes
    exchange a 128-bit hash of it (one small all-gather), so a job whose processes were
    started with different presets, overrides or flags stops at once with a message naming
    the processes that differ, instead of training on mismatched programs or hanging in a
    collective. A no-op in single-process runs.
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    text = json.dumps(value, sort_keys=True, default=str)
    digest = np.frombuffer(hashlib.sha256(text.encode()).digest()[:16], np.int32)
    digests = np.asarray(multihost_utils.process_allgather(digest)).reshape(jax.process_count(), -1)
    differ = [p for p in range(len(digests)) if not np.array_equal(digests[p], digests[0])]
    if differ:
        raise ValueError(
            f"the {jax.process_count()} processes disagree on the {what}: process(es) {differ} differ from "
            "process 0; start every process with the same preset, overrides and flags"
        )


def job_stop_signal(signum: int | None) -> int | None:
    """The stop signal of the job: `signum` of this process, or one another process received.

    All processes call this together after each step, so that all of them save the same
    checkpoint and stop at the same step even when a SIGTERM / Ctrl-C reached only some of
    them, or reached them during different steps. Returns the largest signal number any
    process received, or None. One process: returns `signum` at no cost; several: one tiny
    all-gather, which waits for the step to finish.
    """
    if jax.process_count() == 1:
        return signum
    from jax.experimental import multihost_utils

    received = int(np.asarray(multihost_utils.process_allgather(np.int32(signum or 0))).max())
    return received or None
