"""CUDA bindings of the training FFN kernels (ffi/twell_train.cu): thin ``jax.ffi.ffi_call``
wrappers for the forward (sparse residuals) and the backward.

Layout: the blocked TwELL layout of the inference kernel (tile 256, capacity 32, token
blocks of 1024). The forward keeps, per stored entry, the gate value and u (and the
entries sorted by neuron), never an ``[M, f]`` tensor; the backward reads them. Which
steps run is the plan's business (:class:`jax_twell.ops.plan.TrainSteps`); each applies
where the shape takes it (:mod:`jax_twell.ops.layout`), else the step before it. The
NumPy model the GPU tests compare against: tests/train_emulation.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_twell._kernels import kernel_call
from jax_twell.formats import TwELL
from jax_twell.ops import layout
from jax_twell.ops.ffn.binding import steps_attribute

__all__ = ["Residuals", "residual_shapes", "forward_down_stationary", "train_forward", "train_backward",
           "backward_steps_attribute"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Residuals:
    """What the sparse forward keeps for the backward (besides x and the weights).

    seg_start ``[n_blocks * n_tiles + 1]`` s32, tok_off ``[n_blocks, n_tiles, 1025]`` s32:
    the blocked layout; entries ``[E]`` u32: ``g bits << 16 | flag << 15 | column``; up
    ``[E]`` u16: u bits (gated; None otherwise); col_off ``[n_blocks, n_tiles, tile + 1]``
    s32 and by_col ``[E]`` u32: each segment's entries with g != 0 by (column, token).
    stat_order ``[layout.walk_order_words(M)]`` s32: the tokens' order of the gated
    forward's stationary down walk (ranks, order, group offsets), which the backward's dx
    walk takes instead of computing it again from the same counts; None where the forward
    ran another down step.
    """

    seg_start: jax.Array
    tok_off: jax.Array
    entries: jax.Array
    up: jax.Array | None
    col_off: jax.Array
    by_col: jax.Array
    stat_order: jax.Array | None = None


def residual_shapes(m: int, n_tiles: int, tile: int, max_entries: int, gated: bool,
                    down_stationary: bool = False) -> Residuals:
    """Shapes and dtypes of :class:`Residuals` for ``m`` tokens (``down_stationary``: the
    forward ran its down step with the weight stationary, and kept its token order)."""
    n_blocks = -(-m // layout.BLOCK_TOKENS)
    s = jax.ShapeDtypeStruct
    return Residuals(
        seg_start=s((n_blocks * n_tiles + 1,), jnp.int32),
        tok_off=s((n_blocks, n_tiles, layout.BLOCK_TOKENS + 1), jnp.int32),
        entries=s((max_entries,), jnp.uint32),
        up=s((max_entries,), jnp.uint16) if gated else None,
        col_off=s((n_blocks, n_tiles, tile + 1), jnp.int32),
        by_col=s((max_entries,), jnp.uint32),
        stat_order=s((layout.walk_order_words(m),), jnp.int32) if gated and down_stationary else None,
    )


def forward_down_stationary(m: int, d: int, f: int, max_entries: int, gated: bool, down_stationary: bool) -> bool:
    """Whether :func:`train_forward` runs its down step with the weight stationary (and so
    keeps ``Residuals.stat_order``) when asked ``down_stationary``."""
    return bool(down_stationary) and gated and layout.stationary_down_supported(m, d, f, max_entries)


def backward_steps_attribute(*, tensor_cores: bool, dx_tensor_cores: bool, dx_union: bool, dh_union: bool,
                             dx_stationary: bool) -> np.int32:
    """The backward handlers' ``mma`` attribute from named steps: bit 0 the dh step on
    tensor cores, bit 1 dx too, bit 2 dx and bit 3 dh as union products, bit 4 dx by the
    stationary walk. The one place the bits are written."""
    return np.int32(int(bool(tensor_cores)) | int(bool(dx_tensor_cores)) << 1 | int(bool(dx_union)) << 2
                    | int(bool(dh_union)) << 3 | int(bool(dx_stationary)) << 4)


def train_forward(x, act: TwELL, w_act, w_up, w_down, *, max_entries: int, w_up_t=None, tensor_cores: bool = False,
                  down_union: bool = False, up_union: bool = False, down_stationary: bool = False):
    """One ``jax_twell_train_fwd[_gated]`` call: ``(y, Residuals, h_source)``.

    x ``[M, d]`` bf16/f16; act: TwELL of ``relu(x @ w_act)`` (tile <= 256); w_up None for
    the non-gated FFN. ``h_source`` ``[E]`` u32 holds h in its high half (h words, or the
    entries themselves when non-gated). Entries past ``seg_start[-1]`` are unwritten.
    ``tensor_cores``: the up and down steps on tensor cores (measured no faster, training_kernels.md; sums equal
    to f32 rounding, not bitwise, see ffi/notes/twell_ffn_blocked.md). ``down_union`` (gated,
    where :func:`jax_twell.ops.layout.union_down_supported` allows): y as a dense product over each 64-token
    block's union of active neurons (ffi/twell_union.cuh; the same h, f32 sums in another
    order). ``up_union``
    (gated, where :func:`jax_twell.ops.layout.union_up_supported` allows): u of every entry from a dense product
    of each 64-token block's x with its union's rows of Wu^T (f32 sums over d in another
    order: the up residual and h may differ from the per-entry step's in their last bit). ``down_stationary`` (gated, where
    :func:`jax_twell.ops.layout.stationary_down_supported` allows; taking precedence over ``down_union``): y by
    the inference down step that holds 16 (or 8) columns of Wd in each CTA's shared memory
    while it walks every token's h words (ffi/twell_stationary.cuh; y in the order
    tests/stationary_emulation.py models). Residuals and h words are the same in
    every down step.
    """
    m, d = x.shape
    e, tile = max_entries, act.tile
    f = w_down.shape[0]
    down_union = bool(down_union) and w_up is not None and layout.union_down_supported(m, d, f, e)
    up_union = bool(up_union) and w_up is not None and layout.union_up_supported(m, d, f, e)
    down_stationary = forward_down_stationary(m, d, f, e, w_up is not None, down_stationary)
    down_union = down_union and not down_stationary
    mma = steps_attribute(tensor_cores=tensor_cores, down_union=down_union, up_union=up_union,
                          down_stationary=down_stationary)
    r = residual_shapes(m, act.n_tiles, tile, e, w_up is not None, down_stationary)
    blocked_layout = [r.seg_start, r.tok_off, r.entries]
    by_column = [r.col_off, r.by_col]
    y_type = jax.ShapeDtypeStruct(x.shape, x.dtype)
    if w_up is None:
        call = kernel_call("jax_twell_train_fwd", (y_type, *blocked_layout, *by_column), vmap_method="sequential")
        y, seg_start, tok_off, entries, col_off, by_col = call(
            x, act.values, act.cols, act.counts, w_act, w_down, tile=np.int32(tile), mma=mma
        )
        return y, Residuals(seg_start, tok_off, entries, None, col_off, by_col), entries
    if w_up_t is None:
        w_up_t = w_up.T
    gated_ws = [
        jax.ShapeDtypeStruct((e,), jnp.uint16),
        jax.ShapeDtypeStruct((e,), jnp.uint32),
        jax.ShapeDtypeStruct((d // layout.UP_COLS, e), jnp.float32),
    ]
    # the down walk's token order (a residual), else one unused word
    order = r.stat_order if down_stationary else jax.ShapeDtypeStruct((1,), jnp.int32)
    call = kernel_call("jax_twell_train_fwd_gated", (y_type, *blocked_layout, *gated_ws, *by_column, order),
                       vmap_method="sequential")
    y, seg_start, tok_off, entries, up, h_words, _, col_off, by_col, stat_order = call(
        x, act.values, act.cols, act.counts, w_act, w_up, w_up_t, w_down, tile=np.int32(tile), mma=mma
    )
    res = Residuals(seg_start, tok_off, entries, up, col_off, by_col, stat_order if down_stationary else None)
    return y, res, h_words


def train_backward(
    x, dy, w_gate, w_up, w_down, res: Residuals, l1_grad, *, tile: int, workspace: bool = False,
    tensor_cores: bool = False, dx_tensor_cores: bool = False, dx_union: bool = False, dh_union: bool = False,
    dx_stationary: bool = False, transposed: bool = False,
):
    """One ``jax_twell_train_bwd[_gated]`` call: ``(dx, dw_gate, dw_up, dw_down)``; with
    ``transposed``, ``dw_gate`` and ``dw_up`` as the kernel writes them, ``[f, d]`` (the
    caller transposes them, with whatever it adds to them in the same pass).
    ``tensor_cores``: the dh step on tensor cores (as in :func:`train_forward`). ``dx_tensor_cores``: dx on
    tensor cores too, its coefficients rounded to x's dtype as XLA's dense backward rounds
    them (ffi/notes/training_kernels.md); False, dx on CUDA cores from the f32
    coefficients (the bit-exact model's dx). ``dx_union``: dx as a dense tensor-core
    product over each 64-token block's union of active neurons (ffi/twell_union.cuh; the
    same rounded coefficients, another summation order), where
    :func:`jax_twell.ops.layout.union_dx_supported` allows; elsewhere as ``dx_tensor_cores`` says. ``dh_union``: dh as
    the union up product of dy and Wd's rows (every entry with g != 0; dh's f32 sum in
    another order than the per-entry step's), where :func:`jax_twell.ops.layout.union_up_supported` allows;
    elsewhere the per-entry step (as ``tensor_cores`` says). ``dx_stationary`` (where
    :func:`jax_twell.ops.layout.walk_supported` allows; taking precedence over ``dx_union``): dx by the
    walk of the inference down step with the weights stationary in shared memory
    (ffi/twell_stationary.cuh): each CTA holds 16 (or 8) columns of Wact^T, staged from the
    weight in its own ``[d, f]`` layout (no transposed copies), and walks every token's
    words; gated, a second walk holds Wu^T's and adds the first walk's f32 sums once at the
    end; the same rounded coefficients (f32 sums in the order
    tests/stationary_emulation.py models: ``stationary_emulation.dx``).

    ``l1_grad``: ``[]`` f32, the cotangent of the L1 term divided by M. w_gate None: the
    non-gated FFN (dw_gate None). ``workspace=True`` (tests) returns the raw results
    ``(dx, dw_down, dw_act_t[, dw_up_t], partial, coef)`` instead (the union layout's
    workspace left out).
    """
    m, d = x.shape
    f = w_down.shape[0]
    e = res.entries.shape[0]
    gated = w_gate is not None
    grad_t = jax.ShapeDtypeStruct((f, d), x.dtype)
    outs = [jax.ShapeDtypeStruct(x.shape, x.dtype), grad_t, grad_t] + ([grad_t] if gated else [])
    dx_stationary = bool(dx_stationary) and layout.walk_supported(m, d, f, e, 2 if gated else 1)
    # The weights as the dx step reads them: the walk stages its table from them as they
    # are ([d, f]); the other dx steps read rows of their transposes.
    as_read = (lambda w: w) if dx_stationary else (lambda w: w.T)
    w_act_op = as_read(w_gate if gated else w_up)
    w_up_op = as_read(w_up) if gated else None
    dx_union = bool(dx_union) and not dx_stationary and layout.union_dx_supported(m, d, f, e, gated)
    dh_union = bool(dh_union) and layout.union_up_supported(m, d, f, e)
    outs += [
        jax.ShapeDtypeStruct((d // layout.UP_COLS, e), jnp.float32),
        jax.ShapeDtypeStruct((3 if gated else 2, e), jnp.float32),
        # the weight gradients' lists, and dx's union layout (free once dx is done)
        jax.ShapeDtypeStruct((max(layout.grad_workspace_ints(m, f, tile, e),
                                  layout.union_workspace_ints(m, e, gated) if dx_union else 0),), jnp.int32),
    ]
    l1 = jnp.reshape(l1_grad, (1,)).astype(jnp.float32)
    tile_attr = np.int32(tile)
    mma_attr = backward_steps_attribute(tensor_cores=tensor_cores, dx_tensor_cores=dx_tensor_cores, dx_union=dx_union,
                                        dh_union=dh_union, dx_stationary=dx_stationary)
    if gated:
        # the forward down walk's token order where it kept one (dx's walk then skips its
        # S1-S4), else one word the handler ignores
        order = res.stat_order if res.stat_order is not None else jnp.zeros((1,), jnp.int32)
        call = kernel_call("jax_twell_train_bwd_gated", outs, vmap_method="sequential")
        out = call(x, dy, w_act_op, w_up_op, w_down, res.seg_start, res.tok_off, res.entries, res.up, res.col_off,
                   res.by_col, l1, order, tile=tile_attr, mma=mma_attr)
        if workspace:
            return out[:-1]
        dx, dw_down, dw_gate_t, dw_up_t = out[:4]
        if transposed:
            return dx, dw_gate_t, dw_up_t, dw_down
        return dx, dw_gate_t.T, dw_up_t.T, dw_down
    call = kernel_call("jax_twell_train_bwd", outs, vmap_method="sequential")
    out = call(x, dy, w_act_op, w_down, res.seg_start, res.tok_off, res.entries, res.col_off, res.by_col, l1,
               tile=tile_attr, mma=mma_attr)
    if workspace:
        return out[:-1]
    dx, dw_down, dw_up_t = out[:3]
    return dx, None, dw_up_t if transposed else dw_up_t.T, dw_down


