"""Public FFN ops: every implementation against an independent dense statement of the
math, gradients against jax.grad of it, composition with jit/vmap/grad, bad inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_twell as jt
from jax_twell.testing import synthetic_ffn_inputs
from specs import CPU_SPECS, assert_close, tolerance

L1 = 0.37  # any non-zero coefficient; checks the L1 gradient is fused correctly


def dense_ffn(x, w_gate, w_up, w_down):
    """The FFN of docs/design.md, section 1 (The job), in plain f32 JAX.

    Returns (y, the per-token-sum L1 averaged over tokens)."""
    x, w_up, w_down = (a.astype(jnp.float32) for a in (x, w_up, w_down))
    if w_gate is None:
        h = jax.nn.relu(x @ w_up)
    else:
        h = jax.nn.relu(x @ w_gate.astype(jnp.float32)) * (x @ w_up)
    return h @ w_down, jnp.abs(h).sum(-1).mean()


def inputs_for(spec, gated, dtype=jnp.float32, seed=0):
    inp = synthetic_ffn_inputs(jax.random.key(seed), spec.m, spec.d, spec.f, density=spec.density, pattern=spec.pattern, dtype=dtype)
    return inp._replace(w_gate=inp.w_gate if gated else None, w_up=inp.w_gate if not gated else inp.w_up)


@pytest.mark.parametrize("impl", ["reference", "xla"])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("spec", CPU_SPECS, ids=str)
def test_sparse_ffn_matches_dense(spec, gated, impl):
    for dtype in (jnp.float32, jnp.bfloat16):
        inp = inputs_for(spec, gated, dtype)
        y = jt.sparse_ffn(*inp, implementation=impl, tile=64, capacity=4)
        assert y.shape == inp.x.shape and y.dtype == dtype
        want, _ = dense_ffn(*inp)
        assert_close(y, want, tolerance(dtype, spec.d + spec.f), f"{impl} {dtype.__name__}")


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize(
    "spec,width,backup",
    [
        (CPU_SPECS[0], 4, None),  # some rows past the ELL width, backup holds all
        (CPU_SPECS[1], 8, 3),  # heavy rows: more overflow than the backup holds -> dense path
        (CPU_SPECS[1], 512, 0),  # every row fits the ELL part
        (CPU_SPECS[2], 2, 64),  # every row overflows (dense activations)
        (CPU_SPECS[3], 16, None),  # a single token
    ],
    ids=str,
)
def test_train_gradients_match_dense(spec, width, backup, gated):
    inp = inputs_for(spec, gated, seed=1)
    cot = jax.random.normal(jax.random.key(2), inp.x.shape)

    def objective(fn, *args):
        y, l1 = fn(*args)
        return (y * cot).sum() + L1 * l1

    def sparse(x, w_gate, w_up, w_down):
        y, aux = jt.sparse_ffn_train(x, w_gate, w_up, w_down, implementation="reference", width=width, backup_capacity=backup)
        return y, aux.l1

    argnums = (0, 1, 2, 3) if gated else (0, 2, 3)
    got = jax.grad(lambda *a: objective(sparse, *a), argnums)(*inp)
    want = jax.grad(lambda *a: objective(dense_ffn, *a), argnums)(*inp)
    n = spec.d + spec.f + spec.m
    for name, g, w in zip(["dx", "dw_gate", "dw_up", "dw_down"] if gated else ["dx", "dw_up", "dw_down"], got, want):
        assert_close(g, w, tolerance(jnp.float32, n, grad=True), name)
    y, aux = jt.sparse_ffn_train(*inp, implementation="reference", width=width, backup_capacity=backup)
    y_want, l1_want = dense_ffn(*inp)
    assert_close(y, y_want, tolerance(jnp.float32, n), "y")
    assert_close(aux.l1, l1_want, tolerance(jnp.float32, n), "l1")


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_train_aux_statistics(impl):
    spec = CPU_SPECS[1]
    inp = inputs_for(spec, True, seed=3)
    _, aux = jt.sparse_ffn_train(*inp, implementation=impl, width=8)
    active = np.asarray(jax.nn.relu(inp.x @ inp.w_gate) > 0)
    counts = active.sum(-1)
    np.testing.assert_allclose(aux.nnz_mean, counts.mean(), rtol=1e-6)
    assert int(aux.nnz_max) == counts.max()
    assert int(aux.rows_over_capacity) == (counts > 8).sum() > 0
    np.testing.assert_array_equal(aux.neuron_fired, active.any(0))


def test_bf16_training_close_to_f32():
    spec = CPU_SPECS[1]
    inp32 = inputs_for(spec, True, seed=4)
    inp16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), inp32)
    grad = lambda inp: jax.grad(lambda x, wu: jt.sparse_ffn_train(x, inp.w_gate, wu, inp.w_down, implementation="reference", width=8)[0].astype(jnp.float32).sum(), (0, 1))(inp.x, inp.w_up)
    for g16, g32 in zip(grad(inp16), grad(inp32)):
        assert g16.dtype == jnp.bfloat16
        assert_close(g16, g32, tolerance(jnp.bfloat16, spec.d + spec.f, grad=True), "bf16 grad")


def test_leading_dims_jit_vmap_grad():
    inp = inputs_for(CPU_SPECS[0], True, seed=5)
    x = jnp.tile(inp.x[None, None], (2, 3, 1, 1))
    want, _ = dense_ffn(*inp)
    for impl in ("reference", "xla"):
        y = jax.jit(lambda x: jt.sparse_ffn(x, *inp[1:], implementation=impl))(x)
        assert y.shape == x.shape
        assert_close(y[1, 2], want, tolerance(jnp.float32, 400), impl)
        yv = jax.vmap(lambda x: jt.sparse_ffn_train(x, *inp[1:], implementation=impl, width=8)[0])(x.reshape(6, *inp.x.shape))
        assert_close(yv[4], want, tolerance(jnp.float32, 400), impl + " vmap")
    # grad of a vmapped, jitted training loss through the custom_vjp
    loss = lambda w_up: jax.vmap(lambda x: jt.sparse_ffn_train(x, inp.w_gate, w_up, inp.w_down, implementation="reference", width=8)[1].l1)(x.reshape(6, *inp.x.shape)).sum()
    g = jax.jit(jax.grad(loss))(inp.w_up)
    g_want = jax.grad(lambda w_up: 6 * dense_ffn(inp.x, inp.w_gate, w_up, inp.w_down)[1])(inp.w_up)
    assert_close(g, g_want, tolerance(jnp.float32, 400, grad=True), "vmapped grad")


def test_twell_ffn_from_packed_activation():
    spec = CPU_SPECS[1]
    for gated in (True, False):
        inp = inputs_for(spec, gated, seed=6)
        w_act = inp.w_gate if gated else inp.w_up
        act = jt.gate_twell(inp.x, w_act, tile=64, capacity=2)  # heavy rows overflow tiles
        assert bool(act.overflowed.any())
        y = jt.twell_ffn(inp.x, act, w_act, inp.w_up if gated else None, inp.w_down)
        assert_close(y, dense_ffn(*inp)[0], tolerance(jnp.float32, spec.d + spec.f), f"gated={gated}")


def test_bad_inputs_name_the_problem():
    inp = inputs_for(CPU_SPECS[0], True)
    x, wg, wu, wd = inp
    cases = [
        ((x[0, 0], wg, wu, wd), ValueError, r"x must have shape \[..., d\]"),
        ((x[:, :5], wg, wu, wd), ValueError, r"w_up must have shape \[d, f\] = \[5, f\]"),
        ((x, wg[:, :7], wu, wd), ValueError, "w_gate must have shape"),
        ((x, wg, wu, wd.T), ValueError, r"w_down must have shape \[f, d\]"),
        ((x.astype(jnp.int32), wg, wu, wd), TypeError, "x must be bf16, f16 or f32"),
        ((x.astype(jnp.bfloat16), wg, wu, wd), TypeError, "share one dtype"),
        ((np.asarray(x).tolist(), wg, wu, wd), TypeError, "x must be an array"),
    ]
    for fn in (jt.sparse_ffn, jt.sparse_ffn_train):
        for args, err, msg in cases:
            with pytest.raises(err, match=msg):
                fn(*args)
    with pytest.raises(ValueError, match="implementation must be one of"):
        jt.sparse_ffn(*inp, implementation="fast")
    with pytest.raises(ValueError, match="width must be a positive int"):
        jt.sparse_ffn_train(*inp, width=0)
    with pytest.raises(ValueError, match=r"w must have shape \[d, f\]"):
        jt.gate_twell(x, wd)
    act = jt.gate_twell(x, wg)
    with pytest.raises(ValueError, match="act holds"):
        jt.twell_ffn(x[:3], act, wg, wu, wd)
    if not jt.kernels_available():
        with pytest.raises(RuntimeError, match="kernels are unavailable"):
            jt.pack_twell(jnp.ones((2, 64)), implementation="cuda")
