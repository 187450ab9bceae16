"""Finding, checking and registering the CPU FFI handlers.

The handlers (cpu/twell_cpu.cc) are built on every install as the nanobind extension
module ``jax_twell._cpu_kernels``, which hands them over as capsules. Before any is
registered, the module's handler ABI must match this Python package and the XLA FFI API of
the headers it was compiled against must not be newer than the running jaxlib's. Where
the module is missing (a build with ``JAX_TWELL_CPU=OFF``, or a copy of the sources put on
the path without an install), the status says why and the ops run XLA's dense FFN on the
CPU: importing jax_twell never fails for it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from jax_twell import _kernels

__all__ = ["CpuKernelStatus", "cpu_kernel_status", "cpu_kernels_available", "cpu_kernel_call", "CPU_HANDLERS"]

BUILD_NOTE = "cpu_build.txt"  # written by cpu/CMakeLists.txt: what the build did
# Bumped together with kAbiVersion in cpu/twell_cpu.cc.
ABI_VERSION = 3
CPU_HANDLERS = ("jax_twell_cpu_up_down", "jax_twell_cpu_down", "jax_twell_cpu_gate", "jax_twell_cpu_gate_twell",
                "jax_twell_cpu_up_down_twell", "jax_twell_cpu_up_down_train", "jax_twell_cpu_backward")
_REGISTERED: set[str] = set()


@dataclasses.dataclass(frozen=True)
class CpuKernelStatus:
    """Whether the CPU kernels can run here, and if not, why.

    Attributes:
      available: the module is loaded and its handlers registered for the CPU.
      reason: a sentence saying what is missing when ``available`` is False.
      module: path of the extension module that was found (None if none).
      ffi_api: XLA FFI API version (major, minor) the module was built against.
    """

    available: bool
    reason: str
    module: str | None = None
    ffi_api: tuple[int, int] | None = None


def _not_built_reason(error: Exception) -> str:
    note = _kernels.read_build_note(BUILD_NOTE)
    if note is not None:
        return f"{note}. XLA's dense FFN runs on the CPU instead."
    return (
        f"the CPU module jax_twell._cpu_kernels is not importable ({error}): it is built by "
        "`pip install` of the package (nanobind and a C++17 compiler); XLA's dense FFN runs on the CPU instead"
    )


@functools.cache
def _load() -> CpuKernelStatus:
    try:
        from jax_twell import _cpu_kernels
    except ImportError as e:
        return CpuKernelStatus(False, _not_built_reason(e))
    path = getattr(_cpu_kernels, "__file__", None)
    abi = _cpu_kernels.abi_version()
    if abi != ABI_VERSION:
        return CpuKernelStatus(
            False,
            f"{path} has handler ABI {abi} but this jax_twell expects {ABI_VERSION}: rebuild it (pip install -e . again)",
            module=path,
        )
    built = tuple(_cpu_kernels.ffi_api_version())
    running = _kernels._running_ffi_api()
    if running is not None and (built[0] != running[0] or built[1] > running[1]):
        return CpuKernelStatus(
            False,
            f"{path} was built against XLA FFI API {built[0]}.{built[1]}, newer than the running jaxlib "
            f"{jax.lib.__version__} supports ({running[0]}.{running[1]}): rebuild it against this jaxlib's headers",
            module=path,
            ffi_api=built,
        )
    for target, capsule in _cpu_kernels.handlers().items():
        if target not in _REGISTERED:  # registration is process-wide; once per target
            jax.ffi.register_ffi_target(target, capsule, platform="cpu")
            _REGISTERED.add(target)
    return CpuKernelStatus(True, "", module=path, ffi_api=built)


def cpu_kernel_status() -> CpuKernelStatus:
    """Loads and registers the CPU kernels once; returns what happened (see CpuKernelStatus)."""
    return _load()


def cpu_kernels_available() -> bool:
    """True when the CPU kernels are loaded and registered (any CPU; no device check)."""
    return cpu_kernel_status().available


def cpu_kernel_call(target: str, result_types, *, vmap_method: str = "sequential"):
    """``jax.ffi.ffi_call`` for one of the CPU handlers, registering them first.

    Raises:
      KeyError: ``target`` is not one of ``CPU_HANDLERS``.
      RuntimeError: the module is unavailable; the message gives the reason.
    """
    return _kernels.checked_ffi_call(target, CPU_HANDLERS, cpu_kernel_status, "CPU", result_types, vmap_method)
