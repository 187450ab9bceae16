"""Shared test configuration: GPU tests skip cleanly where kernels can't run."""

import pytest

import jax_twell


def pytest_collection_modifyitems(config, items):
    status = jax_twell.kernel_status()
    if status.available:
        return
    skip = pytest.mark.skip(reason=f"CUDA kernels unavailable: {status.reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
