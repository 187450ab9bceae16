"""Measuring for `jax-twell bench`: interleaved timing, NVML power, compiled memory, run metadata.

Timing (:func:`time_rounds`): every runner is called ``warmup`` times (its program already
compiled: compilation is never timed), then a calls-per-window count is set from one more
call so that a timed window lasts at least ``min_seconds`` (and holds at least
``min_calls`` calls); then ``repeats`` rounds each time one window of every runner in
turn, waiting for the last result (``jax.block_until_ready``). A drift of the device's
clock or power state then falls on every model alike. The figure is the median over the
rounds of the window's seconds per call.

Power (:class:`PowerSampler`): a background thread reads the GPU's power through NVML
(the ``nvidia-ml-py`` package, imported only here and only on GPUs) every ``interval``
seconds; the energy of a timed window is the integral of those readings over it.
"""

from __future__ import annotations

import bisect
import datetime
import math
import os
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, NamedTuple

import jax


class Timing(NamedTuple):
    """One runner's timing: ``seconds`` per call (median over rounds), ``spread`` (interquartile
    range over the rounds / median; 0 with fewer than two rounds), ``calls`` per window, and
    the ``windows`` ``[(start, end)]`` in ``time.perf_counter`` seconds."""

    seconds: float
    spread: float
    calls: int
    windows: list


def time_rounds(
    runners: dict[str, Callable[[], object]],
    *,
    warmup: int,
    repeats: int,
    min_seconds: float = 0.0,
    min_calls: int = 1,
    advance: Callable[[], None] = lambda: None,
) -> dict[str, Timing]:
    """Times zero-argument ``runners`` (each returns what to wait for) in interleaved rounds
    (module docstring); ``advance()`` is called after each warm-up and each timed window
    (a progress bar). Returns a :class:`Timing` per name."""
    calls = {}
    for name, run in runners.items():
        for _ in range(warmup):
            jax.block_until_ready(run())
            advance()
        start = time.perf_counter()
        jax.block_until_ready(run())
        single = time.perf_counter() - start
        calls[name] = max(min_calls, 1, math.ceil(min_seconds / max(single, 1e-9)))
    seconds = {name: [] for name in runners}
    windows = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            for _ in range(calls[name]):
                out = run()
            jax.block_until_ready(out)
            end = time.perf_counter()
            seconds[name].append((end - start) / calls[name])
            windows[name].append((start, end))
            advance()
    result = {}
    for name, values in seconds.items():
        median = statistics.median(values)
        quartiles = statistics.quantiles(values, n=4) if len(values) > 1 else (median, median, median)
        result[name] = Timing(median, (quartiles[2] - quartiles[0]) / median, calls[name], windows[name])
    return result


def compiled_peak_bytes(compiled) -> int | None:
    """Device bytes a compiled program holds while it runs, from XLA's buffer assignment:
    arguments + outputs + temporaries - aliased (donated) buffers. None where the backend
    gives no memory analysis."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001  (backends without an analysis raise various errors)
        return None
    if stats is None:
        return None
    return int(
        stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes - stats.alias_size_in_bytes
    )


def device_memory(device: jax.Device) -> dict:
    """The device allocator's figures for the whole process so far (``jax.Device.memory_stats``):
    ``peak_bytes_in_use``, ``bytes_in_use``, ``bytes_limit`` and a ``reason`` when the
    backend reports none (CPUs)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    keys = ("peak_bytes_in_use", "bytes_in_use", "bytes_limit")
    if not stats:
        return {**{k: None for k in keys}, "reason": f"jax.Device.memory_stats() reports nothing on {device.platform}"}
    return {**{k: stats.get(k) for k in keys}, "reason": None}


def _nvml_handle(nvml, device: jax.Device):
    """The NVML handle of the GPU behind ``device``: CUDA_VISIBLE_DEVICES renumbers CUDA
    devices, NVML does not."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    ordinal = getattr(device, "local_hardware_id", None)
    ordinal = device.id if ordinal is None else ordinal
    if visible and ordinal < len(visible):
        entry = visible[ordinal]
        if entry.isdigit():
            return nvml.nvmlDeviceGetHandleByIndex(int(entry))
        return nvml.nvmlDeviceGetHandleByUUID(entry)
    return nvml.nvmlDeviceGetHandleByIndex(ordinal)


class PowerSampler:
    """Samples a GPU's power draw in a background thread (NVML; milliwatts, stored in watts).

    Reads NVML's instantaneous power field where the driver has it, else
    ``nvmlDeviceGetPowerUsage`` (on recent GPUs an average over the last second: windows
    shorter than that smear into each other, hence ``min_seconds`` in the timing).
    Use :func:`open_power_sampler`; ``start()`` / ``stop()`` (or ``with``); :meth:`energy` of a window.
    """

    def __init__(self, nvml, handle, interval: float):
        self._nvml, self._handle, self.interval = nvml, handle, interval
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        field = getattr(nvml, "NVML_FI_DEV_POWER_INSTANT", None)
        self._field = field if field is not None and self._read_field(field) is not None else None
        self.reading = "NVML instantaneous power field" if self._field is not None else "nvmlDeviceGetPowerUsage"

    def _read_field(self, field) -> float | None:
        try:
            value = self._nvml.nvmlDeviceGetFieldValues(self._handle, [field])[0]
        except Exception:  # noqa: BLE001  (old drivers: NVMLError of several kinds)
            return None
        return None if getattr(value, "nvmlReturn", 1) != 0 else float(value.value.uiVal) / 1e3

    def read(self) -> float:
        """One power reading in watts."""
        if self._field is not None:
            watts = self._read_field(self._field)
            if watts is not None:
                return watts
        return float(self._nvml.nvmlDeviceGetPowerUsage(self._handle)) / 1e3

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), self.read()))
            self._stop.wait(self.interval)

    def start(self) -> None:
        """Starts the sampling thread."""
        self._thread = threading.Thread(target=self._loop, name="jax-twell-power", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops the sampling thread and releases NVML."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self._nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass

    def __enter__(self) -> "PowerSampler":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def energy(self, start: float, end: float) -> float | None:
        """Joules drawn over ``[start, end]`` (``time.perf_counter`` seconds): the trapezoid
        integral of the samples, linearly interpolated at the window's edges. None when no
        sample lies at or before ``start`` and at or after ``end``."""
        return integrate_power(list(self.samples), start, end)


def integrate_power(samples: list[tuple[float, float]], start: float, end: float) -> float | None:
    """Joules over ``[start, end]`` from ``(time, watts)`` samples in time order (see
    :meth:`PowerSampler.energy`)."""
    if end <= start or not samples or samples[0][0] > start or samples[-1][0] < end:
        return None
    times = [t for t, _ in samples]

    def at(t: float) -> float:
        i = min(max(bisect.bisect_left(times, t), 1), len(samples) - 1)
        (t0, w0), (t1, w1) = samples[i - 1], samples[i]
        return w1 if t1 == t0 else w0 + (w1 - w0) * (t - t0) / (t1 - t0)

    inside = samples[bisect.bisect_right(times, start) : bisect.bisect_left(times, end)]
    points = [(start, at(start)), *inside, (end, at(end))]
    return sum((t1 - t0) * (w0 + w1) / 2 for (t0, w0), (t1, w1) in zip(points, points[1:]))


def open_power_sampler(device: jax.Device, interval: float) -> tuple[PowerSampler | None, str | None]:
    """``(sampler, None)`` for a GPU whose power NVML reads, else ``(None, reason)``."""
    if device.platform != "gpu":
        return None, f"no power reading on {device.platform} (NVML reads NVIDIA GPUs only)"
    try:
        import pynvml  # the nvidia-ml-py package: pip install nvidia-ml-py (in the gpu extra)
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install nvidia-ml-py, or the [gpu] extra)"
    try:
        pynvml.nvmlInit()
        sampler = PowerSampler(pynvml, _nvml_handle(pynvml, device), interval)
        sampler.read()
    except Exception as e:  # noqa: BLE001  (NVMLError and its many subclasses)
        return None, f"NVML cannot read this GPU's power: {type(e).__name__}: {e}"
    return sampler, None


def run_metadata(device: jax.Device) -> dict:
    """UTC date, device, platform, jax/jaxlib versions, the CUDA and CPU kernels' status and the commit
    measured: ``$JAX_TWELL_COMMIT`` when set (a copied tree's git metadata may be stale),
    else git's HEAD of the source tree (``+dirty`` with local edits to tracked files), else
    "unknown"."""
    import jax_twell

    commit = code_commit()
    status = jax_twell.kernel_status()
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=device.device_kind,
        platform=device.platform,
        devices_visible=jax.device_count(),
        jax=jax.__version__,
        jaxlib=jax.lib.__version__,
        cuda_kernels=status.available,
        cuda_kernels_reason=None if status.available else status.reason,
        cpu_kernels=jax_twell.cpu_kernels_available(),
        commit=commit,
    )


def code_commit() -> str:
    """The commit of the code that runs: ``JAX_TWELL_COMMIT`` when set (a copy of the tree
    without its git history), else git's HEAD, with ``+dirty`` for uncommitted changes."""
    return os.environ.get("JAX_TWELL_COMMIT") or _git_commit(Path(__file__).resolve().parent)


def _git_commit(folder: Path) -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=folder, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if status.stdout.strip() else "")
