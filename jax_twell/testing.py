"""Inputs with controlled activation sparsity, shared by the tests and the benchmarks.

Synthetic sparsity with a real gate matmul (docs/design.md, section 7, Benchmark
protocol): one input feature is set to a per-row constant ``c_row`` and its gate weight row
to -1, so the gate pre-activations are about ``N(0, 1) - c_row`` and each row fires at rate
``1 - Phi(c_row)``. The "skewed"
pattern sets that feature to 1 and its gate weight row to per-neuron thresholds instead,
so each *neuron* fires at its own rate, as in a trained model.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["FFNInputs", "synthetic_ffn_inputs", "with_extreme_rows", "neuron_rates", "PATTERNS", "inference_benchmark_grid"]

PATTERNS = ("uniform", "heavy", "dense", "skewed")
HEAVY_SIGMA = 1.0
HEAVY_CLIP = 0.05
# "skewed": per-neuron firing rates as in a model trained with the L1 penalty. A fraction
# SKEWED_DEAD of the neurons never fires; the others' rates are log-normal (sigma
# SKEWED_SIGMA) around a mean that gives the requested density, clipped to SKEWED_CLIP.
# Fitted to the `tiny` preset trained 1,500 steps at L1 = 3e-3 (first two layers, ~0.6%
# active, 33% and 57% of neurons dead), measured with benchmarks/union_stats.py on 16,384
# held-out tokens in random order: 64-token unions 19-21% of f (this model: ~20%; uniform
# rows at that density: ~33%), 10% of the neurons holding ~60% of the activations (model:
# ~61%). Tokens of one sequence share even more neurons (in order, 15.5-16.4%).
SKEWED_DEAD = 0.45
SKEWED_SIGMA = 1.2
SKEWED_CLIP = 0.5


class FFNInputs(NamedTuple):
    """x ``[M, d]``, w_gate ``[d, f]``, w_up ``[d, f]``, w_down ``[f, d]``."""

    x: jax.Array
    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array


def row_rates(key: jax.Array, m: int, density: float, pattern: str) -> jax.Array:
    """Per-row firing rates ``[m]`` f32 with mean about ``density``.

    "uniform": every row ``density``; "heavy": log-normal (sigma 1) around the mean,
    clipped to 5% (docs/design.md, section 7, Benchmark protocol); "dense": 0.5 (a ReLU
    gate at initialisation).
    """
    if pattern == "uniform":
        return jnp.full((m,), density, jnp.float32)
    if pattern == "heavy":
        z = jax.random.normal(key, (m,))
        return jnp.clip(density * jnp.exp(HEAVY_SIGMA * z - HEAVY_SIGMA**2 / 2), 1e-6, HEAVY_CLIP)
    if pattern == "dense":
        return jnp.full((m,), 0.5, jnp.float32)
    if pattern == "skewed":  # rows alike; the neurons' rates differ (neuron_rates)
        return jnp.full((m,), density, jnp.float32)
    raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")


def neuron_rates(key: jax.Array, f: int, density: float) -> jax.Array:
    """Per-neuron firing rates ``[f]`` f32 of the "skewed" pattern, mean about ``density``:
    zero for a random ``SKEWED_DEAD`` of the neurons, log-normal (``SKEWED_SIGMA``) for the
    rest, clipped to ``SKEWED_CLIP``."""
    kd, kz = jax.random.split(key)
    w = jnp.exp(SKEWED_SIGMA * jax.random.normal(kz, (f,)))
    w = jnp.where(jax.random.uniform(kd, (f,)) < SKEWED_DEAD, 0.0, w)
    return jnp.clip(density * w / jnp.maximum(w.mean(), 1e-30), 0.0, SKEWED_CLIP)


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
    """FFN operands whose ReLU gate fires at about ``density``: rows at the rates of
    :func:`row_rates` ("uniform", "heavy", "dense"), or neurons at the rates of
    :func:`neuron_rates` ("skewed").

    Weights are scaled so pre-activations and outputs are O(1): w_gate, w_up ~ N(0, 1/d),
    w_down ~ N(0, 1/(density * f)).
    """
    if d < 2:
        raise ValueError(f"d must be at least 2 (one feature carries the sparsity control), got {d}")
    kx, kg, ku, kd, kr = jax.random.split(key, 5)
    x = jax.random.normal(kx, (m, d), jnp.float32)
    w_gate = jax.random.normal(kg, (d, f), jnp.float32) / jnp.sqrt(d)
    if pattern == "skewed":  # per-neuron thresholds; a dead neuron's (50) is never crossed
        rates = neuron_rates(kr, f, density)
        threshold = jnp.where(rates > 0, jax.scipy.special.ndtri(1.0 - jnp.maximum(rates, 1e-30)), 50.0)
        x = x.at[:, 0].set(1.0)
        w_gate = w_gate.at[0, :].set(-threshold)
    else:
        x = x.at[:, 0].set(jax.scipy.special.ndtri(1.0 - row_rates(kr, m, density, pattern)))
        w_gate = w_gate.at[0, :].set(-1.0)
    w_up = jax.random.normal(ku, (d, f), jnp.float32) / jnp.sqrt(d)
    w_down = jax.random.normal(kd, (f, d), jnp.float32) / jnp.sqrt(max(density * f, 1.0))
    return FFNInputs(*(a.astype(dtype) for a in (x, w_gate, w_up, w_down)))


def with_extreme_rows(inp: FFNInputs, *, full: int = 0, empty: int = 0) -> FFNInputs:
    """``inp`` with its first ``full`` rows firing on every neuron (every tile past any
    capacity) and the next ``empty`` rows firing on none (uses the sparsity control
    feature of :func:`synthetic_ffn_inputs`; the row patterns only: under "skewed" that
    feature carries the neurons' thresholds)."""
    if (full or empty) and not bool(jnp.all(inp.w_gate[0] == -1)):
        raise ValueError("with_extreme_rows needs inputs of a row pattern (uniform, heavy, dense), not 'skewed'")
    x = inp.x
    if full:
        x = x.at[:full, 0].set(-50.0)
    if empty:
        x = x.at[full : full + empty, 0].set(50.0)
    return inp._replace(x=x)


def inference_benchmark_grid(quick: bool = False) -> list[tuple[int, int, int, float, str]]:
    """The inference benchmark's configurations ``(M, d, f, density, pattern)``
    (docs/design.md, section 7, Benchmark protocol): d=2048, f=5632 at M in {16384, 2048,
    64, 1}, densities 0.5-5%, uniform and heavy-tailed rows, plus (2048, 8192) and
    (4096, 11008) at M=16384 and 0.5%, and the "skewed" pattern (per-neuron rates as in a
    trained model) at M=16384 and 0.5%. ``quick``: M in {16384, 64}, densities 0.5% and 2%,
    and the skewed configuration. The GPU tests check every one against the reference."""
    densities, ms = ([0.005, 0.02], [16384, 64]) if quick else ([0.005, 0.01, 0.02, 0.05], [16384, 2048, 64, 1])
    configs = [(m, 2048, 5632, p, pattern) for m in ms for p in densities for pattern in ("uniform", "heavy")]
    return configs + [(16384, 2048, 5632, 0.005, "skewed"), (16384, 2048, 8192, 0.005, "uniform"),
                      (16384, 4096, 11008, 0.005, "uniform")]
