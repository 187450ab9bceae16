"""SparseFFN / DenseFFN (NNX), the Linen SparseFFN and the telemetry helpers."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from specs import assert_close, tolerance

from jax_twell import linen
from jax_twell.modules import DenseFFN, FFNStats, SparseFFN, stack_stats, summarize_stats

D, F = 16, 48
IMPLEMENTATIONS = ["xla", "reference"]
TOL = tolerance(jnp.float32, F)
GRAD_TOL = tolerance(jnp.float32, F, grad=True)


def dense_formula(x, w_gate, w_up, w_down, act):
    """(y, h) in float64 numpy: the FFN every module must compute."""
    x, w_up, w_down = (np.asarray(a, np.float64) for a in (x, w_up, w_down))
    if w_gate is None:
        h = act(x @ w_up)
    else:
        h = act(x @ np.asarray(w_gate, np.float64)) * (x @ w_up)
    return h @ w_down, h


def relu(a):
    return np.maximum(a, 0.0)


def silu(a):
    return a / (1.0 + np.exp(-a))


def weights(module):
    w_gate = None if module.w_gate is None else module.w_gate[...]
    return w_gate, module.w_up[...], module.w_down[...]


def inputs(shape=(2, 5, D), seed=1, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def check_aux(aux, h, width):
    h = np.asarray(h).reshape(-1, h.shape[-1])
    counts = (h != 0).sum(-1)
    np.testing.assert_allclose(aux.l1, np.abs(h).sum(-1).mean(), rtol=1e-5)
    np.testing.assert_allclose(aux.nnz_mean, counts.mean(), rtol=1e-6)
    assert int(aux.nnz_max) == counts.max()
    assert int(aux.rows_over_capacity) == (counts > width).sum()
    np.testing.assert_array_equal(aux.neuron_fired, (h != 0).any(0))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("gated", [True, False])
def test_sparse_ffn_matches_dense_formula(gated, implementation):
    width = 20  # below the typical count (~F/2 active), so some rows are past capacity
    ffn = SparseFFN(D, F, gated=gated, implementation=implementation, width=width, rngs=nnx.Rngs(0))
    assert (ffn.w_gate is None) == (not gated)
    x = inputs()
    want_y, h = dense_formula(x, *weights(ffn), relu)

    y, aux = ffn.forward_with_stats(x)
    assert y.shape == x.shape and y.dtype == jnp.float32
    assert_close(y, want_y, TOL)
    check_aux(aux, h, width)
    assert 0 < int(aux.rows_over_capacity) < 10

    assert_close(ffn.infer(x), want_y, TOL)


@pytest.mark.parametrize("gated", [True, False])
def test_decode_caches_hold_the_transposed_weights(gated):
    """cache_transposed_up_weight keeps w_up.T (gated only); cache_transposed_activation_weight
    keeps the activation's weight transposed (w_gate.T gated, w_up.T non-gated); infer
    still computes the FFN with them; clear_inference_cache drops both."""
    ffn = SparseFFN(D, F, gated=gated, implementation="xla", rngs=nnx.Rngs(2))
    ffn.cache_transposed_up_weight(jnp.float32)
    ffn.cache_transposed_activation_weight(jnp.float32)
    assert (ffn.w_up_t is None) == (not gated)
    if gated:
        np.testing.assert_array_equal(ffn.w_up_t[...], ffn.w_up[...].T)
    np.testing.assert_array_equal(ffn.w_act_t[...], (ffn.w_gate if gated else ffn.w_up)[...].T)
    x = inputs()
    want_y, _ = dense_formula(x, *weights(ffn), relu)
    assert_close(ffn.infer(x), want_y, TOL)
    ffn.clear_inference_cache()
    assert ffn.w_up_t is None and ffn.w_act_t is None


def test_call_sows_stats():
    ffn = SparseFFN(D, F, rngs=nnx.Rngs(0))
    x = inputs()
    y, intermediates = nnx.capture(ffn, nnx.Intermediate)(x)
    np.testing.assert_allclose(y, ffn.forward_with_stats(x)[0], rtol=1e-6)
    (aux,) = intermediates["ffn_stats"].get_value()
    check_aux(aux, dense_formula(x, *weights(ffn), relu)[1], ffn.width)


def test_call_outside_a_capture_records_nothing():
    """A plain call (a drop-in MLP in someone's model) leaves the module's state as it was,
    with no deprecation warning, and gives the training forward's output."""
    import warnings

    ffn = SparseFFN(D, F, rngs=nnx.Rngs(0))
    x = inputs()
    before = jax.tree_util.tree_structure(nnx.state(ffn))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a DeprecationWarning from sow would raise here
        y = ffn(x)
    np.testing.assert_allclose(y, ffn.forward_with_stats(x)[0], rtol=1e-6)
    assert jax.tree_util.tree_structure(nnx.state(ffn)) == before
    assert not nnx.state(ffn, nnx.Intermediate)
    # and a capture afterwards still records exactly one call's statistics
    _, intermediates = nnx.capture(ffn, nnx.Intermediate)(x)
    assert len(intermediates["ffn_stats"].get_value()) == 1


@pytest.mark.parametrize("activation", ["silu", "relu"])
@pytest.mark.parametrize("gated", [True, False])
def test_dense_ffn_matches_formula(gated, activation):
    ffn = DenseFFN(D, F, gated=gated, activation=activation, width=20, rngs=nnx.Rngs(0))
    x = inputs()
    want_y, h = dense_formula(x, *weights(ffn), relu if activation == "relu" else silu)
    y, aux = ffn.forward_with_stats(x)
    assert_close(y, want_y, TOL)
    assert_close(ffn.infer(x), want_y, TOL)
    check_aux(aux, h, 20)
    if activation == "silu":
        assert float(aux.nnz_mean) == F  # SiLU is (almost) never exactly zero


def test_dense_relu_equals_sparse():
    sparse = SparseFFN(D, F, rngs=nnx.Rngs(3))
    dense = DenseFFN(D, F, activation="relu", rngs=nnx.Rngs(3))
    x = inputs()
    y_s, aux_s = sparse.forward_with_stats(x)
    y_d, aux_d = dense.forward_with_stats(x)
    np.testing.assert_allclose(y_s, y_d, rtol=1e-6)
    for a, b in zip(aux_s, aux_d):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_bfloat16_input():
    ffn = SparseFFN(D, F, rngs=nnx.Rngs(0))
    x = inputs(dtype=jnp.bfloat16)
    y, aux = ffn.forward_with_stats(x)
    assert y.dtype == jnp.bfloat16 and aux.l1.dtype == jnp.float32
    want_y, _ = dense_formula(x.astype(jnp.float32), *weights(ffn), relu)
    assert_close(y, want_y, tolerance(jnp.bfloat16, F))


@pytest.mark.parametrize("gated", [True, False])
def test_grads_match_dense_formula(gated):
    """Gradients of (output + L1 term) through the module's custom_vjp equal jax.grad of the formula."""
    coef = 0.1
    ffn = SparseFFN(D, F, gated=gated, implementation="reference", rngs=nnx.Rngs(0))
    x = inputs()
    cot = inputs(seed=2)

    def module_loss(ffn, x):
        y, aux = ffn.forward_with_stats(x)
        return jnp.sum(y * cot) + coef * aux.l1

    def formula_loss(w, x):
        g = x @ (w["w_up"] if w["w_gate"] is None else w["w_gate"])
        h = jax.nn.relu(g) if w["w_gate"] is None else jax.nn.relu(g) * (x @ w["w_up"])
        return jnp.sum((h @ w["w_down"]) * cot) + coef * jnp.abs(h).sum(-1).mean()

    grads, dx = nnx.grad(module_loss, argnums=(0, 1))(ffn, x)
    w = dict(zip(("w_gate", "w_up", "w_down"), weights(ffn)))
    want_w, want_dx = jax.grad(formula_loss, argnums=(0, 1))(w, x)
    assert_close(dx, want_dx, GRAD_TOL)
    for name in ("w_gate", "w_up", "w_down") if gated else ("w_up", "w_down"):
        assert_close(grads[name][...], want_w[name], GRAD_TOL)


def test_jit():
    ffn = SparseFFN(D, F, rngs=nnx.Rngs(0))
    x = inputs()
    y, aux = nnx.jit(lambda m, x: m.forward_with_stats(x))(ffn, x)
    np.testing.assert_allclose(y, ffn.forward_with_stats(x)[0], rtol=1e-6)
    assert aux.neuron_fired.shape == (F,)


def test_parameter_layout_and_init():
    d, f = 256, 512
    ffn = SparseFFN(d, f, rngs=nnx.Rngs(0))
    specs = nnx.get_partition_spec(nnx.state(ffn, nnx.Param))
    assert specs["w_gate"].get_value() == jax.sharding.PartitionSpec("embed", "mlp")
    assert specs["w_up"].get_value() == jax.sharding.PartitionSpec("embed", "mlp")
    assert specs["w_down"].get_value() == jax.sharding.PartitionSpec("mlp", "embed")
    assert ffn.w_up.shape == (d, f) and ffn.w_down.shape == (f, d) and ffn.w_up.dtype == jnp.float32
    np.testing.assert_allclose(np.std(ffn.w_up[...]), d**-0.5, rtol=0.03)
    np.testing.assert_allclose(np.std(ffn.w_down[...]), f**-0.5, rtol=0.03)
    assert np.abs(ffn.w_gate[...]).max() <= 2 * d**-0.5 / 0.8796 + 1e-6  # truncated at 2 std


def test_dense_ffn_rejects_unknown_activation():
    with pytest.raises(ValueError, match="activation must be 'silu' or 'relu'"):
        DenseFFN(D, F, activation="gelu", rngs=nnx.Rngs(0))


def test_summarize_stats():
    fired = np.zeros((2, 4), bool)
    fired[0, :3] = True
    fired[1, :] = True
    stats = FFNStats(
        l1=jnp.array([1.0, 3.0]),
        nnz_mean=jnp.array([1.0, 2.0]),
        nnz_max=jnp.array([5, 7], jnp.int32),
        rows_over_capacity=jnp.array([0, 2], jnp.int32),
        neuron_fired=jnp.asarray(fired),
    )
    s = summarize_stats(stats)
    assert all(isinstance(v, float) for v in s.values())
    assert s["l1"] == 2.0 and s["nnz_mean"] == 1.5 and s["nnz_max"] == 7.0
    assert s["active_fraction"] == 1.5 / 4 and s["rows_over_capacity"] == 2.0
    assert s["dead_fraction"] == 0.125 and s["layer0/dead_fraction"] == 0.25 and s["layer1/dead_fraction"] == 0.0
    assert s["layer1/nnz_max"] == 7.0 and s["layer1/rows_over_capacity"] == 2.0


def test_stack_stats_and_single_layer_summary():
    ffn = SparseFFN(D, F, rngs=nnx.Rngs(0))
    _, aux = ffn.forward_with_stats(inputs())
    stats = stack_stats([aux, aux, aux])
    assert stats.l1.shape == (3,) and stats.nnz_max.dtype == jnp.int32 and stats.neuron_fired.shape == (3, F)
    one = summarize_stats(aux)
    assert one["nnz_mean"] == summarize_stats(stats)["nnz_mean"] and "layer0/nnz_mean" in one


@pytest.mark.parametrize("gated", [True, False])
def test_linen_matches_nnx(gated):
    x = inputs()
    module = linen.SparseFFN(d_ff=F, gated=gated, width=20)
    variables = module.init(jax.random.key(0), x)
    boxed = variables["params"]
    assert boxed["w_up"].names == ("embed", "mlp") and boxed["w_down"].names == ("mlp", "embed")
    assert ("w_gate" in boxed) == gated
    params = nn.meta.unbox(boxed)

    y, state = module.apply({"params": params}, x, mutable=["intermediates"])
    (aux,) = state["intermediates"]["ffn_stats"]
    w_gate = params["w_gate"] if gated else None
    want_y, h = dense_formula(x, w_gate, params["w_up"], params["w_down"], relu)
    assert_close(y, want_y, TOL)
    check_aux(aux, h, 20)
    y_infer = module.apply({"params": params}, x, inference=True)
    assert_close(y_infer, want_y, TOL)


def test_sparse_ffn_passes_its_layer_fractions(monkeypatch):
    """``infer`` hands the layer's ``active_fraction`` and ``union_fraction`` to the op's
    internal entry point as a ``LayerInfo`` (the trace-time choices of the CUDA
    implementation read it)."""
    import jax_twell.modules as modules

    seen = {}
    real = modules.sparse_ffn_for_layer

    def spy(*args, **kwargs):
        seen.update(kwargs["layer"].__dict__)
        return real(*args, **kwargs)

    monkeypatch.setattr(modules, "sparse_ffn_for_layer", spy)
    layer = SparseFFN(16, 48, implementation="xla", active_fraction=0.01, union_fraction=0.2, rngs=nnx.Rngs(0))
    y = layer.infer(jnp.ones((4, 16), jnp.float32))
    assert y.shape == (4, 16)
    assert seen["active_fraction"] == 0.01 and seen["union_fraction"] == 0.2
    layer.union_fraction = None
    layer.infer(jnp.ones((4, 16), jnp.float32))
    assert seen["union_fraction"] is None

    # The training forward too (the training rule prices the union products by it), and
    # only with the active fraction it belongs to.
    seen.clear()
    real_train = modules.sparse_ffn_train_for_layer

    def train_spy(*args, **kwargs):
        seen.update(kwargs["layer"].__dict__)
        return real_train(*args, **kwargs)

    monkeypatch.setattr(modules, "sparse_ffn_train_for_layer", train_spy)
    layer.union_fraction = 0.2
    layer(jnp.ones((4, 16), jnp.float32))
    assert seen["active_fraction"] == 0.01 and seen["union_fraction"] == 0.2
    layer.active_fraction = None
    layer(jnp.ones((4, 16), jnp.float32))
    assert seen["active_fraction"] is None and seen["union_fraction"] is None
