"""Pieces shared by every implementation of the FFN ops: argument checks and statistics."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["RuleSlot", "FFNAux", "check_ffn_args", "check_activation", "check_projection_args", "hidden_stats", "make_aux", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("reference", "xla", "cuda")
_FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


class RuleSlot:
    """The process-wide dispatch rule of one op (a crossover dataclass), read at trace time.

    ``get()`` returns it; ``set(rule)`` replaces it for later traces (a rule of the same
    type, else TypeError) and returns the previous one.
    """

    def __init__(self, rule):
        self._rule = rule

    def get(self):
        """The rule now in force."""
        return self._rule

    def set(self, rule):
        """Replaces the rule for later traces; returns the previous one."""
        kind = type(self._rule)
        if not isinstance(rule, kind):
            raise TypeError(f"rule must be a {kind.__name__}, got {type(rule).__name__}")
        previous, self._rule = self._rule, rule
        return previous


class FFNAux(NamedTuple):
    """Side outputs of the training FFN.

    Attributes:
      l1: ``[]`` f32, the L1 term: mean over tokens of ``sum_f |h|`` (the per-token sum,
        as in the public training code; the paper's text writes a per-element mean,
        which is ``f`` times weaker). Differentiable; multiply by the coefficient.
      nnz_mean: ``[]`` f32, mean active neurons per token (``relu`` gate > 0).
      nnz_max: ``[]`` int32, max active neurons of any token.
      rows_over_capacity: ``[]`` int32, tokens with more active neurons than the sparse
        format's row width (they take the dense-backup path).
      neuron_fired: ``[f]`` bool, neuron active for at least one token.
    """

    l1: jax.Array
    nnz_mean: jax.Array
    nnz_max: jax.Array
    rows_over_capacity: jax.Array
    neuron_fired: jax.Array


def hidden_stats(h: jax.Array, active: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Local statistics of ``h [M, f]`` with pattern ``active [M, f]`` bool.

    Returns ``(l1 [] f32, counts [M] int32, fired [f] bool)``: the L1 term (mean over
    tokens of sum_f |h|), active neurons per token, neurons active for any token.
    """
    l1 = jnp.abs(h.astype(jnp.float32)).sum() / max(h.shape[0], 1)
    return l1, active.sum(axis=-1, dtype=jnp.int32), active.any(axis=0)


def make_aux(l1: jax.Array, counts: jax.Array, fired: jax.Array, width: int) -> FFNAux:
    """FFNAux from the L1 term, per-token active counts ``[M]`` and fired neurons ``[f]``."""
    return FFNAux(
        l1=l1,
        nnz_mean=counts.astype(jnp.float32).mean() if counts.shape[0] else jnp.float32(0),
        nnz_max=counts.max(initial=0),
        rows_over_capacity=(counts > width).sum(dtype=jnp.int32),
        neuron_fired=fired,
    )


def _check_float(name: str, a) -> None:
    if not hasattr(a, "dtype") or not hasattr(a, "shape"):
        raise TypeError(f"{name} must be an array, got {type(a).__name__}")
    if a.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be bf16, f16 or f32, got {a.dtype}")


def check_ffn_args(x, w_gate, w_up, w_down) -> tuple[int, int]:
    """Validates FFN operands; returns (d, f). Raises naming the offending argument.

    x: ``[..., d]``; w_gate: ``[d, f]`` or None (non-gated); w_up: ``[d, f]``;
    w_down: ``[f, d]``; all one floating dtype.
    """
    _check_float("x", x)
    if x.ndim < 1:
        raise ValueError(f"x must have shape [..., d], got a scalar")
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
