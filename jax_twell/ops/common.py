"""Pieces shared by the ops: argument checks, the choice of an implementation, vmap
folding and shard_map helpers."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_twell import _cpu, _kernels
from jax_twell.ops import layout

__all__ = [
    "IMPLEMENTATIONS",
    "all_finite",
    "as_dense_nonfinite",
    "finite_columns",
    "check_ffn_args",
    "check_activation",
    "check_projection_args",
    "check_tiling",
    "choose",
    "fold_vmap_into_tokens",
    "flatten_tokens",
    "sum_over_shards",
    "varying_axes",
    "as_varying",
    "mesh_axes",
]

IMPLEMENTATIONS = ("reference", "xla", "cuda", "cpu")
_FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def _check_float(name: str, a) -> None:
    if not hasattr(a, "dtype") or not hasattr(a, "shape"):
        raise TypeError(f"{name} must be an array, got {type(a).__name__}")
    if a.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be bf16, f16 or f32, got {a.dtype}")


def all_finite(*arrays) -> jax.Array:
    """``[]`` bool on the device: every element of ``arrays`` (None skipped) is finite.

    The sparse paths skip the products of inactive neurons, where the dense formula
    multiplies zeros by the weights and the inputs: a NaN or Inf there reaches y only
    through those products. Where a path already chooses its side on the device, it takes
    the dense side whenever this is false (docs/design.md, section 1, Guarantees).
    """
    ok = jnp.ones((), bool)
    for a in arrays:
        if a is not None and a.size:
            ok = ok & jnp.isfinite(a).all()
    return ok


def finite_columns(w_up: jax.Array | None, w_down: jax.Array, w_act: jax.Array | None = None) -> jax.Array:
    """``[d]`` bool: the output columns the weights leave finite in the dense formula.

    A NaN or Inf in ``w_down[n, j]`` reaches ``y[:, j]`` of every token (through
    ``0 * w_down[n, j]`` where neuron n is inactive); one in the up weight (gated FFN;
    pass None for the non-gated one, whose activation weight acts through the gate) reaches
    every output. The gate's own NaN and Inf reach y through the entries it packs; with
    ``w_act`` (the activation's weight) given, a NaN in it marks every output too (as
    relu(NaN) * u does in the dense formula), for paths that recompute overflowed gate
    tiles, where a NaN entry would not count as active.
    """
    cols = jnp.isfinite(w_down).all(axis=0)
    if w_up is not None:
        cols = cols & jnp.isfinite(w_up).all()
    return cols if w_act is None else cols & ~jnp.isnan(w_act).any()


def as_dense_nonfinite(y: jax.Array, x: jax.Array, columns: jax.Array) -> jax.Array:
    """``y`` of a sparse path with NaN where the dense formula is not finite but y is:
    the rows of a non-finite ``x`` and the ``columns`` (``[d]`` bool, :func:`finite_columns`)
    the weights make non-finite. Where y already holds NaN or Inf (the entries the path
    computed) it is kept, as the dense formula's sum has it. One elementwise pass over y."""
    poison = ~(jnp.isfinite(x).all(axis=-1, keepdims=True) & columns)
    return jnp.where(poison & jnp.isfinite(y), jnp.asarray(jnp.nan, y.dtype), y)


def check_ffn_args(x, w_gate, w_up, w_down) -> tuple[int, int]:
    """Validates FFN operands; returns (d, f). Raises naming the offending argument.

    x: ``[..., d]``; w_gate: ``[d, f]`` or None (non-gated); w_up: ``[d, f]``;
    w_down: ``[f, d]``; all one floating dtype.
    """
    _check_float("x", x)
    if x.ndim < 1:
        raise ValueError("x must have shape [..., d], got a scalar")
    d = x.shape[-1]
    _check_float("w_up", w_up)
    if w_up.ndim != 2 or w_up.shape[0] != d:
        raise ValueError(f"w_up must have shape [d, f] = [{d}, f], got {tuple(w_up.shape)}")
    f = w_up.shape[1]
    if w_gate is not None:
        _check_float("w_gate", w_gate)
        if tuple(w_gate.shape) != (d, f):
            raise ValueError(f"w_gate must have shape [d, f] = [{d}, {f}] like w_up, got {tuple(w_gate.shape)}")
    _check_float("w_down", w_down)
    if tuple(w_down.shape) != (f, d):
        raise ValueError(f"w_down must have shape [f, d] = [{f}, {d}], got {tuple(w_down.shape)}")
    dtypes = {a.dtype for a in (x, w_gate, w_up, w_down) if a is not None}
    if len(dtypes) != 1:
        raise TypeError(f"x and the weights must share one dtype, got {sorted(str(t) for t in dtypes)}")
    return d, f


def check_projection_args(x, w, name: str = "w") -> None:
    """Validates ``x [..., d]`` and a projection ``w [d, f]`` of the same floating dtype."""
    _check_float("x", x)
    if x.ndim < 1:
        raise ValueError("x must have shape [..., d], got a scalar")
    _check_float(name, w)
    if w.ndim != 2 or w.shape[0] != x.shape[-1]:
        raise ValueError(f"{name} must have shape [d, f] = [{x.shape[-1]}, f], got {tuple(w.shape)}")
    if w.dtype != x.dtype:
        raise TypeError(f"x and {name} must share one dtype, got {x.dtype} and {w.dtype}")


def check_activation(name: str, a) -> None:
    """Validates a dense activation operand ``[..., f]`` of a floating dtype."""
    _check_float(name, a)
    if a.ndim < 1:
        raise ValueError(f"{name} must have shape [..., f], got a scalar")


def check_tiling(tile: int, capacity: int) -> None:
    if not isinstance(tile, int) or tile <= 0 or tile % 32 or tile > layout.MAX_TWELL_TILE:
        raise ValueError(f"tile must be a positive multiple of 32 and at most {layout.MAX_TWELL_TILE}, got {tile!r}")
    if not isinstance(capacity, int) or not 1 <= capacity <= tile:
        raise ValueError(f"capacity must be an int in [1, tile={tile}], got {capacity!r}")


def flatten_tokens(x: jax.Array) -> tuple[jax.Array, tuple[int, ...]]:
    return x.reshape(-1, x.shape[-1]), x.shape[:-1]


def choose(op: str, implementation: str | None, kernels: dict, portable: str):
    """Returns the callable for ``implementation`` among ``kernels`` (name -> fn).

    None: per lowering platform (``lax.platform_dependent``), "cuda" on CUDA devices and
    "cpu" on the CPU where those kernels are present and loaded, ``portable`` elsewhere."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{op}: implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    if implementation is None:
        fallback = kernels[portable]
        branches = {}
        if "cuda" in kernels and _kernels.kernels_available():
            branches["cuda"] = kernels["cuda"]
        if "cpu" in kernels and _cpu.cpu_kernels_available():
            branches["cpu"] = kernels["cpu"]
        if not branches:
            return fallback

        def auto(*args):
            return jax.lax.platform_dependent(*args, **branches, default=fallback)

        return auto
    if implementation not in kernels:
        raise NotImplementedError(f"{op}: no {implementation!r} implementation; available: {sorted(kernels)}")
    if implementation == "cuda" and not _kernels.kernels_available():
        raise RuntimeError(f"{op}: implementation='cuda' but the kernels are unavailable: {_kernels.kernel_status().reason}")
    if implementation == "cpu" and not _cpu.cpu_kernels_available():
        raise RuntimeError(f"{op}: implementation='cpu' but the CPU kernels are unavailable: {_cpu.cpu_kernel_status().reason}")
    return kernels[implementation]


def fold_vmap_into_tokens(fn, *, flatten: bool, n_tokens: int = 1):
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
    :func:`jax_twell.ops.ffn.vjp.dense_formula_gradients`)."""

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


def sum_over_shards(grad: jax.Array | None, primal: jax.Array | None) -> jax.Array | None:
    """Under shard_map, a cotangent of an operand replicated over mesh axes is the sum of
    the per-shard contributions over those axes (what JAX's own transposes produce)."""
    if grad is None:
        return None
    axes = tuple(sorted(varying_axes(grad) - varying_axes(primal)))
    return jax.lax.psum(grad, axes) if axes else grad


varying_axes = _kernels.varying_axes
mesh_axes = _kernels.mesh_axes
as_varying = _kernels.as_varying
