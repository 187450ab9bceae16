"""Public ops. One function per op, each with an ``implementation=`` choice:

- ``"reference"``: pure JAX on the sparse formats; defines the semantics; any backend.
- ``"xla"``: dense math through XLA; the baseline, and the path where sparsity can't pay.
- ``"cuda"``: the CUDA kernels (XLA FFI custom calls); needs a Hopper GPU and the library
  (see :func:`jax_twell.kernel_status`).
- ``None`` (default): "cuda" on CUDA devices when the kernels are available and the op has
  them, otherwise the op's portable default (named in each docstring). The choice is made
  per lowering platform, so a jitted function placed on CPU still runs there.

Leading batch dimensions are accepted everywhere (``x: [..., d]``).
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp

from jax_twell import _kernels
from jax_twell.formats import Hybrid, TwELL, hybrid_from_row_twell, pack_hybrid_reference, pack_twell_reference, relu_matmul
from jax_twell.ops import cuda, cuda_train, reference, xla
from jax_twell.ops.sharded import FFNSharding, shard_ffn, shard_ffn_train
from jax_twell.ops.common import IMPLEMENTATIONS, FFNAux, check_activation, check_ffn_args, check_projection_args, make_aux

__all__ = [
    "pack_twell",
    "pack_hybrid",
    "gate_twell",
    "twell_ffn",
    "sparse_ffn",
    "sparse_ffn_train",
]

DEFAULT_TILE = 256
DEFAULT_CAPACITY = 32
DEFAULT_WIDTH = 128
MAX_TILE = 32768  # column offsets within a tile are int16


def _choose(op: str, implementation: str | None, kernels: dict, portable: str):
    """Returns the callable for ``implementation`` among ``kernels`` (name -> fn)."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{op}: implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    if implementation is None:
        fallback = kernels[portable]
        if "cuda" in kernels and _kernels.kernels_available():
            cuda_fn = kernels["cuda"]

            def auto(*args):
                return jax.lax.platform_dependent(*args, cuda=cuda_fn, default=fallback)

            return auto
        return fallback
    if implementation not in kernels:
        raise NotImplementedError(f"{op}: no {implementation!r} implementation; available: {sorted(kernels)}")
    if implementation == "cuda" and not _kernels.kernels_available():
        raise RuntimeError(f"{op}: implementation='cuda' but the kernels are unavailable: {_kernels.kernel_status().reason}")
    return kernels[implementation]


def _vmap_folds_tokens(fn, *, flatten: bool, n_tokens: int = 1):
    """``fn(x, *weights)`` whose outputs carry x's tokens on their leading dimensions, made
    to run once per ``jax.vmap`` when only x is batched: the batch becomes more tokens (one
    kernel launch, one device-side dense/sparse choice for the whole batch). vmap's default
    for the CUDA kernels would launch them once per element (``vmap_method="sequential"``)
    and turn the per-call choice (``lax.cond``) into a select that runs both sides. With a
    batched weight, ``fn`` is mapped as plain vmap would. ``flatten``: fn takes x as
    ``[M, d]`` only, so the batch is folded into M and unfolded from every output leaf;
    otherwise fn takes leading dimensions and the batch is one more. ``n_tokens``: how many
    leading arguments carry the tokens (x, and a packed activation of x); all of them must
    be batched to fold.

    ``custom_vmap`` has no reverse-mode derivative: a caller that needs gradients wraps the
    result in a ``custom_vjp`` (as :func:`sparse_ffn` does with
    :func:`_dense_formula_gradients`)."""

    if flatten and n_tokens != 1:
        raise ValueError("folding into M flattens one token argument")

    @jax.custom_batching.custom_vmap
    def folded(*args):
        return fn(*args)

    @folded.def_vmap
    def rule(axis_size, in_batched, *args):
        tokens_batched = all(all(jax.tree.leaves(b)) for b in in_batched[:n_tokens])
        if not tokens_batched or any(jax.tree.leaves(in_batched[n_tokens:])):
            axes = [jax.tree.map(lambda b: 0 if b else None, b) for b in in_batched]
            out = jax.vmap(fn, in_axes=axes)(*args)
        elif not flatten:
            out = folded(*args)
        else:
            x, *rest = args
            m = x.shape[1]
            out = folded(x.reshape(axis_size * m, *x.shape[2:]), *rest)
            out = jax.tree.map(lambda a: a.reshape(axis_size, m, *a.shape[1:]), out)
        return out, jax.tree.map(lambda _: True, out)

    return folded


def _dense_formula_gradients(ffn):
    """``ffn(x, w_gate, w_up, w_down, w_up_t, w_act_t)``, a forward the CUDA kernels compute
    (no JAX derivative rules), with a VJP from XLA's dense formula: exact gradients, at the
    dense backward's cost, with only the inputs kept as residuals. The transposed weight
    copies get zero cotangents (y depends on them only through the weights they copy)."""

    @jax.custom_vjp
    def fn(x, w_gate, w_up, w_down, w_up_t, w_act_t):
        return ffn(x, w_gate, w_up, w_down, w_up_t, w_act_t)

    def fwd(x, w_gate, w_up, w_down, w_up_t, w_act_t):
        return ffn(x, w_gate, w_up, w_down, w_up_t, w_act_t), (x, w_gate, w_up, w_down, w_up_t, w_act_t)

    def bwd(res, g):
        x, w_gate, w_up, w_down, w_up_t, w_act_t = res
        _, vjp = jax.vjp(xla.ffn, x, w_gate, w_up, w_down)
        zero = lambda a: None if a is None else jnp.zeros_like(a)
        return (*vjp(g), zero(w_up_t), zero(w_act_t))

    fn.defvjp(fwd, bwd)
    return fn


def _check_tiling(tile: int, capacity: int) -> None:
    if not isinstance(tile, int) or tile <= 0 or tile % 32 or tile > MAX_TILE:
        raise ValueError(f"tile must be a positive multiple of 32 and at most {MAX_TILE}, got {tile!r}")
    if not isinstance(capacity, int) or not 1 <= capacity <= tile:
        raise ValueError(f"capacity must be an int in [1, tile={tile}], got {capacity!r}")


def _check_hybrid_layout(width: int, backup_capacity: int | None) -> None:
    if not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be a positive int, got {width!r}")
    if backup_capacity is not None and (not isinstance(backup_capacity, int) or backup_capacity < 0):
        raise ValueError(f"backup_capacity must be a non-negative int or None, got {backup_capacity!r}")


def _flatten_tokens(x: jax.Array) -> tuple[jax.Array, tuple[int, ...]]:
    return x.reshape(-1, x.shape[-1]), x.shape[:-1]


def pack_twell(
    a: jax.Array,
    *,
    tile: int = DEFAULT_TILE,
    capacity: int = DEFAULT_CAPACITY,
    implementation: str | None = None,
) -> TwELL:
    """Packs a dense activation into TwELL.

    Args:
      a: ``[..., M, f]`` bf16, f16 or f32, mostly exact zeros.
      tile: columns per tile, a multiple of 32 (default 256).
      capacity: entries kept per (row, tile), at most ``tile`` (default 32).
      implementation: "reference", "cuda" or None (cuda where available, else reference).
    Returns:
      :class:`jax_twell.TwELL` with values ``[..., M, ceil(f/tile), capacity]``.
      Tiles with more than ``capacity`` non-zeros keep their true count (flagged).
    """
    check_activation("a", a)
    _check_tiling(tile, capacity)
    kernels = dict(
        reference=functools.partial(pack_twell_reference, tile=tile, capacity=capacity),
        cuda=functools.partial(cuda.pack_twell, tile=tile, capacity=capacity),
    )
    return _choose("pack_twell", implementation, kernels, "reference")(a)


def pack_hybrid(
    a: jax.Array,
    *,
    width: int = DEFAULT_WIDTH,
    backup_capacity: int | None = None,
    implementation: str | None = None,
) -> Hybrid:
    """Packs a dense activation into the hybrid ELL + dense-backup format.

    Args:
      a: ``[..., M, f]`` bf16, f16 or f32.
      width: ELL entries per row (default 128).
      backup_capacity: dense backup rows; default ``M`` (always complete).
      implementation: "reference", "cuda" (the TwELL pack kernel with one tile per row
        gives the ELL part; f up to 32768) or None.
    Returns:
      :class:`jax_twell.Hybrid`; see its docs for rows past the width and the backup.
    """
    check_activation("a", a)
    if a.ndim < 2:
        raise ValueError(f"a must have shape [..., M, f], got {tuple(a.shape)}")
    _check_hybrid_layout(width, backup_capacity)
    f = a.shape[-1]
    row_tile = -(-f // 32) * 32

    def cuda_pack(a):
        # The TwELL pack kernel with one tile per row yields exactly the ELL part.
        rows = cuda.pack_twell(a, tile=row_tile, capacity=min(width, row_tile))
        return hybrid_from_row_twell(rows, a, width=width, backup_capacity=backup_capacity)

    kernels = dict(reference=functools.partial(pack_hybrid_reference, width=width, backup_capacity=backup_capacity))
    if row_tile <= MAX_TILE:
        kernels["cuda"] = cuda_pack
    return _choose("pack_hybrid", implementation, kernels, "reference")(a)


def gate_twell(
    x: jax.Array,
    w: jax.Array,
    *,
    tile: int = DEFAULT_TILE,
    capacity: int = DEFAULT_CAPACITY,
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
      tile, capacity, implementation: as in :func:`pack_twell`.
    Returns:
      TwELL of the ``[..., M, f]`` activation.
    """
    check_projection_args(x, w)
    _check_tiling(tile, capacity)
    kernels = dict(
        reference=lambda x, w: pack_twell_reference(relu_matmul(x, w), tile=tile, capacity=capacity),
        cuda=_vmap_folds_tokens(lambda x, w: cuda.gate_twell(x, w, tile=tile, capacity=capacity), flatten=False),
    )
    return _choose("gate_twell", implementation, kernels, "reference")(x, w)


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
        cuda=_vmap_folds_tokens(lambda *a: cuda.twell_ffn(*a), flatten=False, n_tokens=2),
    )
    if implementation is None and not cuda.supports(x.shape[-1], x.dtype):
        del kernels["cuda"]
    fn = _choose("twell_ffn", implementation, kernels, "reference")
    return fn(x, act, w_act, w_up, w_down)


def _check_fraction(fraction, name: str = "active_fraction") -> None:
    if fraction is not None and not (isinstance(fraction, numbers.Real) and 0.0 <= fraction <= 1.0):
        raise ValueError(f"{name} must be a Python float in [0, 1] or None, got {fraction!r}")


def sparse_ffn(
    x: jax.Array,
    w_gate: jax.Array | None,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    tile: int = DEFAULT_TILE,
    capacity: int = DEFAULT_CAPACITY,
    implementation: str | None = None,
    sharding: FFNSharding | None = None,
    w_up_t: jax.Array | None = None,
    active_fraction: float | None = None,
    w_act_t: jax.Array | None = None,
    union_fraction: float | None = None,
) -> jax.Array:
    """Inference FFN with a ReLU gate, computed on the sparse activation.

    Gated: ``y = (relu(x @ w_gate) * (x @ w_up)) @ w_down``; non-gated (``w_gate=None``):
    ``y = relu(x @ w_up) @ w_down``.

    Args:
      x: ``[..., d]`` bf16 (fast path) or f32.
      w_gate: ``[d, f]`` or None.  w_up: ``[d, f]``.  w_down: ``[f, d]``; all x's dtype.
      tile, capacity: TwELL layout (see :func:`pack_twell`).
      implementation: "reference" (TwELL in pure JAX), "xla" (dense), "cuda" (XLA gate
        matmul, TwELL pack kernel, fused up+down kernel) or None ("cuda" where the
        kernels are available, else "xla").
      sharding: run per shard of a device mesh (data and/or tensor parallel; see
        :class:`jax_twell.FFNSharding`); use it whenever the operands are sharded.
      w_up_t: optional ``[f, d]`` copy of ``w_up.T`` (gated only), sharded like ``w_down``.
        The CUDA kernels read rows of ``w_up.T``; without it "cuda" transposes ``w_up`` in
        each call (23 MB at d=2048, f=5632), which at decode sizes costs more than the
        sparse kernels save. A model that serves can keep it next to ``w_up``. The other
        implementations ignore it.
      active_fraction: "cuda" only: this layer's known fraction of active (token, neuron)
        pairs (a Python float, e.g. from ``TransformerLM.calibrate_ffn``). Decode-sized
        calls then pick the decode kernels or dense at trace time, with no device check
        (:meth:`jax_twell.ops.cuda.DenseCrossover.decode_wins`; the kernels need
        ``w_up_t`` when gated); larger calls where the rule predicts dense at that
        fraction run XLA's dense FFN with no device check
        (:meth:`~jax_twell.ops.cuda.DenseCrossover.sparse_predicted`). Other
        implementations ignore it.
      w_act_t: optional ``[f, d]`` copy of the activation's weight transposed
        (``w_gate.T`` gated, ``w_up.T`` non-gated), sharded like ``w_down``. "cuda" only:
        with ``active_fraction`` known, calls of at most
        ``DenseCrossover.decode_rows_max_tokens`` tokens (1 by default) where the decode
        kernels win then run :func:`jax_twell.ops.cuda.decode_ffn_rows` (the whole FFN in
        two launches from weights stored by neuron; gated it also needs ``w_up_t``). The
        other implementations ignore it.
      union_fraction: "cuda" only: this layer's measured mean union of active neurons over
        64-token blocks, as a fraction of f (a Python float;
        :func:`jax_twell.ops.cuda.block_union_fraction` on its gate activations). With
        ``active_fraction`` it prices the union kernels at trace time by the rows they will
        read instead of the uniform pattern's union (a trained layer's is about half as
        large at the same density, so more layers run sparse). Other implementations
        ignore it.
    Returns:
      y: ``[..., d]`` dtype of x.

    Gradients: "reference" and "xla" are differentiated by JAX; "cuda" has a VJP that
    recomputes the dense formula with XLA (exact, at dense cost; nothing extra kept between
    forward and backward; zero cotangents for the ``w_up_t`` and ``w_act_t`` copies). To
    train on sparse kernels, use :func:`sparse_ffn_train`.

    Dense crossover: "cuda" checks each call's true number of active pairs on the device
    and runs the up and down projections dense through XLA where the fused kernel would
    be slower (rule: :class:`jax_twell.ops.cuda.DenseCrossover`; inspect it with
    ``jax_twell.ops.cuda.dense_crossover()``, replace it with ``set_dense_crossover``).
    """
    check_ffn_args(x, w_gate, w_up, w_down)
    _check_tiling(tile, capacity)
    _check_fraction(active_fraction)
    _check_fraction(union_fraction, "union_fraction")
    if w_up_t is not None:
        if w_gate is None:
            raise ValueError("w_up_t applies to the gated FFN only (non-gated, w_up is the activation's weight)")
        if w_up_t.shape != w_up.shape[::-1] or w_up_t.dtype != w_up.dtype:
            raise ValueError(f"w_up_t must be w_up.T: shape {w_up.shape[::-1]} {w_up.dtype}, got {w_up_t.shape} {w_up_t.dtype}")
    if w_act_t is not None:
        w_act = w_up if w_gate is None else w_gate
        name = "w_up" if w_gate is None else "w_gate"
        if w_act_t.shape != w_act.shape[::-1] or w_act_t.dtype != w_act.dtype:
            raise ValueError(
                f"w_act_t must be {name}.T: shape {w_act.shape[::-1]} {w_act.dtype}, got {w_act_t.shape} {w_act_t.dtype}"
            )
    ignore_t = lambda op: lambda x, wg, wu, wd, w_up_t=None, w_act_t=None: op(x, wg, wu, wd)
    cuda_ffn = _dense_formula_gradients(
        _vmap_folds_tokens(
            lambda x, wg, wu, wd, w_up_t, w_act_t: cuda.sparse_ffn(
                x, wg, wu, wd, tile=tile, capacity=capacity, w_up_t=w_up_t, active_fraction=active_fraction,
                w_act_t=w_act_t, union_fraction=union_fraction,
            ),
            flatten=True,
        )
    )
    kernels = dict(
        reference=ignore_t(functools.partial(reference.ffn, tile=tile, capacity=capacity)),
        xla=ignore_t(xla.ffn),
        cuda=lambda x, wg, wu, wd, w_up_t=None, w_act_t=None: cuda_ffn(x, wg, wu, wd, w_up_t, w_act_t),
    )
    if implementation is None and not cuda.supports(x.shape[-1], x.dtype):
        del kernels["cuda"]  # shapes the kernel does not take run dense
    fn = _choose("sparse_ffn", implementation, kernels, "xla")
    x2, lead = _flatten_tokens(x)
    # Positional: the default implementation's platform switch takes no keywords.
    if sharding is not None:
        y = shard_ffn(fn, sharding, x2, w_gate, w_up, w_down, w_up_t=w_up_t, w_act_t=w_act_t)
        return y.reshape(*lead, x.shape[-1])
    return fn(x2, w_gate, w_up, w_down, w_up_t, w_act_t).reshape(*lead, x.shape[-1])


def sparse_ffn_train(
    x: jax.Array,
    w_gate: jax.Array | None,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    width: int = DEFAULT_WIDTH,
    backup_capacity: int | None = None,
    implementation: str | None = None,
    sharding: FFNSharding | None = None,
    active_fraction: float | None = None,
    union_fraction: float | None = None,
) -> tuple[jax.Array, FFNAux]:
    """Training FFN: output, L1 term and sparsity statistics, differentiable.

    Same math as :func:`sparse_ffn`. The L1 term is ``mean over tokens of sum_f |h|``
    (the per-token sum; DESIGN note: the paper's per-element mean is f times weaker);
    add ``coefficient * aux.l1`` to the loss. Gradients equal ``jax.grad`` of the dense
    formula plus that term.

    Args:
      x: ``[..., d]`` bf16 or f32.  w_gate: ``[d, f]`` or None (non-gated).
      w_up: ``[d, f]``.  w_down: ``[f, d]``.
      width: hybrid-format ELL width; rows with more active neurons go to the dense backup
        (and count in ``aux.rows_over_capacity``).
      backup_capacity: dense backup rows (default: all tokens). When more rows overflow,
        the op takes the dense path for that call (exact, and faster at that density).
      implementation: "reference" (hybrid format, sparse custom_vjp backward in pure JAX),
        "xla" (dense, JAX autodiff), "cuda" (training kernels on the blocked TwELL layout,
        sparse residuals, per-call dense crossover: :mod:`jax_twell.ops.cuda_train`; d a
        multiple of 64; f32 runs dense; ``width`` sets the entry budget) or None ("xla"
        until the training kernels are measured: ``cuda_train.TRAINING_KERNELS_DEFAULT``).
      sharding: run per shard of a device mesh (see :class:`jax_twell.FFNSharding`);
        statistics are combined exactly across shards.
      active_fraction: "cuda" only: this layer's expected fraction of active (token,
        neuron) pairs (a Python float, e.g. ``aux.nnz_mean / f`` over recent steps). The
        sparse-or-dense choice is then made at trace time, per layer, and the dense side
        is plain XLA autodiff; None decides per call on the device (see
        :func:`jax_twell.ops.cuda_train.ffn_with_aux`). Other implementations ignore it.
      union_fraction: "cuda" only, with ``active_fraction``: this layer's measured mean
        union of active neurons over 64-token blocks, as a fraction of f (a Python float;
        :func:`jax_twell.ops.cuda.block_union_fraction` on its gate activations). The
        training rule then prices the union products by it instead of the uniform
        pattern's union (a trained layer's is smaller at the same density, so it stays on
        the kernels to a higher density). Other implementations ignore it.
    Returns:
      ``(y [..., d], FFNAux)``.
    """
    check_ffn_args(x, w_gate, w_up, w_down)
    _check_hybrid_layout(width, backup_capacity)
    _check_fraction(active_fraction)
    _check_fraction(union_fraction, "union_fraction")
    kernels = dict(
        reference=functools.partial(reference.ffn_with_aux, width=width, backup_capacity=backup_capacity),
        xla=xla.ffn_with_aux,
    )
    if implementation == "cuda" or (cuda_train.TRAINING_KERNELS_DEFAULT and cuda_train.supports(x.shape[-1], x.dtype)):
        kernels["cuda"] = functools.partial(
            cuda_train.ffn_with_aux, width=width, backup_capacity=backup_capacity, active_fraction=active_fraction,
            union_fraction=union_fraction,
        )
    fn = _choose("sparse_ffn_train", implementation, kernels, "xla")
    x2, lead = _flatten_tokens(x)
    if sharding is not None:
        y, aux = shard_ffn_train(fn, sharding, width, x2, w_gate, w_up, w_down)
    else:
        y, l1, counts, fired = fn(x2, w_gate, w_up, w_down)
        aux = make_aux(l1, counts, fired, width)
    return y.reshape(*lead, x.shape[-1]), aux
