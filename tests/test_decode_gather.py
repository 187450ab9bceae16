"""The decode path that reads only the weights of active neurons (jax_twell.ops.xla.
gather_ffn; pure XLA, so it runs here): exact against the dense FFN, reads nothing of
neurons that never fire, falls back to dense past its width, and the dispatch's switch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_twell.testing import synthetic_ffn_inputs, with_extreme_rows
from specs import assert_close, fused_tolerance
from jax_twell.ops.costs import DenseCrossover
from jax_twell.ops import xla
from cuda_calls import cuda_ffn
from jax_twell.ops.plan import Side

POISON = 1.0e4  # finite, so a zero h times it is exactly zero; any use of it shows


def inputs(m, d=256, f=1024, density=0.005, key=0, **extreme):
    return with_extreme_rows(synthetic_ffn_inputs(jax.random.key(key), m, d, f, density=density), **extreme)


def poison_silent_neurons(inp, gated):
    """Weights of neurons that fire for no token set to POISON (gate weight untouched)."""
    w_act = inp.w_gate if gated else inp.w_up
    fired = np.asarray((jax.nn.relu(jnp.matmul(inp.x, w_act)) != 0).any(axis=0))
    silent = jnp.asarray(~fired)
    w_up = inp.w_up if not gated else jnp.where(silent[None, :], jnp.bfloat16(POISON), inp.w_up)
    w_down = jnp.where(silent[:, None], jnp.bfloat16(POISON), inp.w_down)
    return w_up, w_down, int(fired.sum())


@pytest.mark.parametrize("m", [1, 7, 64])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("transposed", [False, True])
def test_matches_dense_and_reads_only_active_neurons(m, gated, transposed):
    inp = inputs(m, key=m, empty=min(m, 2) - 1)
    if not gated:  # the activation is relu(x @ w_up): give it the sparse gate's pattern
        inp = inp._replace(w_up=inp.w_gate)
    w_gate = inp.w_gate if gated else None
    want = xla.ffn(inp.x, w_gate, inp.w_up, inp.w_down)
    w_up, w_down, n_fired = poison_silent_neurons(inp, gated)
    width = xla.gather_width(m, 1024)
    assert 0 < n_fired <= width < 1024  # the gathered branch runs, and some neurons are silent
    w_up_t = w_up.T if transposed else None
    got = jax.jit(lambda x, wg, wu, wd, wut: xla.gather_ffn(x, wg, wu, wd, width=width, w_up_t=wut))(
        inp.x, w_gate, w_up, w_down, w_up_t
    )
    assert got.shape == want.shape and got.dtype == want.dtype
    assert_close(got, want, fused_tolerance(jnp.bfloat16, 1024), f"m={m} gated={gated} transposed={transposed}")


def test_past_its_width_runs_dense_exactly():
    inp = inputs(16, density=0.2, key=3, full=1)  # one row fires on every neuron
    n_fired = int((jax.nn.relu(inp.x @ inp.w_gate) != 0).any(axis=0).sum())
    assert n_fired > 128
    got = jax.jit(lambda *a: xla.gather_ffn(*a, width=128))(*inp)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(xla.ffn(*inp), np.float32))


def test_no_active_neuron_gives_zeros():
    inp = inputs(4, key=4, empty=4)
    got = jax.jit(lambda *a: xla.gather_ffn(*a, width=128))(*inp)
    assert not np.asarray(got, np.float32).any()


def test_gather_width():
    assert xla.gather_width(1, 5632) == 128
    assert xla.gather_width(64, 5632) == 3712  # 1% of f per token, rounded up to 128
    assert xla.gather_width(1000, 5632) == 5632
    assert xla.gather_width(1, 100) == 100


def test_dispatch_switch():
    inp = inputs(8, key=5)
    want = xla.ffn(*inp)

    def prims(rule, side=Side.AUTO):
        jaxpr = jax.make_jaxpr(lambda x: cuda_ffn(x, *inp[1:], tile=256, capacity=32, rule=rule, side=side))(inp.x)
        return {e.primitive.name for e in jaxpr.jaxpr.eqns}

    on = DenseCrossover(decode_gather_max_tokens=64)
    assert "cond" in prims(on)  # gather_ffn's device-side fallback
    assert "cond" not in prims(DenseCrossover())  # off by default: dense at decode sizes
    assert "cond" not in prims(on, Side.DENSE)  # forced dense
    got = jax.jit(lambda x: cuda_ffn(x, *inp[1:], tile=256, capacity=32, rule=on))(inp.x)
    assert_close(got, want, fused_tolerance(jnp.bfloat16, 1024), "dispatch")
