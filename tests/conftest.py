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


# The slowest tests of the README's test command, each 8-80 s of a worker on two CPU cores
# (`pytest -n auto -m "not slow" --durations=80`, summed over a test's parameters; together
# about half of the command's time): marked slow here, so the command stays within a few
# minutes, and run by CI's second step with the rest of the slow set (.ci/run). Each entry
# is a test (every parameter of it); the quick set keeps other tests of the same kind
# (the contract's CPU inference cases, the CPU kernels against the reference, the models'
# forward against the reference).
SLOW_ON_TWO_CORES = (
    "tests/test_ops.py::test_train_gradients_match_dense",
    "tests/test_ops.py::test_leading_dims_jit_vmap_grad",
    "tests/test_ops.py::test_train_aux_statistics",
    "tests/test_ops.py::test_bf16_training_close_to_f32",
    "tests/test_sharded.py::test_sharded_training_equals_unsharded",
    "tests/test_sharded.py::test_sharded_inference_equals_unsharded",
    "tests/test_ffn_contract.py::TestReference::test_training_is_the_dense_formula_and_its_gradients",
    "tests/test_ffn_contract.py::TestReference::test_training_nan_and_inf_as_the_dense_formula",
    "tests/test_ffn_contract.py::TestReference::test_inference_is_the_dense_formula",
    "tests/test_ffn_contract.py::TestCpu::test_training_is_the_dense_formula_and_its_gradients",
    "tests/test_ffn_contract.py::TestXla::test_training_nan_and_inf_as_the_dense_formula",
    "tests/test_ffn_contract.py::TestXla::test_inference_nan_and_inf_as_the_dense_formula",
    "tests/test_cpu_kernels.py::test_training_default_runs_the_kernels_where_g_is_sparse",
    "tests/test_train_cli.py::test_generate_says_when_it_cuts_max_new_tokens",
    "tests/test_generate.py::test_prefill_equals_forward_and_stepwise_decode",
    "tests/test_generate.py::test_sampling",
    "tests/test_train_faults.py::test_resume_with_an_incompatible_override_writes_nothing",
    "tests/test_train_faults.py::test_divergence_stops_without_checkpointing_and_keeps_the_good_ones",
    "tests/test_train_faults.py::test_corrupted_newest_checkpoint_falls_back_to_the_newest_that_loads",
    "tests/test_train_ffn_paths.py::test_the_register_stays_off_without_the_cuda_ffn",
    "tests/test_train_step.py::test_training_lowers_the_loss_and_sparsifies",
    "tests/test_train_step.py::test_a_non_finite_step_keeps_the_state_it_started_from",
    "tests/test_train_step.py::test_loss_is_cross_entropy_plus_scaled_mean_layer_l1",
    "tests/test_models.py::test_calibrate_ffn_stores_each_layers_active_and_union_fractions_and_decode_cache",
    "tests/test_models.py::test_grads_flow_through_sparse_train_op",
    "tests/test_modules.py::test_grads_match_dense_formula",
    "tests/test_warp_rows.py::test_per_call_form_exact",
    "tests/test_warp_rows.py::test_likely_sparse_follows_the_sample",
    "tests/test_formats.py::test_twell_pack_exact_with_recompute",
    "tests/test_formats.py::test_twell_adversarial_rows",
    "tests/test_checkpoint_io.py::test_import_written_checkpoint",
)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    import jax

    for item in items:
        if item.nodeid.split("[")[0] in SLOW_ON_TWO_CORES:
            item.add_marker(pytest.mark.slow)

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
