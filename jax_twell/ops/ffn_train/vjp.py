"""The CUDA implementation of the training FFN: a custom_vjp that runs a training plan.

Forward: the gate as TwELL, then (where the plan leaves it to the device, by the rule;
always, by the entry budget) the sparse forward kernel keeping sparse residuals, or the
dense formula. Backward: the sparse backward kernel on those residuals, or XLA's autodiff
of the dense formula (recomputing g and u: nothing ``[M, f]`` was kept). On the sparse
side the rows past the hybrid width are the dense backup's: the kernels see them empty,
and XLA computes them, forward and backward, over their gathered rows, at the smallest of
a few static sizes that holds them (``layout.train_backup_buckets``); their gate rows come
from the call's g, and their g and u are kept for the backward up to
``layout.train_backup_kept_rows``. The
device steps are the bindings of :mod:`jax_twell.ops.ffn_train.binding`, or the stand-ins
a test passes as ``kernels`` (tests/test_train_emulation.py stands the NumPy model in).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from jax_twell.formats import relu_matmul
from jax_twell.ops import layout, xla
from jax_twell.ops.common import all_finite, as_varying, mesh_axes, sum_over_shards
from jax_twell.ops.ffn import binding as ffn_binding
from jax_twell.ops.ffn_train import binding
from jax_twell.ops.pack import binding as pack_binding
from jax_twell.ops.plan import LayerInfo, TrainOptions, TrainPlan, plan_ffn_train

__all__ = ["TrainKernels", "BINDINGS", "ffn_with_aux", "run", "h_l1", "fired_from_columns"]


@dataclasses.dataclass(frozen=True)
class TrainKernels:
    """The device steps a training plan runs, by name (the bindings by default).

    pack(g, *, tile, capacity) -> TwELL; gate_pack(x, w, *, tile, capacity) -> TwELL;
    forward(x, act, w_act, w_up, w_down, *, max_entries, tensor_cores, down_union, up_union,
    down_stationary) -> (y, Residuals, h_source); backward(x, dy, w_gate, w_up, w_down, res,
    l1_grad, *, tile, tensor_cores, dx_tensor_cores, dx_union, dh_union, dx_stationary,
    transposed) -> (dx, dw_gate, dw_up, dw_down), ``transposed``: dw_gate and dw_up ``[f, d]``.
    """

    pack: Callable = pack_binding.pack_twell
    gate_pack: Callable = ffn_binding.gate_pack
    forward: Callable = binding.train_forward
    backward: Callable = binding.train_backward


BINDINGS = TrainKernels()


def h_l1(h_source: jax.Array, total: jax.Array, dtype, m: int) -> jax.Array:
    """``sum |h| / M`` over the first ``total`` words (h in the high half) of ``h_source``."""
    h = jax.lax.bitcast_convert_type((h_source >> 16).astype(jnp.uint16), dtype).astype(jnp.float32)
    valid = jnp.arange(h_source.shape[0]) < total
    return jnp.where(valid, jnp.abs(h), 0.0).sum() / max(m, 1)


def fired_from_columns(col_off: jax.Array, f: int) -> jax.Array:
    """``[f]`` bool: neurons with an entry (g != 0) in any block."""
    nonempty = (jnp.diff(col_off, axis=-1) > 0).any(axis=0)  # [n_tiles, tile]
    return nonempty.reshape(-1)[:f]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _train_ffn(x, w_gate, w_up, w_down, plan, kernels):
    out, _ = _train_fwd(x, w_gate, w_up, w_down, plan, kernels)
    return out


def _without_rows(act, idx):
    """``act`` with the rows ``idx`` (``m`` where none: dropped) emptied: no entry, no
    overflowed tile (the kernels leave those rows to the backup)."""
    drop = dict(mode="drop")
    return dataclasses.replace(act, values=act.values.at[idx].set(0, **drop), cols=act.cols.at[idx].set(0, **drop),
                               counts=act.counts.at[idx].set(0, **drop))


def _backup_rows(act, plan: TrainPlan, m: int):
    """The rows past the hybrid width (their entries, overflowed tiles at full width, over
    ``plan.width``): ``(buckets, idx [largest bucket] int32 (m past the last row), n_rows,
    branch, kept_entries)``, ``branch`` the smallest bucket that holds them (the last where
    none does), ``kept_entries`` what the kernels need for the other rows (all of them are
    emptied wherever ``n_rows`` fits the largest bucket, the only case the kernels run)."""
    buckets = layout.train_backup_buckets(m, plan.backup_capacity)
    need = ffn_binding.row_needed_entries(act)
    over = need > plan.width
    n_rows = over.sum(dtype=jnp.int32)
    idx = jnp.nonzero(over, size=buckets[-1], fill_value=m)[0].astype(jnp.int32)
    branch = jnp.minimum(jnp.searchsorted(jnp.asarray(buckets, jnp.int32), n_rows), len(buckets) - 1)
    return buckets, idx, n_rows, branch, jnp.where(over, 0, need).sum(dtype=jnp.int32)


def _train_fwd(x, w_gate, w_up, w_down, plan: TrainPlan, kernels: TrainKernels):
    m, d = x.shape
    gated = w_gate is not None
    w_act = w_gate if gated else w_up
    f = w_act.shape[1]
    tile, capacity = layout.TRAIN_TILE, layout.TRAIN_CAPACITY
    # Decided for the kernels, the fused gate packs in the matmul's epilogue and g is never
    # written; the dense branch, then taken only past the budget, recomputes it.
    g = None if plan.fused_gate else relu_matmul(x, w_act)
    if plan.fused_gate:
        act = kernels.gate_pack(x, w_act, tile=tile, capacity=capacity)
    else:
        act = kernels.pack(g, tile=tile, capacity=capacity)
    counts = act.counts.sum(axis=-1, dtype=jnp.int32)
    # Rows past the hybrid width go to the dense backup (at the smallest static size that
    # holds them): the kernels see them empty, so they neither overflow the entry budget
    # nor widen their 64-token blocks' unions.
    buckets, idx, n_rows, branch, kept_entries = _backup_rows(act, plan, m)
    kept = _without_rows(act, idx) if buckets[-1] else act
    use = (kept_entries <= plan.max_entries) & (n_rows <= buckets[-1])
    if plan.device_choice:
        use = use & plan.rule.use_sparse(
            kept.counts.sum(dtype=jnp.int32), kept.overflowed.sum(dtype=jnp.int32), m, d, f, x.dtype.itemsize,
            backup_rows=jnp.asarray(buckets, jnp.int32)[branch])
    use = use & all_finite(x, w_gate, w_up, w_down)  # NaN and Inf as the dense formula has them
    steps = plan.steps
    axes = mesh_axes(x, w_gate, w_up, w_down)

    # The backed-up rows' g and u, kept for the backward where they fit `keep` rows (zeros
    # otherwise): a small residual that spares the backward two products over the rows.
    keep = layout.train_backup_kept_rows(m, plan.backup_capacity)
    no_hidden = lambda: tuple(jnp.zeros((keep, f), x.dtype) for _ in range(2 if gated else 1))

    def backup(size):  # y, L1, fired neurons and kept (g, u) of the backed-up rows (size > 0)
        rows = idx[:size]
        xb = x.at[rows].get(mode="fill", fill_value=0)  # past the rows: zero rows, h = 0
        # their gate rows from the call's g where XLA's gate wrote it (a gather, not a product)
        gb = None if g is None else g.at[rows].get(mode="fill", fill_value=0)
        yb, l1b, fired_b, (gh, uh) = xla.backup_forward(xb, w_gate, w_up, w_down, m=m, g=gb, hidden=True)
        if size > keep:
            return rows, yb, l1b, fired_b, no_hidden()
        pad = lambda a: jnp.pad(a, ((0, keep - size), (0, 0)))
        return rows, yb, l1b, fired_b, tuple(pad(a) for a in (gh, uh) if a is not None)

    def sparse(size):  # the kernels, and the backup at this static size (0: none)
        def run(_):
            y, res, h_source = kernels.forward(
                x, kept, w_act, w_up if gated else None, w_down, max_entries=plan.max_entries,
                tensor_cores=steps.tensor_cores, down_union=steps.down_union, up_union=steps.up_union,
                down_stationary=steps.down_stationary,
            )
            l1 = h_l1(h_source, res.seg_start[-1], x.dtype, m)
            fired = fired_from_columns(res.col_off, f)
            hidden = no_hidden()
            if size:
                rows, yb, l1b, fired_b, hidden = backup(size)
                y = y.at[rows].set(yb, mode="drop")
                l1, fired = l1 + l1b, fired | fired_b
            return as_varying((y, l1, fired, res, hidden), axes)
        return run

    def dense(_):
        gate = relu_matmul(x, w_act) if g is None else g
        h = gate * jnp.matmul(x, w_up) if gated else gate
        y = jnp.matmul(h, w_down)
        l1 = jnp.abs(h.astype(jnp.float32)).sum() / max(m, 1)
        stationary = binding.forward_down_stationary(m, d, f, plan.max_entries, gated, steps.down_stationary)
        shapes = binding.residual_shapes(m, act.n_tiles, tile, plan.max_entries, gated, stationary)
        res = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # not read by the dense backward
        return as_varying((y, l1, (gate != 0).any(axis=0), res, no_hidden()), axes)

    # One conditional for the side and the backup's size: each conditional holding library
    # calls reads its index on the host (a device-to-host copy, the GPU waiting for the host
    # after it), so the backup's size is not a second one nested in the sparse side.
    side = jnp.where(use, 1 + branch, 0).astype(jnp.int32)
    y, l1, fired, res, hidden = jax.lax.switch(side, [dense] + [sparse(s) for s in buckets], None)
    return (y, l1, counts, fired), (x, w_gate, w_up, w_down, side, res, idx, hidden)


def _train_bwd(plan: TrainPlan, kernels: TrainKernels, saved, cotangents):
    x, w_gate, w_up, w_down, side, res, idx, hidden = saved
    dy, dl1, _, _ = cotangents
    # a NaN cotangent reaches every gradient through the dense formula
    side = jnp.where(all_finite(dy, dl1), side, 0)
    m = max(x.shape[0], 1)
    l1_grad = dl1.astype(jnp.float32) / m
    steps = plan.steps
    axes = mesh_axes(x, w_gate, w_up, w_down, dy)
    buckets = layout.train_backup_buckets(x.shape[0], plan.backup_capacity)
    # Under shard_map the weights enter every branch as varying: their cotangents stay per
    # shard inside the conditional (the shards may take different branches, and a
    # collective inside one deadlocks) and are summed after it.
    weights = as_varying((w_gate, w_up, w_down), axes)

    def sparse(size):  # the kernels, then the backed-up rows' cotangents, written out
        def run(_):
            # dw_gate and dw_up come as the kernel writes them, [f, d]: transposed here, or
            # with the backup's products added in the same pass
            grads = as_varying(kernels.backward(
                x, dy.astype(x.dtype), w_gate, w_up, w_down, res, l1_grad, tile=layout.TRAIN_TILE,
                tensor_cores=steps.tensor_cores, dx_tensor_cores=steps.dx_tensor_cores, dx_union=steps.dx_union,
                dh_union=steps.dh_union, dx_stationary=steps.dx_stationary, transposed=True,
            ), axes)
            if not size:
                dx, dw_gate_t, dw_up_t, dw_down = grads
                return dx, None if dw_gate_t is None else dw_gate_t.T, dw_up_t.T, dw_down
            rows = idx[:size]
            xb, dyb = (a.at[rows].get(mode="fill", fill_value=0) for a in (x, dy))
            # the backed-up rows' weight cotangents added to the kernels' (their L1 term is
            # sum |h| / m, as in the forward), from their g and u as the forward kept them
            # where it did (else recomputed)
            kept_hidden = None
            if size <= hidden[0].shape[0]:
                kept_hidden = (hidden[0][:size], hidden[1][:size] if len(hidden) > 1 else None)
            dxb, *dw = xla.backup_vjp(xb, *weights, dyb.astype(x.dtype), dl1, m=m, grads=grads[1:], transposed=True,
                                      hidden=kept_hidden)
            dx = grads[0].at[rows].set(dxb.astype(grads[0].dtype), mode="drop")
            return as_varying((dx, *dw), axes)
        return run

    def dense(_):  # nothing M x f was kept: the dense backward recomputes g and u (2 matmuls)
        return as_varying(xla.ffn_with_aux_vjp(x, *weights, dy, dl1), axes)

    grads = jax.lax.switch(side, [dense] + [sparse(s) for s in buckets], None)
    return tuple(sum_over_shards(g, p) for g, p in zip(grads, (x, w_gate, w_up, w_down)))


_train_ffn.defvjp(_train_fwd, _train_bwd)


def run(plan: TrainPlan, x, w_gate, w_up, w_down, kernels: TrainKernels = BINDINGS):
    """Runs ``plan`` on ``x [M, d]``: ``(y [M, d], l1 [], counts [M] int32, fired [f] bool)``,
    differentiable with the gradients of the dense formula."""
    if not plan.kernels:
        return xla.ffn_with_aux(x, w_gate, w_up, w_down)
    return _train_ffn(x, w_gate, w_up, w_down, plan, kernels)


def ffn_with_aux(x, w_gate, w_up, w_down, *, layer: LayerInfo = LayerInfo(), options: TrainOptions = TrainOptions(),
                 kernels: TrainKernels = BINDINGS):
    """Training FFN through the CUDA kernels, as planned by
    :func:`jax_twell.ops.plan.plan_ffn_train`. x: ``[M, d]`` bf16, f16 or f32 (f32 runs
    XLA autodiff); weights as in :func:`jax_twell.sparse_ffn_train`. Returns ``(y [M, d],
    l1 [], counts [M] int32, fired [f] bool)``, differentiable (custom_vjp)."""
    m, d = x.shape
    plan = plan_ffn_train(m, d, w_up.shape[1], x.dtype, gated=w_gate is not None, layer=layer, options=options)
    return run(plan, x, w_gate, w_up, w_down, kernels)
