"""CUDA bindings of the inference FFN kernels: thin ``jax.ffi.ffi_call`` wrappers.

Each wrapper builds one handler call (ffi/twell_ffn.cu, ffi/twell_ffn_blocked.cu,
ffi/twell_gate.cu, ffi/twell_decode.cu, ffi/twell_decode_rows.cu) for operands the caller
validated; the handlers re-check shapes and fail with an InvalidArgument naming the
constraint. Attributes are numpy scalars of the declared type. Which kernel runs is the
plan's business (:mod:`jax_twell.ops.plan`); layouts: docs/design.md, section 3 (Formats).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_twell._kernels import kernel_call
from jax_twell.formats import TwELL
from jax_twell.ops import layout, stats

__all__ = [
    "steps_attribute",
    "twell_ffn",
    "blocked_ffn",
    "blocked_call",
    "blocked_needed_entries",
    "row_needed_entries",
    "gate_pack",
    "decode_ffn",
    "decode_gate_splits",
    "decode_ffn_gate",
    "decode_ffn_rows",
]


def steps_attribute(*, tensor_cores: bool, down_union: bool = False, up_union: bool = False,
                    down_stationary: bool = False) -> np.int32:
    """The blocked and training-forward handlers' ``mma`` attribute from named steps: bit 0
    tensor cores, bit 2 the down step and bit 3 the up step as union products, bit 4 the
    down step on the stationary weight. The one place the bits are written."""
    return np.int32(int(bool(tensor_cores)) | int(bool(down_union)) << 2 | int(bool(up_union)) << 3
                    | int(bool(down_stationary)) << 4)


def twell_ffn(x, act: TwELL, w_act, w_up, w_down, w_up_t=None):
    """The row kernel (``jax_twell_ffn[_gated]``): one CTA a token row.

    Gated (``w_up`` given): ``y = (act * (x @ w_up)) @ w_down``; non-gated: ``y = act @ w_down``.
    Overflowed tiles are recomputed exactly from ``(x, w_act[, w_up])``.

    Args:
      x: ``[..., M, d]`` bf16, f16 or f32 (:func:`jax_twell.ops.layout.check_row_supported`).
      act: TwELL of ``relu(x @ w_act)``.  w_act, w_up: ``[d, f]``.  w_down: ``[f, d]``.
      w_up_t: optional ``[f, d]`` copy of ``w_up.T``, the layout the kernel reads; omitted,
        it is transposed here (one pass over w_up per call).
    Returns:
      y: ``[..., M, d]`` dtype of x.
    """
    layout.check_row_supported(x.shape[-1], x.dtype)
    out_type = jax.ShapeDtypeStruct(x.shape, x.dtype)
    # Weights are shared by every row, so a vmapped call runs once per batch element.
    if w_up is None:
        call = kernel_call("jax_twell_ffn", out_type, vmap_method="sequential")
        return call(x, act.values, act.cols, act.counts, w_act, w_down, tile=np.int32(act.tile))
    if w_up_t is None:
        w_up_t = w_up.T
    call = kernel_call("jax_twell_ffn_gated", out_type, vmap_method="sequential")
    return call(x, act.values, act.cols, act.counts, w_act, w_up, w_up_t, w_down, tile=np.int32(act.tile))


def row_needed_entries(act: TwELL) -> jax.Array:
    """``[..., M]`` int32: entries the blocked kernel needs for each row of ``act`` (its
    stored entries, plus the full width of each overflowed tile, recomputed from the weights)."""
    return jnp.where(act.overflowed, stats.tile_widths(act.f, act.tile), act.counts).sum(axis=-1, dtype=jnp.int32)


def blocked_needed_entries(act: TwELL) -> jax.Array:
    """``[]`` int32: entries the blocked kernel needs for ``act`` (:func:`row_needed_entries`
    of every row)."""
    return row_needed_entries(act).sum(dtype=jnp.int32)


def blocked_call(x, act: TwELL, w_act, w_up, w_down, w_up_t, *, max_entries: int, tensor_cores: bool = False,
                 down_union: bool = False, up_union: bool = False, down_stationary: bool = False,
                 fallback: bool = False):
    """The blocked handler (``jax_twell_ffn_blocked[_gated]``): ``(y, seg_start, tok_off,
    entries[, partial])``. Each step variant applies where the shape takes it (gated, and
    the layout within the workspace: :mod:`jax_twell.ops.layout`), else the step before
    it; the stationary down step takes precedence over the union one. ``fallback``: where
    the call's entries overflow ``max_entries`` (read on the device), the handler's last
    launch, the row kernel, writes y exactly; without it y is NaN there."""
    m, d = int(np.prod(x.shape[:-1])), x.shape[-1]
    gated = w_up is not None
    down_stationary = down_stationary and gated and layout.stationary_down_supported(m, d, act.f, max_entries)
    down_union = down_union and gated and not down_stationary and layout.union_down_supported(m, d, act.f, max_entries)
    up_union = up_union and gated and layout.union_up_supported(m, d, act.f, max_entries)
    n_blocks = -(-m // layout.BLOCK_TOKENS)
    workspace = [
        jax.ShapeDtypeStruct((n_blocks * act.n_tiles + 1,), jnp.int32),
        jax.ShapeDtypeStruct((n_blocks, act.n_tiles, layout.BLOCK_TOKENS + 1), jnp.int32),
        jax.ShapeDtypeStruct((max_entries,), jnp.uint32),
    ]
    y_type = jax.ShapeDtypeStruct(x.shape, x.dtype)
    mma = steps_attribute(tensor_cores=tensor_cores, down_union=down_union, up_union=up_union,
                          down_stationary=down_stationary)
    attrs = dict(tile=np.int32(act.tile), mma=mma, fallback=np.int32(bool(fallback)))
    if not gated:
        call = kernel_call("jax_twell_ffn_blocked", (y_type, *workspace), vmap_method="sequential")
        return call(x, act.values, act.cols, act.counts, w_act, w_down, **attrs)
    workspace.append(jax.ShapeDtypeStruct((d // layout.UP_COLS, max_entries), jnp.float32))
    if w_up_t is None:
        w_up_t = w_up.T
    call = kernel_call("jax_twell_ffn_blocked_gated", (y_type, *workspace), vmap_method="sequential")
    return call(x, act.values, act.cols, act.counts, w_act, w_up, w_up_t, w_down, **attrs)


def blocked_ffn(x, act: TwELL, w_act, w_up, w_down, *, w_up_t=None, max_entries: int | None = None,
                workspace: bool = False, tensor_cores: bool = False, down_union: bool = False,
                up_union: bool = False, down_stationary: bool = False):
    """Fused up + down over blocks of 1024 tokens, each weight slab read once per block.

    Same math and arguments as :func:`twell_ffn`. bf16 or f16 (f32 runs the row kernel);
    d a multiple of 64 and at most 16384, tile at most 256 (ValueError otherwise).
    ``max_entries`` (default :func:`jax_twell.ops.layout.blocked_max_entries`) sizes the
    workspace; a call that needs more runs the row kernel instead, exact (the handler
    launches it last and it exits at once where the entries fit). ``workspace=True``
    (tests) returns ``(y, seg_start, tok_off, entries[, partial])`` from the blocked kernel
    alone (y NaN where the entries overflow). The step variants: :func:`blocked_call`
    (tensor-core sums equal to f32 rounding, not bitwise; the stationary down step's order
    is modelled by tests/stationary_emulation.py).
    """
    if jnp.dtype(x.dtype) == jnp.float32:
        if workspace:
            raise ValueError("the blocked kernel takes bf16 or f16; f32 runs the row kernel")
        return twell_ffn(x, act, w_act, w_up, w_down, w_up_t)
    layout.check_blocked_supported(x.shape[-1], act.tile)
    layout.check_row_supported(x.shape[-1], x.dtype)
    m = int(np.prod(x.shape[:-1]))
    if max_entries is None:
        max_entries = layout.blocked_max_entries(m, act.f, act.tile, act.capacity)
    steps = dict(tensor_cores=tensor_cores, down_union=down_union, up_union=up_union, down_stationary=down_stationary)
    if workspace:
        return blocked_call(x, act, w_act, w_up, w_down, w_up_t, max_entries=max_entries, **steps)
    if m == 0:
        return jnp.zeros(x.shape, x.dtype)
    return blocked_call(x, act, w_act, w_up, w_down, w_up_t, max_entries=max_entries, fallback=True, **steps)[0]


def gate_pack(x: jax.Array, w: jax.Array, *, tile: int, capacity: int, variant: int | None = None) -> TwELL:
    """``relu(x @ w)`` as TwELL by the fused gate kernel (``jax_twell_gate_pack``): the
    matmul's epilogue packs each output tile; no ``[M, f]`` activation is written.

    x: ``[..., M, d]``, w: ``[d, f]``, one dtype (bf16 or f16);
    :func:`jax_twell.ops.layout.fused_gate_supported` must hold. The result is
    ``pack_twell(relu(x @ w))`` up to the last bit of an element (f32 accumulation in
    another order than XLA's). ``variant``: the GEMM's configuration (default
    :func:`jax_twell.ops.layout.fused_gate_variant`), the same result for every one.
    """
    d, f = w.shape
    variant = layout.fused_gate_variant(d) if variant is None else variant
    lead = x.shape[:-1]
    rows = int(np.prod(lead)) if lead else 1
    n_tiles = -(-f // tile)
    out_types = (
        jax.ShapeDtypeStruct((rows, n_tiles, capacity), x.dtype),
        jax.ShapeDtypeStruct((rows, n_tiles, capacity), jnp.int16),
        jax.ShapeDtypeStruct((rows, n_tiles), jnp.int32),
    )
    if rows == 0:
        values, cols, counts = (jnp.zeros(t.shape, t.dtype) for t in out_types)
    else:
        call = kernel_call("jax_twell_gate_pack", out_types, vmap_method="sequential")
        values, cols, counts = call(
            x.reshape(rows, d), w, tile=np.int32(tile), capacity=np.int32(capacity), variant=np.int32(variant)
        )
    return TwELL(values.reshape(*lead, n_tiles, capacity), cols.reshape(*lead, n_tiles, capacity),
                 counts.reshape(*lead, n_tiles), f=f, tile=tile)


def _decode_out_types(m: int, d: int, f: int, dtype):
    """y ``[M, d]`` and the decode kernels' workspace: per (token, 256-column tile) counts
    and entry lists."""
    n_tiles = -(-f // layout.DECODE_TILE)
    return (
        jax.ShapeDtypeStruct((m, d), dtype),
        jax.ShapeDtypeStruct((m, n_tiles), jnp.int32),
        jax.ShapeDtypeStruct((m, n_tiles * layout.DECODE_TILE), jnp.uint32),
    )


def decode_ffn(x, g, w_up, w_down, *, w_up_t=None, workspace: bool = False):
    """FFN output from the dense gate activation by the decode kernel (``jax_twell_decode``).

    Gated (``w_up`` given): ``y = (g * (x @ w_up)) @ w_down`` with ``x @ w_up`` computed only
    where ``g != 0``; non-gated: ``y = g @ w_down``. Reads one row of ``w_up.T`` and one of
    ``w_down`` per active pair and nothing else of the weights. Exact for every activation
    pattern; deterministic.

    Args:
      x: ``[M, d]`` bf16 or f16 (:func:`jax_twell.ops.layout.decode_supported`).
      g: ``[M, f]`` x's dtype: ``relu(x @ w_gate)`` (gated) or ``relu(x @ w_up)`` (non-gated).
      w_up: ``[d, f]`` or None.  w_down: ``[f, d]``.  w_up_t: optional ``[f, d]`` ``w_up.T``.
      workspace: also return ``counts [M, ceil(f/256)]`` and ``entries`` (tests).
    Returns:
      ``y [M, d]`` x's dtype (and the workspace when asked).
    """
    m, f = g.shape
    d = w_down.shape[1]
    if not layout.decode_supported(d, f, g.dtype):
        raise ValueError(f"the decode kernel needs bf16 or f16, d a multiple of 8 and at most {layout.DECODE_MAX_D}, "
                         f"f at most {layout.DECODE_MAX_F}; got {jnp.dtype(g.dtype).name}, d={d}, f={f}")
    out_types = _decode_out_types(m, d, f, g.dtype)
    if w_up is None:
        out = kernel_call("jax_twell_decode", out_types, vmap_method="sequential")(g, w_down)
    else:
        if w_up_t is None:
            w_up_t = w_up.T
        out = kernel_call("jax_twell_decode_gated", out_types, vmap_method="sequential")(x, g, w_up_t, w_down)
    return out if workspace else out[0]


def decode_gate_splits(m: int, d: int, f: int, sms: int | None = None) -> int:
    """K ranges of the decode gate kernel (at most 8): the ``ceil(f / 128)`` column blocks
    times the ranges fill at most the three CTAs per SM that fit (one wave), and no more
    ranges than d has 64-row stages; ``m`` does not change the count."""
    del m
    if sms is None:
        sms = getattr(jax.devices()[0], "core_count", None) or 132
    blocks = -(-f // layout.DECODE_GATE_COLS)
    return max(1, min(layout.DECODE_GATE_MAX_SPLITS, -(-d // layout.DECODE_GATE_K), 3 * sms // blocks))


def decode_ffn_gate(x, w_act, w_up, w_down, *, w_up_t=None, workspace: bool = False, splits: int | None = None,
                    cluster: bool = False):
    """The whole decode FFN in our kernels (``jax_twell_decode_fused[_gated]``): the gate
    matmul (tensor cores, split-K over d, the gate weight read once), then
    :func:`decode_ffn`'s steps on its result.

    ``g = relu(x @ w_act)`` with f32 accumulation, the K ranges' sums added in a fixed order
    and rounded once (deterministic). x: ``[M, d]`` bf16/f16; ``w_act``: ``w_gate`` (gated,
    ``w_up`` given) or ``w_up`` (``w_up=None``), ``[d, f]``. ``workspace=True`` also
    returns ``(g [M, f], counts, entries)``. ``splits``: 1 to min(8, ceil(d / 64)) (default
    :func:`decode_gate_splits`). ``cluster``: the ranges' sums added in a thread-block
    cluster's shared memory (True) or through an f32 workspace (False, the default);
    the same result, bit for bit. Returns ``y [M, d]`` x's dtype.
    """
    m, d = x.shape
    f = w_act.shape[1]
    if not (layout.decode_supported(d, f, x.dtype) and layout.decode_gate_supported(m, d, f)):
        raise ValueError(
            f"the decode gate kernel needs bf16 or f16, at most {layout.DECODE_GATE_MAX_TOKENS} tokens, d a multiple "
            f"of 16 and at most {layout.DECODE_MAX_D}, f a multiple of 8 and at most {layout.DECODE_MAX_F}; got "
            f"{jnp.dtype(x.dtype).name}, M={m}, d={d}, f={f}"
        )
    most = min(layout.DECODE_GATE_MAX_SPLITS, -(-d // layout.DECODE_GATE_K))
    if splits is None:
        splits = decode_gate_splits(m, d, f)
    elif not 1 <= splits <= most:
        raise ValueError(f"splits must be in [1, min(8, ceil(d / 64))] = [1, {most}], got {splits}")
    splits = np.int32(splits)
    y_type, *work = _decode_out_types(m, d, f, x.dtype)
    partial_shape = (0,) if cluster else (int(splits), m, f)
    out_types = (y_type, jax.ShapeDtypeStruct((m, f), x.dtype), jax.ShapeDtypeStruct(partial_shape, jnp.float32), *work)
    if w_up is None:
        out = kernel_call("jax_twell_decode_fused", out_types, vmap_method="sequential")(x, w_act, w_down, splits=splits)
    else:
        if w_up_t is None:
            w_up_t = w_up.T
        call = kernel_call("jax_twell_decode_fused_gated", out_types, vmap_method="sequential")
        out = call(x, w_act, w_up_t, w_down, splits=splits)
    return (out[0], out[1], *out[3:]) if workspace else out[0]


def decode_ffn_rows(x, w_act_t, w_down, *, w_up_t=None, workspace: bool = False):
    """The whole FFN for 1-4 tokens from weights stored by neuron, in two launches
    (``jax_twell_decode_rows[_gated]``).

    Gated (``w_up_t`` given): ``y = (relu(x @ w_act_t.T) * (x @ w_up_t.T)) @ w_down``;
    non-gated: ``y = relu(x @ w_act_t.T) @ w_down``. Each warp streams whole rows of
    ``w_act_t``, then reads one ``w_up_t`` and one ``w_down`` row per neuron active for some
    token. f32 accumulation, one rounding of g and of y: deterministic, exact.

    Args:
      x: ``[M, d]`` bf16 or f16, 1 <= M <= 4 (:func:`jax_twell.ops.layout.decode_rows_supported`).
      w_act_t: ``[f, d]``: ``w_gate.T`` (gated) or ``w_up.T`` (non-gated).  w_down: ``[f, d]``.
      w_up_t: ``[f, d]`` ``w_up.T`` for the gated FFN, or None.
      workspace: also return ``g [M, f]`` and the per-CTA flags ``[ceil(f / 16), M]`` (tests).
    Returns:
      ``y [M, d]`` x's dtype (and the workspace when asked).
    """
    m, d = x.shape
    f = w_act_t.shape[0]
    if not layout.decode_rows_supported(m, d, f, x.dtype):
        raise ValueError(
            f"the decode rows kernel needs bf16 or f16, 1 to {layout.DECODE_ROWS_MAX_TOKENS} tokens, d a multiple "
            f"of 8 and at most {layout.DECODE_ROWS_MAX_D}, f at most {layout.DECODE_ROWS_MAX_F}; got "
            f"{jnp.dtype(x.dtype).name}, M={m}, d={d}, f={f}"
        )
    for name, w in (("w_act_t", w_act_t), ("w_up_t", w_up_t), ("w_down", w_down)):
        if w is not None and (w.shape != (f, d) or w.dtype != x.dtype):
            raise ValueError(f"{name} must be [f, d] = [{f}, {d}] in x's dtype, got {w.shape} {w.dtype}")
    groups = -(-f // layout.DECODE_ROWS_NEURONS)
    out_types = (
        jax.ShapeDtypeStruct((m, d), x.dtype),
        jax.ShapeDtypeStruct((m, f), x.dtype),
        jax.ShapeDtypeStruct((groups, m, d), jnp.float32),
        jax.ShapeDtypeStruct((groups, m), jnp.int32),
    )
    if w_up_t is None:
        out = kernel_call("jax_twell_decode_rows", out_types, vmap_method="sequential")(x, w_act_t, w_down)
    else:
        out = kernel_call("jax_twell_decode_rows_gated", out_types, vmap_method="sequential")(x, w_act_t, w_up_t, w_down)
    return (out[0], out[1], out[3]) if workspace else out[0]
