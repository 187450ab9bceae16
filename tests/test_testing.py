"""The synthetic activation patterns the tests and benchmarks share (jax_twell.testing)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_twell.testing import (
    SKEWED_DEAD,
    neuron_rates,
    synthetic_ffn_inputs,
    with_extreme_rows,
)


def _mask(inp):
    g = jnp.einsum("md,df->mf", inp.x.astype(jnp.float32), inp.w_gate.astype(jnp.float32))
    return np.asarray(g > 0)


def _union(mask, block):
    n = mask.shape[0] // block
    return mask[: n * block].reshape(n, block, -1).any(axis=1).mean()


@pytest.mark.slow
@pytest.mark.parametrize("density", [0.005, 0.02])
def test_skewed_pattern_is_per_neuron(density):
    """"skewed": the requested density over all pairs, rows alike, the neurons' rates
    spread (a dead share that never fires), and 64-token unions well below the uniform
    pattern's at the same density: what the union kernels gain on trained models."""
    m, d, f = 4096, 64, 4000
    skewed = _mask(synthetic_ffn_inputs(jax.random.key(1), m, d, f, density=density, pattern="skewed",
                                        dtype=jnp.float32))
    uniform = _mask(synthetic_ffn_inputs(jax.random.key(1), m, d, f, density=density, pattern="uniform",
                                         dtype=jnp.float32))
    assert skewed.mean() == pytest.approx(density, rel=0.15)
    assert uniform.mean() == pytest.approx(density, rel=0.15)
    per_neuron = skewed.mean(axis=0)
    assert (per_neuron == 0).mean() >= SKEWED_DEAD - 0.03  # dead, plus a few rare ones unseen
    top = np.sort(per_neuron)[::-1][: f // 10].sum() / per_neuron.sum()
    assert top > 0.5  # 10% of the neurons hold most of the activations (uniform: ~10%)
    per_row = skewed.mean(axis=1)  # rows differ only by chance
    assert per_row.std() < 3 * np.sqrt(density / f) + 1e-3
    assert _union(skewed, 64) < 0.75 * _union(uniform, 64)


def test_neuron_rates_mean_and_clip():
    rates = np.asarray(neuron_rates(jax.random.key(0), 100_000, 0.01))
    assert rates.mean() == pytest.approx(0.01, rel=0.05)
    assert rates.min() == 0.0 and rates.max() <= 0.5
    assert (rates == 0).mean() == pytest.approx(SKEWED_DEAD, abs=0.01)


@pytest.mark.slow
def test_extreme_rows_refuse_the_skewed_pattern():
    inp = synthetic_ffn_inputs(jax.random.key(2), 64, 16, 100, density=0.05, pattern="skewed")
    with pytest.raises(ValueError, match="row pattern"):
        with_extreme_rows(inp, full=1)
    row = synthetic_ffn_inputs(jax.random.key(2), 64, 16, 100, density=0.05, pattern="heavy", dtype=jnp.float32)
    mask = _mask(with_extreme_rows(row, full=1, empty=1))
    assert mask[0].all() and not mask[1].any()
