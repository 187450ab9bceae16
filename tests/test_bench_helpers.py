"""The training benchmark's memory count (benchmarks/bench_training.py, residual_bytes):
what jax.vjp keeps for the backward, the operands themselves left out once each."""

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_training  # noqa: E402

M, D, F = 64, 32, 48
ARGS = tuple(jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((M, D), (D, F), (D, F), (F, D)))


def _matmuls(x, wg, wu, wd):
    # The backward of a chain of matmuls keeps the operands and the intermediate product.
    return ((x @ wg) @ wd, jnp.float32(0.0))


def test_operands_alone_count_zero():
    assert bench_training.residual_bytes(lambda x, wg, wu, wd: (x @ wg, jnp.float32(0.0)), ARGS) == 0


def test_intermediates_count():
    assert bench_training.residual_bytes(_matmuls, ARGS) == M * F * 2  # x @ wg, bf16


def test_a_residual_shaped_like_an_operand_counts():
    """A weight-shaped residual (here sin(wd)'s cosine) is not mistaken for the operand."""

    def with_copy(x, wg, wu, wd):
        y, l1 = _matmuls(x, wg, wu, wd)
        return y + jnp.sin(wd).sum().astype(y.dtype), l1

    assert bench_training.residual_bytes(with_copy, ARGS) == bench_training.residual_bytes(_matmuls, ARGS) + F * D * 2
