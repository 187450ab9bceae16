"""Named argument specs and tolerances, shared by tests and benchmarks so the two grids
can't drift apart. Tolerances are stated once, here."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np


class FFNSpec(NamedTuple):
    """One FFN problem: tokens m, model width d, hidden width f, active fraction, pattern."""

    m: int
    d: int
    f: int
    density: float
    pattern: str = "uniform"


# Small shapes that still exercise every edge: partial tiles (f % 256 != 0), token counts
# that are not multiples of anything, rows far over capacity (heavy), all-dense rows.
CPU_SPECS = [
    FFNSpec(37, 32, 300, 0.02),
    FFNSpec(64, 48, 512, 0.05, "heavy"),
    FFNSpec(5, 16, 96, 0.5, "dense"),
    FFNSpec(1, 64, 260, 0.05),
]

GPU_SPECS = CPU_SPECS + [
    FFNSpec(2048, 2048, 5632, 0.005),
    FFNSpec(333, 2048, 5632, 0.005, "heavy"),
    FFNSpec(1000, 512, 1408, 0.05, "heavy"),
    FFNSpec(257, 1024, 4000, 0.5, "dense"),
]

# Relative (max-abs-error / max-abs-reference) tolerance per dtype for a reduction over
# n terms: unit roundoff times sqrt(n) with headroom; gradients get 4x more.
_EPS = {jnp.dtype(jnp.float32): 2.0**-23, jnp.dtype(jnp.bfloat16): 2.0**-8, jnp.dtype(jnp.float16): 2.0**-11}


def tolerance(dtype, n: int, *, grad: bool = False) -> float:
    return 16 * _EPS[jnp.dtype(dtype)] * math.sqrt(max(n, 1)) * (4 if grad else 1)


def assert_close(actual, expected, tol: float, what: str = "") -> None:
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert np.all(np.isfinite(a)), f"{what}: non-finite values in result"
    scale = max(np.abs(e).max(initial=0.0), 1e-30)
    err = np.abs(a - e).max(initial=0.0) / scale
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


def fused_tolerance(dtype, f: int) -> float:
    """Tolerance of a fused FFN kernel against the reference: g, u and h are each rounded
    to the element type before the down projection, so twice the plain one."""
    return 2 * tolerance(dtype, f)
