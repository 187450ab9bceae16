"""Packing a dense activation into the sparse formats: ``pack_twell`` (inference) and
``pack_hybrid`` (training). The pure-JAX references that define both formats live with
them in :mod:`jax_twell.formats`; the CUDA binding is :mod:`jax_twell.ops.pack.binding`.
Formats: docs/design.md, section 3 (Formats).
"""

from __future__ import annotations

import functools

import jax

from jax_twell.formats import Hybrid, TwELL, hybrid_from_row_twell, pack_hybrid_reference, pack_twell_reference
from jax_twell.ops import layout
from jax_twell.ops.common import check_activation, check_tiling, choose
from jax_twell.ops.pack import binding

__all__ = ["pack_twell", "pack_hybrid", "check_hybrid_layout"]


def check_hybrid_layout(width: int, backup_capacity: int | None) -> None:
    if not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be a positive int, got {width!r}")
    if backup_capacity is not None and (not isinstance(backup_capacity, int) or backup_capacity < 0):
        raise ValueError(f"backup_capacity must be a non-negative int or None, got {backup_capacity!r}")


def pack_twell(
    a: jax.Array,
    *,
    tile: int = 256,
    capacity: int = 32,
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
    check_tiling(tile, capacity)
    kernels = dict(
        reference=functools.partial(pack_twell_reference, tile=tile, capacity=capacity),
        cuda=functools.partial(binding.pack_twell, tile=tile, capacity=capacity),
    )
    return choose("pack_twell", implementation, kernels, "reference")(a)


def pack_hybrid(
    a: jax.Array,
    *,
    width: int = 128,
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
    check_hybrid_layout(width, backup_capacity)
    f = a.shape[-1]
    row_tile = -(-f // 32) * 32

    def cuda_pack(a):
        # The TwELL pack kernel with one tile per row yields exactly the ELL part.
        rows = binding.pack_twell(a, tile=row_tile, capacity=min(width, row_tile))
        return hybrid_from_row_twell(rows, a, width=width, backup_capacity=backup_capacity)

    kernels = dict(reference=functools.partial(pack_hybrid_reference, width=width, backup_capacity=backup_capacity))
    if row_tile <= layout.MAX_TWELL_TILE:
        kernels["cuda"] = cuda_pack
    return choose("pack_hybrid", implementation, kernels, "reference")(a)
