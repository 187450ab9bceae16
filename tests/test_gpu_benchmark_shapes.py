"""The kernels on every configuration the benchmarks time (jax_twell.testing.
inference_benchmark_grid), forced sparse, against the reference; the inference op at the
largest M issue 3 names (131,072 tokens); and the training op at M=65,536 tokens (issue 4),
forward and backward against the dense formula. GPU only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_twell as jt
from jax_twell.ops import cuda, cuda_train, reference
from jax_twell.testing import inference_benchmark_grid, synthetic_ffn_inputs, with_extreme_rows
from specs import assert_close, fused_tolerance

pytestmark = pytest.mark.gpu
ALWAYS_SPARSE = cuda.DenseCrossover(margin=float("inf"))


@pytest.mark.parametrize("config", inference_benchmark_grid(), ids=lambda c: "-".join(map(str, c)))
def test_benchmark_configuration_matches_reference(config):
    m, d, f, density, pattern = config
    inp = synthetic_ffn_inputs(jax.random.key(m + f + int(density * 1e4)), m, d, f, density=density, pattern=pattern)
    assert_every_kernel_matches_reference(inp, f, str(config))


def assert_every_kernel_matches_reference(inp, f, what):
    """Every kernel forced sparse, and the default rule (whatever it picks), against the
    reference, on bf16 inputs ``inp`` (x ``[M, d]``) with f neurons. Returns the reference."""
    with jax.default_matmul_precision("highest"):
        want = jax.jit(lambda x, wg, wu, wd: reference.ffn(x, wg, wu, wd, tile=256, capacity=32))(*inp)
    tol = fused_tolerance(jnp.bfloat16, f)
    for kernel in cuda.KERNELS:
        op = jax.jit(
            lambda x, wg, wu, wd: cuda.sparse_ffn(
                x, wg, wu, wd, tile=256, capacity=32, crossover=ALWAYS_SPARSE, kernel=kernel
            )
        )
        assert_close(op(*inp), want, tol, f"{what} kernel={kernel}")
    auto = jax.jit(lambda x, wg, wu, wd: cuda.sparse_ffn(x, wg, wu, wd, tile=256, capacity=32))(*inp)
    assert_close(auto, want, tol, f"{what} default rule")
    return want


def test_inference_op_at_131072_tokens():
    """Issue 3's largest M, with rows past every tile's capacity and empty rows: every
    kernel forced sparse, and the default rule, against the reference (the blocked
    kernels' workspace is then ~3 GB of partial sums, indexed past 2^31 bytes); and the
    public op on the same tokens as [32, 4096, d] (leading dims)."""
    m, d, f = 131072, 2048, 5632
    inp = with_extreme_rows(synthetic_ffn_inputs(jax.random.key(131), m, d, f, density=0.005), full=3, empty=5)
    want = assert_every_kernel_matches_reference(inp, f, "M=131072")
    x3 = inp.x.reshape(32, m // 32, d)
    y3 = jax.jit(lambda x, wg, wu, wd: jt.sparse_ffn(x, wg, wu, wd, implementation="cuda"))(x3, *inp[1:])
    assert y3.shape == x3.shape
    assert_close(y3, want.reshape(x3.shape), fused_tolerance(jnp.bfloat16, f), "M=131072 public op, [32, 4096, d]")


def test_training_op_at_65536_tokens():
    m, d, f = 65536, 2048, 5632
    inp = with_extreme_rows(synthetic_ffn_inputs(jax.random.key(65), m, d, f, density=0.005), full=3, empty=5)
    dy = jax.random.normal(jax.random.key(66), (m, d), jnp.float32).astype(jnp.bfloat16)
    l1_coef = 0.37

    def loss(op):
        def fn(x, wg, wu, wd):
            y, l1 = op(x, wg, wu, wd)
            return (y.astype(jnp.float32) * dy.astype(jnp.float32)).sum() + l1_coef * l1, y

        return jax.jit(jax.value_and_grad(fn, (0, 1, 2, 3), has_aux=True))

    cuda_op = lambda x, wg, wu, wd: cuda_train.ffn_with_aux(
        x, wg, wu, wd, width=128, crossover=cuda_train.TrainCrossover(margin=float("inf"))
    )[:2]

    def dense_op(x, wg, wu, wd):  # the formula in f32 (docs/design.md, section 1, The job)
        x, wg, wu, wd = (a.astype(jnp.float32) for a in (x, wg, wu, wd))
        h = jax.nn.relu(x @ wg) * (x @ wu)
        return h @ wd, jnp.abs(h).sum() / x.shape[0]

    (_, y), grads = loss(cuda_op)(*inp)
    with jax.default_matmul_precision("highest"):
        (_, y_d), grads_d = loss(dense_op)(*inp)
    assert_close(y, y_d, 2.0**-5, "y")
    for name, g, g_d in zip(("dx", "dw_gate", "dw_up", "dw_down"), grads, grads_d):
        assert g.dtype == jnp.bfloat16 and np.isfinite(np.asarray(g, np.float32)).all(), name
        assert_close(g, g_d, 2.0**-5, name)
