"""Shared test configuration: GPU tests skip cleanly where kernels can't run; the CPU
platform gets 4 host devices (before JAX initialises) for the multi-device tests."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import pytest  # noqa: E402

import jax_twell  # noqa: E402


def pytest_collection_modifyitems(config, items):
    status = jax_twell.kernel_status()
    if status.available:
        return
    skip = pytest.mark.skip(reason=f"CUDA kernels unavailable: {status.reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
