"""Kernel loading: availability is reported with a reason; incompatible builds refused."""

import pytest

import jax_twell as jt
from jax_twell import _kernels


@pytest.fixture
def fresh_loader():
    _kernels._load.cache_clear()
    yield
    _kernels._load.cache_clear()


def test_status_has_reason():
    status = jt.kernel_status()
    assert status.available == jt.kernels_available()
    assert status.available or status.reason


def test_missing_library_is_reported(fresh_loader, monkeypatch, tmp_path):
    monkeypatch.setenv("JAX_TWELL_CUDA_LIB", str(tmp_path / "absent.so"))
    status = jt.kernel_status()
    assert not status.available and "was not built" in status.reason


def test_build_decision_is_the_reason(fresh_loader, monkeypatch, tmp_path):
    import jax_twell

    note = "the CUDA library was not built (JAX_TWELL_CUDA=OFF)"
    (tmp_path / _kernels.BUILD_NOTE).write_text(note + "\n")
    monkeypatch.delenv("JAX_TWELL_CUDA_LIB", raising=False)
    monkeypatch.setattr(jax_twell, "__path__", [str(tmp_path)])
    status = jt.kernel_status()
    assert not status.available and status.reason.startswith(note)


def test_newer_ffi_headers_are_refused(fresh_loader, monkeypatch):
    status = jt.kernel_status()
    if status.library is None or status.ffi_api is None:
        pytest.skip("library not built here, or refused before its FFI version was read (stale build)")
    major, minor = status.ffi_api
    _kernels._load.cache_clear()
    monkeypatch.setattr(_kernels, "_running_ffi_api", lambda: (major, minor - 1))
    refused = jt.kernel_status()
    assert not refused.available
    assert f"built against XLA FFI API {major}.{minor}, newer than the running jaxlib" in refused.reason


def test_stale_abi_is_refused(fresh_loader, monkeypatch):
    if jt.kernel_status().library is None:
        pytest.skip("library not built here")
    _kernels._load.cache_clear()
    monkeypatch.setattr(_kernels, "ABI_VERSION", _kernels.ABI_VERSION + 1)
    assert "handler ABI" in jt.kernel_status().reason
