"""Inputs with controlled activation sparsity, shared by the tests and the benchmarks.

Synthetic sparsity with a real gate matmul (DESIGN.md §7): one input feature is set to a
per-row constant ``c_row`` and its gate weight row to -1, so the gate pre-activations are
about ``N(0, 1) - c_row`` and each row fires at rate ``1 - Phi(c_row)``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["FFNInputs", "synthetic_ffn_inputs", "with_extreme_rows", "PATTERNS", "inference_benchmark_grid"]

PATTERNS = ("uniform", "heavy", "dense")
HEAVY_SIGMA = 1.0
HEAVY_CLIP = 0.05


class FFNInputs(NamedTuple):
    """x ``[M, d]``, w_gate ``[d, f]``, w_up ``[d, f]``, w_down ``[f, d]``."""

    x: jax.Array
    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array


def row_rates(key: jax.Array, m: int, density: float, pattern: str) -> jax.Array:
    """Per-row firing rates ``[m]`` f32 with mean about ``density``.

    "uniform": every row ``density``; "heavy": log-normal (sigma 1) around the mean,
    clipped to 5% (DESIGN.md §7); "dense": 0.5 (a ReLU gate at initialisation).
    """
    if pattern == "uniform":
        return jnp.full((m,), density, jnp.float32)
    if pattern == "heavy":
        z = jax.random.normal(key, (m,))
        return jnp.clip(density * jnp.exp(HEAVY_SIGMA * z - HEAVY_SIGMA**2 / 2), 1e-6, HEAVY_CLIP)
    if pattern == "dense":
        return jnp.full((m,), 0.5, jnp.float32)
    raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")


def synthetic_ffn_inputs(
    key: jax.Array,
    m: int,
    d: int,
    f: int,
    *,
    density: float = 0.005,
    pattern: str = "uniform",
    dtype=jnp.bfloat16,
) -> FFNInputs:
    """FFN operands whose ReLU gate fires at about ``density`` (see :func:`row_rates`).

    Weights are scaled so pre-activations and outputs are O(1): w_gate, w_up ~ N(0, 1/d),
    w_down ~ N(0, 1/(density * f)).
    """
    if d < 2:
        raise ValueError(f"d must be at least 2 (one feature carries the sparsity control), got {d}")
    kx, kg, ku, kd, kr = jax.random.split(key, 5)
    c = jax.scipy.special.ndtri(1.0 - row_rates(kr, m, density, pattern))
    x = jax.random.normal(kx, (m, d), jnp.float32).at[:, 0].set(c)
    w_gate = (jax.random.normal(kg, (d, f), jnp.float32) / jnp.sqrt(d)).at[0, :].set(-1.0)
    w_up = jax.random.normal(ku, (d, f), jnp.float32) / jnp.sqrt(d)
    w_down = jax.random.normal(kd, (f, d), jnp.float32) / jnp.sqrt(max(density * f, 1.0))
    return FFNInputs(*(a.astype(dtype) for a in (x, w_gate, w_up, w_down)))


def with_extreme_rows(inp: FFNInputs, *, full: int = 0, empty: int = 0) -> FFNInputs:
    """``inp`` with its first ``full`` rows firing on every neuron (every tile past any
    capacity) and the next ``empty`` rows firing on none (uses the sparsity control
    feature of :func:`synthetic_ffn_inputs`)."""
    x = inp.x
    if full:
        x = x.at[:full, 0].set(-50.0)
    if empty:
        x = x.at[full : full + empty, 0].set(50.0)
    return inp._replace(x=x)


def inference_benchmark_grid(quick: bool = False) -> list[tuple[int, int, int, float, str]]:
    """The inference benchmark's configurations ``(M, d, f, density, pattern)`` (DESIGN.md
    §7): d=2048, f=5632 at M in {16384, 2048, 64, 1}, densities 0.5-5%, uniform and
    heavy-tailed rows, plus (2048, 8192) and (4096, 11008) at M=16384 and 0.5%. ``quick``:
    M in {16384, 64}, densities 0.5% and 2%. The GPU tests check every one against the
    reference."""
    densities, ms = ([0.005, 0.02], [16384, 64]) if quick else ([0.005, 0.01, 0.02, 0.05], [16384, 2048, 64, 1])
    configs = [(m, 2048, 5632, p, pattern) for m in ms for p in densities for pattern in ("uniform", "heavy")]
    return configs + [(16384, 2048, 8192, 0.005, "uniform"), (16384, 4096, 11008, 0.005, "uniform")]
