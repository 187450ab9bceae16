"""Shared test configuration: GPU tests skip cleanly where kernels can't run; in a process
whose default device is a GPU the other tests skip with how to run them (``JAX_PLATFORMS=cpu``:
they state CPU semantics); the CPU platform gets 4 host devices (before JAX initialises) for the multi-device tests; XLA's
GPU GEMM autotuning is off (the tests compile hundreds of matmul shapes, often in many
processes sharing one GPU, and need any correct algorithm, not the fastest;
``JAX_TWELL_TEST_AUTOTUNE=1``, or an autotune level in ``XLA_FLAGS``, keeps it)."""

import os

_flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
if not os.environ.get("JAX_TWELL_TEST_AUTOTUNE") and "xla_gpu_autotune_level" not in _flags:
    _flags += " --xla_gpu_autotune_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()

import pytest  # noqa: E402

import jax_twell  # noqa: E402


def pytest_collection_modifyitems(config, items):
    import jax

    if jax.default_backend() != "cpu":
        # The tests not marked gpu state CPU semantics: XLA's f32 products in f32 (a GPU
        # runs them in TF32), the host's 4 devices for the meshes, the CPU kernels'
        # handlers. In a process whose default device is a GPU they would test something
        # else, so they run in a CPU-only process instead.
        skip_cpu = pytest.mark.skip(reason="a CPU test: run the tests not marked gpu with JAX_PLATFORMS=cpu")
        for item in items:
            if "gpu" not in item.keywords:
                item.add_marker(skip_cpu)
    status = jax_twell.kernel_status()
    if status.available:
        return
    skip = pytest.mark.skip(reason=f"CUDA kernels unavailable: {status.reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small Python corpus for the training CLI's tests (modules may define their own)."""
    import numpy as np

    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    for i in range(20):
        (root / f"m{i}.py").write_text("".join(f"def f{j}(x):\n    return x * {j}\n" for j in rng.integers(0, 99, 60)))
    return root
