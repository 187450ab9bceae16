"""The tests' specs and tolerances. The named specs (``FFNSpec``, ``CPU_SPECS``,
``GPU_SPECS``, the benchmark grid) live in :mod:`jax_twell.testing`, which the benchmarks
import too, so the two grids can't drift apart; tolerances are stated once, here."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jax_twell.testing import CPU_SPECS, GPU_SPECS, FFNSpec, inference_benchmark_grid  # noqa: F401  (re-exported)

# Relative (max-abs-error / max-abs-reference) tolerance per dtype for a reduction over
# n terms: unit roundoff times sqrt(n) with headroom; gradients get 4x more. In bf16 and
# f16 the sums run in f32 and the output's own rounding dominates, so the error does not
# grow with n: there the tolerance stops at 32 units of the dtype's rounding (bf16 0.125,
# f16 0.016; 4x for gradients), far below the 1.0 of a result left at zero.
_EPS = {jnp.dtype(jnp.float32): 2.0**-23, jnp.dtype(jnp.bfloat16): 2.0**-8, jnp.dtype(jnp.float16): 2.0**-11}
_LOW_PRECISION_ULPS = 32


def tolerance(dtype, n: int, *, grad: bool = False) -> float:
    eps = _EPS[jnp.dtype(dtype)]
    tol = 16 * eps * math.sqrt(max(n, 1))
    if jnp.dtype(dtype) != jnp.dtype(jnp.float32):
        tol = min(tol, _LOW_PRECISION_ULPS * eps)
    return tol * (4 if grad else 1)


def assert_close(actual, expected, tol: float, what: str = "") -> None:
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert np.all(np.isfinite(a)), f"{what}: non-finite values in result"
    scale = max(np.abs(e).max(initial=0.0), 1e-30)
    err = np.abs(a - e).max(initial=0.0) / scale
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


def assert_rows_close(actual, expected, dtype, what: str = "", *, ulps: float = 8) -> None:
    """Row by row: each row's largest error at most ``ulps`` units of the output dtype's
    rounding of that row's largest value. For kernels that round where the reference
    rounds (only the f32 sums' order differs): a row left unwritten, written with another
    row's values or with columns missing fails, as do small rows beside large ones."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert np.all(np.isfinite(a)), f"{what}: non-finite values in result"
    a2, e2 = a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1), e.reshape(-1, e.shape[-1]) if e.ndim else e.reshape(1, 1)
    scale = np.maximum(np.abs(e2).max(axis=-1, initial=0.0), 1e-30)
    err = np.abs(a2 - e2).max(axis=-1, initial=0.0) / scale
    tol = ulps * _EPS[jnp.dtype(dtype)]
    worst = int(np.argmax(err)) if err.size else 0
    assert err.size == 0 or err[worst] <= tol, f"{what}: row {worst}'s relative error {err[worst]:.3g} > {tol:.3g}"


def fused_tolerance(dtype, f: int) -> float:
    """Tolerance of a fused FFN kernel against the reference: g, u and h are each rounded
    to the element type before the down projection, so twice the plain one."""
    return 2 * tolerance(dtype, f)
