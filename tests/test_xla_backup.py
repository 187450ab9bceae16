"""The training ops' dense backup written out (``xla.backup_forward``, ``xla.backup_vjp``):
the values and cotangents of the dense formula over the gathered rows, as JAX's autodiff of
``xla.ffn_with_aux`` gives them, with the weights' cotangents added to the ones passed in."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_twell.ops import xla
from specs import assert_close, tolerance


def _case(gated, dtype, s=48, d=64, f=200, m=1000, key=0):
    k = jax.random.split(jax.random.key(key), 8)
    x = jax.random.normal(k[0], (s, d), jnp.float32)
    x = x.at[s - 5:].set(0)  # the bucket's padding rows (past the backed-up rows): zero
    wg = jax.random.normal(k[1], (d, f), jnp.float32) / np.sqrt(d) if gated else None
    wu = jax.random.normal(k[2], (d, f), jnp.float32) / np.sqrt(d)
    wd = jax.random.normal(k[3], (f, d), jnp.float32) / np.sqrt(f)
    dy = jax.random.normal(k[4], (s, d), jnp.float32)
    acc = [None if gated is False and i == 0 else jax.random.normal(k[5 + i], (d, f) if i < 2 else (f, d)) for i in range(3)]
    cast = lambda a: None if a is None else a.astype(dtype)
    return cast(x), cast(wg), cast(wu), cast(wd), cast(dy), [cast(a) for a in acc], m


def _autodiff(x, wg, wu, wd, dy, dl1, m, acc):
    """The old form: autodiff of the dense formula, l1 scaled from the rows' mean to / m."""
    def terms(x, wg, wu, wd):
        y, l1, _, _ = xla.ffn_with_aux(x, wg, wu, wd)
        return y, l1 * (x.shape[0] / m)
    (y, l1), vjp = jax.vjp(terms, x, wg, wu, wd)
    dx, *dw = vjp((dy, dl1))
    dw = [None if a is None else (a.astype(jnp.float32) + b.astype(jnp.float32)) for a, b in zip(acc, dw)]
    return y, l1, dx, dw


@pytest.mark.parametrize("given", ["none", "gate_and_transposed", "kept_hidden"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_backup_matches_autodiff_of_the_dense_formula(gated, dtype, given):
    """``given``: the forward takes the rows' gate (``g=``, as gathered from the call's gate)
    and the backward takes ``dw_gate``, ``dw_up`` as ``[f, d]`` (``transposed=True``, the
    kernels' layout), and with "kept_hidden" also the forward's g and u (``hidden=``) in
    place of recomputing them; the results are the same, in the weights' layout."""
    x, wg, wu, wd, dy, acc, m = _case(gated, dtype)
    dl1 = jnp.float32(3.0)
    transposed = given != "none"
    g = None
    if transposed:
        g = jax.nn.relu(jnp.matmul(x, wg if gated else wu))
        acc = [None if a is None else a.T for a in acc[:2]] + acc[2:]
    y, l1, fired, hidden = jax.jit(lambda *a: xla.backup_forward(*a, m=m, g=g, hidden=True))(x, wg, wu, wd)
    if given != "kept_hidden":
        hidden = None
    elif gated:
        assert hidden[1].shape == hidden[0].shape == (x.shape[0], wu.shape[1])
    dx, *dw = jax.jit(lambda *a: xla.backup_vjp(*a[:6], m=m, grads=a[6:], transposed=transposed, hidden=hidden))(
        x, wg, wu, wd, dy, dl1, *acc)
    if transposed:
        acc = [None if a is None else a.T for a in acc[:2]] + acc[2:]
    y_r, l1_r, dx_r, dw_r = _autodiff(x, wg, wu, wd, dy, dl1, m, acc)
    n = x.shape[1] if wg is None else max(x.shape[1], wd.shape[0])
    tol = tolerance(dtype, n, grad=True)
    assert y.dtype == dtype and dx.dtype == dtype
    assert_close(y, y_r, tolerance(dtype, n), "y")
    np.testing.assert_allclose(l1, l1_r, rtol=1e-5 if dtype == jnp.float32 else 1e-2)
    act = x.astype(jnp.float32) @ (wg if gated else wu).astype(jnp.float32)
    np.testing.assert_array_equal(fired, np.asarray((jnp.maximum(act.astype(dtype), 0) != 0).any(axis=0)))
    assert_close(dx, dx_r, tol, "dx")
    np.testing.assert_array_equal(np.asarray(dx[-5:], np.float32), 0)  # padding rows: no cotangent
    for name, a, r in zip(["dw_gate", "dw_up", "dw_down"], dw, dw_r):
        if r is None:
            assert a is None, name
            continue
        assert a.dtype == dtype, name
        assert_close(a, r, tol, name)


def test_backup_propagates_nan_as_the_dense_formula():
    x, wg, wu, wd, dy, acc, m = _case(True, jnp.float32)
    wd = wd.at[3, 5].set(jnp.nan)  # reaches y[:, 5] through 0 * NaN for every row, as in the dense formula
    y, _, _ = xla.backup_forward(x, wg, wu, wd, m=m)
    y_r, *_ = _autodiff(x, wg, wu, wd, dy, jnp.float32(1.0), m, acc)
    np.testing.assert_array_equal(np.isnan(np.asarray(y)), np.isnan(np.asarray(y_r)))
    assert np.isnan(np.asarray(y)[:, 5]).all()
