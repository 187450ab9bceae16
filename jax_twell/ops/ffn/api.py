"""Public inference ops: ``gate_twell``, ``twell_ffn``, ``sparse_ffn``.

Each takes ``implementation=``: "reference" (pure JAX on TwELL; defines the semantics),
"xla" (dense, where it exists), "cuda" (the kernels; a Hopper GPU and the library, see
:func:`jax_twell.kernel_status`) or None ("cuda" on CUDA devices where the kernels are
available and take the shape, else the portable default named in each docstring; chosen
per lowering platform). Leading batch dimensions are accepted (``x: [..., d]``).

How a "cuda" call is decided: :func:`jax_twell.ops.plan.plan_ffn` (the plan), run by
:mod:`jax_twell.ops.ffn.cuda` on the bindings of :mod:`jax_twell.ops.ffn.binding`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_twell.formats import TwELL, pack_twell_reference, relu_matmul
from jax_twell.ops import layout, xla
from jax_twell.ops.common import (
    check_ffn_args,
    check_projection_args,
    check_tiling,
    choose,
    flatten_tokens,
    fold_vmap_into_tokens,
)
from jax_twell.ops.ffn import cpu, cuda, reference
from jax_twell.ops.ffn.vjp import dense_formula_gradients
from jax_twell.ops.plan import FFNOptions, LayerInfo
from jax_twell.ops.sharded import FFNSharding, shard_ffn

__all__ = ["gate_twell", "twell_ffn", "sparse_ffn", "sparse_ffn_for_layer"]


def gate_twell(
    x: jax.Array,
    w: jax.Array,
    *,
    tile: int = 256,
    capacity: int = 32,
    implementation: str | None = None,
) -> TwELL:
    """``relu(x @ w)`` packed as TwELL (the gate projection of the sparse FFN).

    With the CUDA kernels, bf16 or f16 with ``tile=256``, ``capacity <= 64``, d and f
    multiples of 8 and at least 2048 tokens (where it measured faster) run the fused gate
    kernel: a Hopper GEMM that packs each output tile in its epilogue, never writing the
    ``[M, f]`` activation (g may then differ from XLA's matmul in the last bit of an
    element: both accumulate in f32, in different orders). Other calls run XLA's matmul
    then the pack kernel.

    Args:
      x: ``[..., M, d]`` bf16 or f32.  w: ``[d, f]`` same dtype.
      tile, capacity, implementation: as in :func:`jax_twell.pack_twell`.
    Returns:
      TwELL of the ``[..., M, f]`` activation.
    """
    check_projection_args(x, w)
    check_tiling(tile, capacity)
    kernels = dict(
        reference=lambda x, w: pack_twell_reference(relu_matmul(x, w), tile=tile, capacity=capacity),
        cuda=fold_vmap_into_tokens(lambda x, w: cuda.gate_twell(x, w, tile=tile, capacity=capacity), flatten=False),
    )
    return choose("gate_twell", implementation, kernels, "reference")(x, w)


def twell_ffn(
    x: jax.Array,
    act: TwELL,
    w_act: jax.Array,
    w_up: jax.Array | None,
    w_down: jax.Array,
    *,
    implementation: str | None = None,
) -> jax.Array:
    """FFN output from a packed activation ``act = relu(x @ w_act)``.

    Gated (``w_up`` given): ``y = (act * (x @ w_up)) @ w_down``; non-gated (``w_up=None``):
    ``y = act @ w_down``. Tiles flagged as overflowed are recomputed exactly from
    ``(x, w_act)``.

    Args:
      x: ``[..., M, d]``; act: TwELL of ``[..., M, f]``; w_act, w_up: ``[d, f]``;
      w_down: ``[f, d]``; implementation: "reference", "cuda" (fused kernel, always
      sparse: the caller chose the format) or None (cuda where available).
    Returns:
      y: ``[..., M, d]`` dtype of x.
    """
    check_ffn_args(x, w_act if w_up is not None else None, w_up if w_up is not None else w_act, w_down)
    if not isinstance(act, TwELL):
        raise TypeError(f"act must be a TwELL, got {type(act).__name__}")
    if act.f != w_act.shape[1] or act.values.shape[:-2] != x.shape[:-1]:
        raise ValueError(
            f"act holds [..., M, f] = {act.values.shape[:-2]} x {act.f} but x and w_act give "
            f"{x.shape[:-1]} x {w_act.shape[1]}"
        )
    kernels = dict(
        reference=reference.twell_ffn,
        cuda=fold_vmap_into_tokens(lambda *a: cuda.twell_ffn(*a), flatten=False, n_tokens=2),
    )
    if implementation is None and not layout.row_supported(x.shape[-1], x.dtype):
        del kernels["cuda"]
    fn = choose("twell_ffn", implementation, kernels, "reference")
    return fn(x, act, w_act, w_up, w_down)


def sparse_ffn(
    x: jax.Array, w_gate: jax.Array | None, w_up: jax.Array, w_down: jax.Array, *,
    implementation: str | None = None, sharding: FFNSharding | None = None,
) -> jax.Array:
    """Inference FFN with a ReLU gate, computed on the sparse activation.

    Gated: ``y = (relu(x @ w_gate) * (x @ w_up)) @ w_down``; non-gated (``w_gate=None``):
    ``y = relu(x @ w_up) @ w_down``.

    Args:
      x: ``[..., d]`` bf16 (fast path), f16 or f32.
      w_gate: ``[d, f]`` or None.  w_up: ``[d, f]``.  w_down: ``[f, d]``; all x's dtype.
      implementation: "reference" (TwELL in pure JAX), "xla" (dense), "cuda" (the kernels:
        each call checks its own number of active pairs on the device and runs dense
        where the kernels would be slower) or None ("cuda" where the kernels are available
        and take d, else "xla").
      sharding: run per shard of a device mesh (see :class:`jax_twell.FFNSharding`); use
        it whenever the operands are sharded.
    Returns:
      y: ``[..., d]`` dtype of x.

    Gradients: "reference" and "xla" are differentiated by JAX; "cuda" recomputes the
    dense formula with XLA (exact, at dense cost). To train on sparse kernels, use
    :func:`jax_twell.sparse_ffn_train`. What a layer knows about itself (its measured
    active fraction, transposed weight copies) is passed by the Flax module
    (:class:`jax_twell.modules.SparseFFN`) through :func:`sparse_ffn_for_layer`.
    """
    return sparse_ffn_for_layer(x, w_gate, w_up, w_down, implementation=implementation, sharding=sharding)


def sparse_ffn_for_layer(
    x: jax.Array, w_gate: jax.Array | None, w_up: jax.Array, w_down: jax.Array, *, layer: LayerInfo = LayerInfo(),
    options: FFNOptions = FFNOptions(), w_up_t: jax.Array | None = None, w_act_t: jax.Array | None = None,
    weights_finite: jax.Array | None = None, implementation: str | None = None, sharding: FFNSharding | None = None,
) -> jax.Array:
    """:func:`sparse_ffn` given what is known about the layer (internal entry point).

    ``layer``: the layer's measured fractions or decided side
    (:class:`jax_twell.ops.plan.LayerInfo`); ``options``: the plan's options (TwELL tile
    and capacity, kernel, cost model: :class:`jax_twell.ops.plan.FFNOptions`). ``w_up_t``:
    optional ``[f, d]`` copy of ``w_up.T`` (gated only), ``w_act_t``: of the activation's
    weight transposed (``w_gate.T`` gated, ``w_up.T`` non-gated); both sharded like
    ``w_down``; the layouts the decode kernels read. ``weights_finite``: ``[d]`` bool, what
    :func:`jax_twell.ops.common.finite_columns` gives for the weights, where the caller
    keeps it (a serving layer's cache: the call then checks only x; under ``sharding``
    used where f is not split across devices, else each shard checks its own slice).
    Only "cuda" and "cpu" use these; the tile and capacity also shape "reference". Shapes
    and result as :func:`sparse_ffn`.
    """
    check_ffn_args(x, w_gate, w_up, w_down)
    check_tiling(options.tile, options.capacity)
    if w_up_t is not None:
        if w_gate is None:
            raise ValueError("w_up_t applies to the gated FFN only (non-gated, w_up is the activation's weight)")
        if w_up_t.shape != w_up.shape[::-1] or w_up_t.dtype != w_up.dtype:
            raise ValueError(f"w_up_t must be w_up.T: shape {w_up.shape[::-1]} {w_up.dtype}, got {w_up_t.shape} {w_up_t.dtype}")
    if w_act_t is not None:
        w_act, name = (w_up, "w_up") if w_gate is None else (w_gate, "w_gate")
        if w_act_t.shape != w_act.shape[::-1] or w_act_t.dtype != w_act.dtype:
            raise ValueError(
                f"w_act_t must be {name}.T: shape {w_act.shape[::-1]} {w_act.dtype}, got {w_act_t.shape} {w_act_t.dtype}"
            )
    ignore_t = lambda op: lambda x, wg, wu, wd, w_up_t=None, w_act_t=None, ok=None: op(x, wg, wu, wd)
    cuda_ffn = dense_formula_gradients(
        fold_vmap_into_tokens(
            lambda x, wg, wu, wd, w_up_t, w_act_t, ok: cuda.sparse_ffn(
                x, wg, wu, wd, layer=layer, options=options, w_up_t=w_up_t, w_act_t=w_act_t, weights_finite=ok),
            flatten=True,
        )
    )
    cpu_ffn = dense_formula_gradients(
        fold_vmap_into_tokens(
            lambda x, wg, wu, wd, w_up_t, w_act_t, ok: cpu.sparse_ffn(x, wg, wu, wd, w_up_t=w_up_t, weights_finite=ok),
            flatten=True,
        )
    )
    kernels = dict(
        reference=ignore_t(functools.partial(reference.ffn, tile=options.tile, capacity=options.capacity)),
        xla=ignore_t(xla.ffn),
        cuda=lambda x, wg, wu, wd, w_up_t=None, w_act_t=None, ok=None: cuda_ffn(x, wg, wu, wd, w_up_t, w_act_t, ok),
        cpu=lambda x, wg, wu, wd, w_up_t=None, w_act_t=None, ok=None: cpu_ffn(x, wg, wu, wd, w_up_t, w_act_t, ok),
    )
    if implementation is None and not layout.row_supported(x.shape[-1], x.dtype):
        del kernels["cuda"]  # shapes the kernel does not take run dense
    fn = choose("sparse_ffn", implementation, kernels, "xla")
    x2, lead = flatten_tokens(x)
    ok = None if weights_finite is None else jnp.asarray(weights_finite, bool)
    # Positional: the default implementation's platform switch takes no keywords.
    if sharding is not None:
        y = shard_ffn(fn, sharding, x2, w_gate, w_up, w_down, weights_finite=ok, w_up_t=w_up_t, w_act_t=w_act_t)
    else:
        y = fn(x2, w_gate, w_up, w_down, w_up_t, w_act_t, ok)
    return y.reshape(*lead, x.shape[-1])
