"""Finding, checking and registering the CUDA FFI library.

The handlers live in ``libjax_twell_cuda.so``, a plain shared library (no Python
extension), so one build serves every Python version. It is looked up, in order, at
``$JAX_TWELL_CUDA_LIB`` and in each directory of the ``jax_twell`` package path.

Before any handler is registered the library's build facts are checked: its handler ABI
must match this Python package, and the XLA FFI API version of the headers it was
compiled against must not be newer than the running jaxlib's (such a library would fail
later with an opaque "no handler registered" or a crash). Where no library was built, the
reason the build wrote beside it (``cuda_build.txt``) is the status's reason.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import re
from pathlib import Path

import jax

__all__ = ["kernels_available", "kernel_status", "kernel_call", "KernelStatus", "HANDLERS"]

LIBRARY_NAME = "libjax_twell_cuda.so"
BUILD_NOTE = "cuda_build.txt"  # written by ffi/CMakeLists.txt: what the build did, and why
# Bumped together with jax_twell_abi_version() in ffi/version.cc.
ABI_VERSION = 20

# FFI target name -> exported handler symbol. The one registration table.
HANDLERS = {
    "jax_twell_pack": "JaxTwellPack",
    "jax_twell_gate_pack": "JaxTwellGatePack",
    "jax_twell_ffn_gated": "JaxTwellFfnGated",
    "jax_twell_ffn": "JaxTwellFfn",
    "jax_twell_ffn_warp_gated": "JaxTwellFfnWarpGated",
    "jax_twell_ffn_warp": "JaxTwellFfnWarp",
    "jax_twell_ffn_warp_from_g_gated": "JaxTwellFfnWarpFromGGated",
    "jax_twell_ffn_warp_from_g": "JaxTwellFfnWarpFromG",
    "jax_twell_ffn_backup_gated": "JaxTwellFfnBackupGated",
    "jax_twell_ffn_backup": "JaxTwellFfnBackup",
    "jax_twell_ffn_backup_gated_from_x": "JaxTwellFfnBackupGatedFromX",
    "jax_twell_ffn_backup_from_x": "JaxTwellFfnBackupFromX",
    "jax_twell_ffn_backup_gemm_gated": "JaxTwellFfnBackupGemmGated",
    "jax_twell_ffn_backup_gemm": "JaxTwellFfnBackupGemm",
    "jax_twell_ffn_backup_gemm_gated_from_x": "JaxTwellFfnBackupGemmGatedFromX",
    "jax_twell_ffn_backup_gemm_from_x": "JaxTwellFfnBackupGemmFromX",
    "jax_twell_pack_unless": "JaxTwellPackUnless",
    "jax_twell_ffn_warp_gated_unless": "JaxTwellFfnWarpGatedUnless",
    "jax_twell_ffn_warp_unless": "JaxTwellFfnWarpUnless",
    "jax_twell_ffn_blocked_gated": "JaxTwellFfnBlockedGated",
    "jax_twell_ffn_blocked": "JaxTwellFfnBlocked",
    "jax_twell_train_fwd_gated": "JaxTwellTrainFwdGated",
    "jax_twell_train_fwd": "JaxTwellTrainFwd",
    "jax_twell_train_bwd_gated": "JaxTwellTrainBwdGated",
    "jax_twell_train_bwd": "JaxTwellTrainBwd",
    "jax_twell_decode_gated": "JaxTwellDecodeGated",
    "jax_twell_decode": "JaxTwellDecode",
    "jax_twell_decode_fused_gated": "JaxTwellDecodeFusedGated",
    "jax_twell_decode_fused": "JaxTwellDecodeFused",
    "jax_twell_decode_rows_gated": "JaxTwellDecodeRowsGated",
    "jax_twell_decode_rows": "JaxTwellDecodeRows",
    "jax_twell_dense_ffn_if_gated": "JaxTwellDenseFfnIfGated",
    "jax_twell_dense_ffn_if": "JaxTwellDenseFfnIf",
}
_REGISTERED: set[str] = set()


@dataclasses.dataclass(frozen=True)
class KernelStatus:
    """Whether the CUDA kernels can run here, and if not, why.

    Attributes:
      available: kernels are loaded, registered, and a supported CUDA device is present.
      reason: a sentence saying what is missing when ``available`` is False.
      library: path of the library that was found (None if none).
      ffi_api: XLA FFI API version (major, minor) the library was built against.
      device: the CUDA device the check looked at.
    """

    available: bool
    reason: str
    library: str | None = None
    ffi_api: tuple[int, int] | None = None
    device: str | None = None


def _candidate_paths() -> list[Path]:
    env = os.environ.get("JAX_TWELL_CUDA_LIB")
    if env:
        return [Path(env)]
    import jax_twell

    return [Path(p) / LIBRARY_NAME for p in jax_twell.__path__]


def read_build_note(name: str) -> str | None:
    """What the install's build wrote about one of its parts (the file ``name`` beside the
    package: what it decided, and why), or None where there is none."""
    import jax_twell

    for folder in jax_twell.__path__:
        try:
            return (Path(folder) / name).read_text().strip()
        except OSError:
            continue
    return None


def _not_built_reason() -> str:
    env = os.environ.get("JAX_TWELL_CUDA_LIB")
    if env:
        return f"{LIBRARY_NAME} was not built at JAX_TWELL_CUDA_LIB={env}"
    note = read_build_note(BUILD_NOTE)
    if note is not None:
        return f"{note}. The reference and XLA paths still run."
    return (
        f"{LIBRARY_NAME} was not built: it needs a CUDA GPU (or JAX_TWELL_CUDA=ON), nvcc and the "
        "CUTLASS headers at install time; the reference and XLA paths still run"
    )


def _running_ffi_api() -> tuple[int, int] | None:
    header = Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h"
    try:
        text = header.read_text()
    except OSError:
        return None
    major = re.search(r"#define XLA_FFI_API_MAJOR (\d+)", text)
    minor = re.search(r"#define XLA_FFI_API_MINOR (\d+)", text)
    if not (major and minor):
        return None
    return int(major.group(1)), int(minor.group(1))


def _cuda_device():
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return None
    cuda = [d for d in devices if d.platform == "gpu" and "rocm" not in d.client.platform_version.lower()]
    return cuda[0] if cuda else None


@functools.cache
def _load() -> tuple[KernelStatus, ctypes.CDLL | None]:
    paths = [p for p in _candidate_paths() if p.is_file()]
    if not paths:
        return KernelStatus(False, _not_built_reason()), None
    path = paths[0]
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return KernelStatus(False, f"could not load {path}: {e}", library=str(path)), None
    abi = lib.jax_twell_abi_version()
    if abi != ABI_VERSION:
        return KernelStatus(
            False,
            f"{path} has handler ABI {abi} but this jax_twell expects {ABI_VERSION}: "
            "rebuild the library (pip install -e . again)",
            library=str(path),
        ), None
    built = (lib.jax_twell_ffi_api_major(), lib.jax_twell_ffi_api_minor())
    running = _running_ffi_api()
    if running is not None and (built[0] != running[0] or built[1] > running[1]):
        return KernelStatus(
            False,
            f"{path} was built against XLA FFI API {built[0]}.{built[1]}, newer than the "
            f"running jaxlib {jax.lib.__version__} supports ({running[0]}.{running[1]}): "
            "rebuild it against this jaxlib's headers or an older one (0.10.x gives API 0.3)",
            library=str(path),
            ffi_api=built,
        ), None
    device = _cuda_device()
    if device is None:
        return KernelStatus(False, "no CUDA device is visible to JAX", library=str(path), ffi_api=built), lib
    capability = getattr(device, "compute_capability", "")
    if not str(capability).startswith("9."):
        return KernelStatus(
            False,
            f"kernels are built for sm_90a (Hopper); {device.device_kind} has compute capability {capability}",
            library=str(path),
            ffi_api=built,
            device=device.device_kind,
        ), lib
    for target, symbol in HANDLERS.items():
        if target not in _REGISTERED:  # registration is process-wide; once per target
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="CUDA")
            _REGISTERED.add(target)
    return KernelStatus(True, "", library=str(path), ffi_api=built, device=device.device_kind), lib


def dense_if_available() -> bool:
    """True when the kernels are available and the library was built with cuBLASLt's
    header (``jax_twell_dense_ffn_if*``: the per-call form's dense side on cuBLAS, chosen
    on the device; ffi/twell_dense_if.cu)."""
    state, lib = _load()
    return bool(state.available and lib is not None and lib.jax_twell_dense_if_available())


def kernel_status() -> KernelStatus:
    """Loads and registers the CUDA kernels once; returns what happened (see KernelStatus)."""
    return _load()[0]


def kernels_available() -> bool:
    """True when the CUDA kernels are loaded, registered and a Hopper GPU is present."""
    return kernel_status().available


def kernel_call(target: str, result_types, *, vmap_method: str, aliases: dict[int, int] | None = None):
    """``jax.ffi.ffi_call`` for one of our handlers, loading and registering the library first.

    Raises:
      KeyError: ``target`` is not one of ``HANDLERS``.
      RuntimeError: the kernels cannot run here; the message gives the reason
        (see kernel_status), instead of XLA's "no FFI handler registered".

    ``aliases``: operand index -> result index, results written in place over operands
    (``jax.ffi.ffi_call``'s ``input_output_aliases``).
    """
    return checked_ffi_call(target, HANDLERS, kernel_status, "CUDA", result_types, vmap_method, aliases)


def checked_ffi_call(target: str, known, status, kind: str, result_types, vmap_method: str,
                     aliases: dict[int, int] | None = None):
    """``jax.ffi.ffi_call`` of ``target`` after checking it is one of ``known`` (else
    KeyError) and that ``status()`` says the ``kind`` ("CUDA", "CPU") kernels can run
    (else RuntimeError with its reason)."""
    if target not in known:
        raise KeyError(f"unknown jax_twell {kind} FFI target {target!r}; known: {sorted(known)}")
    state = status()
    if not state.available:
        raise RuntimeError(f"jax_twell {kind} kernel {target!r} cannot run: {state.reason}")
    call = jax.ffi.ffi_call(target, result_types, vmap_method=vmap_method, input_output_aliases=aliases)

    def typed(*operands, **attributes):
        # Under shard_map a custom call's results are typed as varying over no mesh axis
        # whatever its operands vary over; typed here as the operands, so that a kernel's
        # result and XLA's dense one can be the two branches of one lax.cond.
        return as_varying(call(*operands, **attributes), mesh_axes(*operands))

    return typed


def varying_axes(a) -> frozenset:
    """Manual mesh axes over which ``a`` varies (empty outside shard_map)."""
    aval = jax.typeof(a)
    mat = getattr(aval, "mat", None)  # jax 0.10 keeps them here, later versions in .vma
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def mesh_axes(*arrays) -> frozenset:
    """Manual mesh axes over which any of ``arrays`` varies (None entries skipped)."""
    return frozenset().union(*(varying_axes(a) for a in arrays if a is not None))


def as_varying(tree, axes: frozenset):
    """``tree`` with each array typed as varying over ``axes`` as well (``lax.pcast``;
    nothing happens at run time). Outside shard_map ``axes`` is empty and ``tree`` is
    returned as it is."""
    if not axes:
        return tree

    def one(a):
        missing = tuple(sorted(axes - varying_axes(a)))
        return jax.lax.pcast(a, missing, to="varying") if missing else a

    return jax.tree.map(one, tree)
