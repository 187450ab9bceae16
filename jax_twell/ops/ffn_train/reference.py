"""Pure-JAX reference of the training op on the hybrid format.

It defines the semantics the CUDA training kernels are tested against and runs on any
backend: a forward from the hybrid-packed gate and a custom_vjp backward that visits
only the stored entries and the dense-backup rows. Written for clarity, not speed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_twell.formats import Hybrid, pack_hybrid_reference, relu_matmul
from jax_twell.ops import xla
from jax_twell.ops.common import all_finite, sum_over_shards

__all__ = ["ffn_with_aux"]


def _ell_valid(act: Hybrid) -> jax.Array:
    fits = ~act.rows_over_width
    return (jnp.arange(act.width) < act.counts[:, None]) & fits[:, None]


def _sparse_forward(x, w_gate, w_up, w_down, act: Hybrid):
    """Forward from the hybrid gate: returns (y, l1, u_ell, u_backup)."""
    dt = x.dtype
    valid = _ell_valid(act)
    backup_x = x.at[act.backup_rows].get(mode="fill", fill_value=0)
    if w_gate is not None:
        # u only where the gate fired: one dot product per stored entry.
        u_ell = jnp.einsum("md,mkd->mk", x, w_up.T[act.cols], preferred_element_type=jnp.float32).astype(dt)
        u_ell = jnp.where(valid, u_ell, jnp.zeros((), dt))
        u_backup = jnp.matmul(backup_x, w_up, preferred_element_type=jnp.float32).astype(dt)
        h_ell, h_backup = act.values * u_ell, act.backup_values * u_backup
    else:
        u_ell = u_backup = None
        h_ell, h_backup = act.values, act.backup_values
    h_ell = jnp.where(valid, h_ell, jnp.zeros((), dt))
    y = jnp.einsum("mk,mkd->md", h_ell, w_down[act.cols], preferred_element_type=jnp.float32)
    y_backup = jnp.matmul(h_backup, w_down, preferred_element_type=jnp.float32)
    y = y.at[act.backup_rows].set(y_backup, mode="drop").astype(dt)
    m = max(x.shape[0], 1)
    l1 = (jnp.abs(h_ell.astype(jnp.float32)).sum() + jnp.abs(h_backup.astype(jnp.float32)).sum()) / m
    return y, l1, u_ell, u_backup


def _sparse_backward(x, w_gate, w_up, w_down, act: Hybrid, u_ell, u_backup, dy, dl1):
    """Gradients visiting only stored entries (ELL) and backup rows (dense rows)."""
    dt = x.dtype
    f32 = jnp.float32
    m = max(x.shape[0], 1)
    valid = _ell_valid(act)
    gated = w_gate is not None
    w_act = w_gate if gated else w_up
    cols = act.cols
    # ELL entries: dh = dy . w_down[j] + dl1/M * sign(h), only at active positions.
    h_ell = jnp.where(valid, act.values * u_ell if gated else act.values, jnp.zeros((), dt))
    dh = jnp.einsum("md,mkd->mk", dy.astype(f32), w_down[cols].astype(f32))
    dh = dh + (dl1 / m) * jnp.sign(h_ell.astype(f32))
    dh = jnp.where(valid, dh, 0.0)
    dw_down = jnp.zeros(w_down.shape, f32).at[cols].add(h_ell.astype(f32)[..., None] * dy.astype(f32)[:, None, :])
    d_pre = dh * u_ell.astype(f32) if gated else dh  # through relu: active positions only
    dw_act_t = jnp.zeros(w_down.shape, f32).at[cols].add(d_pre[..., None] * x.astype(f32)[:, None, :])
    dx = jnp.einsum("mk,mkd->md", d_pre, w_act.T[cols].astype(f32))
    if gated:
        du = dh * act.values.astype(f32)
        dw_up_t = jnp.zeros(w_down.shape, f32).at[cols].add(du[..., None] * x.astype(f32)[:, None, :])
        dx = dx + jnp.einsum("mk,mkd->md", du, w_up.T[cols].astype(f32))
    # Backup rows: dense rows, restricted to rows the backup holds.
    rows = act.backup_rows
    used = (rows < x.shape[0])[:, None]
    xb = x.at[rows].get(mode="fill", fill_value=0).astype(f32)
    dyb = jnp.where(used, dy.at[rows].get(mode="fill", fill_value=0).astype(f32), 0.0)
    gb = act.backup_values.astype(f32)
    hb = gb * u_backup.astype(f32) if gated else gb
    dhb = dyb @ w_down.T.astype(f32) + (dl1 / m) * jnp.sign(hb)
    dhb = jnp.where((gb > 0) & used, dhb, 0.0)
    dw_down = dw_down + hb.T @ dyb
    d_preb = dhb * u_backup.astype(f32) if gated else dhb
    dw_act_t = dw_act_t + (xb.T @ d_preb).T
    dxb = d_preb @ w_act.T.astype(f32)
    if gated:
        dub = dhb * gb
        dw_up_t = dw_up_t + (xb.T @ dub).T
        dxb = dxb + dub @ w_up.T.astype(f32)
    dx = dx.at[rows].add(dxb, mode="drop")
    grads_w = dict(w_down=dw_down.astype(w_down.dtype))
    if gated:
        grads_w.update(w_gate=dw_act_t.T.astype(w_gate.dtype), w_up=dw_up_t.T.astype(w_up.dtype))
    else:
        grads_w.update(w_gate=None, w_up=dw_act_t.T.astype(w_up.dtype))
    return dx.astype(dt), grads_w["w_gate"], grads_w["w_up"], grads_w["w_down"]


def _fired(act: Hybrid) -> jax.Array:
    fired = jnp.zeros((act.f,), bool).at[act.cols].max(_ell_valid(act))
    return fired | (act.backup_values != 0).any(axis=0)


def _placeholder(like: jax.Array) -> jax.Array:
    return jnp.where(jnp.zeros(like.shape, bool), like, jnp.zeros((), like.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _train_ffn(x, w_gate, w_up, w_down, width, backup_capacity):
    out, _ = _train_fwd(x, w_gate, w_up, w_down, width, backup_capacity)
    return out


def _train_fwd(x, w_gate, w_up, w_down, width, backup_capacity):
    w_act = w_gate if w_gate is not None else w_up
    act = pack_hybrid_reference(relu_matmul(x, w_act), width=width, backup_capacity=backup_capacity)

    def sparse(_):
        y, l1, u_ell, u_backup = _sparse_forward(x, w_gate, w_up, w_down, act)
        return y, l1, u_ell, u_backup

    def dense(_):
        # More rows overflow than the backup holds: the dense path is exact and faster.
        y, l1, _, _ = xla.ffn_with_aux(x, w_gate, w_up, w_down)
        if w_gate is None:
            return y, l1, None, None
        # Placeholders shaped (and, under shard_map, device-varying) like the sparse
        # branch's u; the dense backward does not read them.
        return y, l1, _placeholder(act.values), _placeholder(act.backup_values)

    # The sparse side skips inactive neurons' products, through which the dense formula
    # carries a NaN or Inf of x, w_up or w_down to y: non-finite operands run dense.
    use = act.complete & all_finite(x, w_gate, w_up, w_down)
    y, l1, u_ell, u_backup = jax.lax.cond(use, sparse, dense, None)
    return (y, l1, act.counts, _fired(act)), (x, w_gate, w_up, w_down, act, use, u_ell, u_backup)


def _train_bwd(width, backup_capacity, res, cotangents):
    x, w_gate, w_up, w_down, act, use, u_ell, u_backup = res
    dy, dl1, _, _ = cotangents
    dl1 = dl1.astype(jnp.float32)
    use = use & all_finite(dy, dl1)

    def sparse(_):
        grads = _sparse_backward(x, w_gate, w_up, w_down, act, u_ell, u_backup, dy, dl1)
        return tuple(sum_over_shards(g, p) for g, p in zip(grads, (x, w_gate, w_up, w_down)))

    def dense(_):
        return xla.ffn_with_aux_vjp(x, w_gate, w_up, w_down, dy, dl1)

    return jax.lax.cond(use, sparse, dense, None)


_train_ffn.defvjp(_train_fwd, _train_bwd)


def ffn_with_aux(x, w_gate, w_up, w_down, *, width: int, backup_capacity: int | None):
    """Training FFN on the hybrid format with a sparse backward. x: ``[M, d]``.

    Returns ``(y [M, d], l1 [], counts [M] int32, fired [f] bool)`` like
    :func:`jax_twell.ops.xla.ffn_with_aux`; differentiable in x and the weights
    (custom_vjp), with gradients equal to those of the dense formula.
    """
    b = x.shape[0] if backup_capacity is None else backup_capacity
    return _train_ffn(x, w_gate, w_up, w_down, width, b)
