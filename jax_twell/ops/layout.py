"""Layout constants of the CUDA kernels, and the shape tests their handlers make.

One place for every number the Python side shares with ffi/ (each names the CUDA
constant it mirrors; ``tests/test_layout.py`` parses the headers and checks them). The
``*_supported`` predicates repeat the handlers' own tests, so a plan never sends a shape
to a kernel that would refuse it. Formats: docs/design.md, section 3 (Formats).
"""

from __future__ import annotations

import jax.numpy as jnp

_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# --- TwELL --------------------------------------------------------------------------------
MAX_TWELL_TILE = 32768  # column offsets within a tile are int16

# --- row kernel (ffi/twell_ffn.cu) -------------------------------------------------------
ROW_MAX_D_BYTES = 16384  # 8 warps x kMaxChunksPerWarp 4 x 32 lanes x 16 bytes

# --- token-blocked layout (ffi/twell_blocked.cuh) ----------------------------------------
BLOCK_TOKENS = 1024  # kBlockTokens: tokens of a block sharing each weight slab
UP_COLS = 64  # kUpCols: model columns per up CTA (d a multiple of this)
UP_LANES = 8  # kUpLanes: lanes per token in the up step, 8 columns each
DOWN_COLS = 32  # kDownCols: model columns per down CTA
MAX_TILE = 256  # kMaxTile: a tile's weight slab is staged in shared memory
BLOCKED_MAX_D = 16384  # the blocked handlers' bound on d
RECOMPUTE_FLAG = 0x8000  # kFlag: entry of an overflowed tile
COLUMN_MASK = 0xFF  # kColumnMask: column within the tile
WORD_TOKEN_SHIFT = 8  # kWordTokenShift: token % 32 in bits 8-12
BLOCKED_MIN_TOKENS = 256  # below, the row kernel reads fewer weight bytes than a block

# --- union products (ffi/twell_union.h) --------------------------------------------------
UNION_TOKENS = 64  # kTok: tokens per sub-block
UNION_CHUNK = 32  # kChunk: union rows per K step
UNION_COLS = 256  # kCols: output columns per consumer warp group
UNION_UP_NEURONS = 256  # kUpNeurons: the up product's union neurons per CTA
UNION_MAX_F = 65536  # kMaxF

# --- stationary walk (ffi/twell_stationary.cuh) ------------------------------------------
WALK_GROUP = 16  # kStatGroup: tokens walked together
WALK_CHUNK = 1024  # kStatChunk: tokens a CTA of the sort's passes
SMEM_LIMIT = 232448  # kStatSmemLimit: shared memory a CTA may have (H100/H200)
WALK_MAX_F16 = SMEM_LIMIT // (2 * 16)  # the 16-column slice of Wd within shared memory: 7,264
WALK_MAX_F = 4 * (SMEM_LIMIT // (2 * WALK_CHUNK // 32) - 1)  # kStatMaxF: 14,524

# --- training kernels (ffi/twell_train.cu) -----------------------------------------------
TRAIN_TILE = 256  # the training layout's TwELL tile
TRAIN_CAPACITY = 32  # ... and capacity
TOKEN_SHIFT = 18  # kTokenShift: by_col word, token in block << 18 | entry within the segment

# --- fused gate (ffi/twell_gate_epilogue.cuh) --------------------------------------------
GATE_TILE = 256  # kGateTileN
GATE_MAX_CAPACITY = 64  # kGateMaxCapacity

# --- decode kernels (ffi/twell_decode.cu, ffi/twell_decode_rows.cu) ----------------------
DECODE_TILE = 256  # kDecTile: the decode kernel's column tile (its workspace layout)
DECODE_MAX_D = 8192  # kMaxD
DECODE_MAX_F = 50000  # kMaxF
DECODE_GATE_COLS = 128  # kGateCols: the decode gate kernel's column block
DECODE_GATE_K = 64  # kGateK: W rows per stage
DECODE_GATE_MAX_SPLITS = 8  # kGateMaxSplits: the portable cluster size
DECODE_GATE_MAX_TOKENS = 64  # kMaxGateTokens
DECODE_ROWS_MAX_TOKENS = 4  # kRowsMaxTokens
DECODE_ROWS_NEURONS = 16  # kRowsPerCta: neurons per CTA of the rows kernel
DECODE_ROWS_MAX_D = 8192  # kRowsMaxD
DECODE_ROWS_MAX_F = 1 << 20  # kRowsMaxF


# --- union layout sizes and tests --------------------------------------------------------
def uniform_union(active_fraction):
    """Mean union of active neurons over a block of ``UNION_TOKENS`` tokens, as a fraction
    of f, for the uniform pattern at ``active_fraction``: ``1 - (1 - p)^64`` (float or array)."""
    return 1.0 - (1.0 - active_fraction) ** UNION_TOKENS


def union_workspace_ints(m: int, max_entries: int, gated: bool) -> int:
    """int32 words of the union layout (``UnionLayoutOf``) for ``m`` tokens."""
    r = 2 if gated else 1
    n_sub = -(-m // UNION_TOKENS)
    re = r * max_entries
    return 4 * n_sub + re + (re + UNION_CHUNK * n_sub) + (re // UNION_CHUNK + 2 * n_sub + 1)


def union_up_workspace_ints(m: int, max_entries: int) -> int:
    """int32 words of the up step's layout (``UnionLayoutOf(s, 1, base, 2)``): two words an entry."""
    n_sub = -(-m // UNION_TOKENS)
    return (4 * n_sub + 2 * max_entries + (max_entries + UNION_CHUNK * n_sub)
            + (max_entries // UNION_CHUNK + 2 * n_sub + 1))


def union_dx_supported(m: int, d: int, f: int, max_entries: int, gated: bool) -> bool:
    """The handlers' test for a union product: d a multiple of 256, f at most 65536, the
    layout below 2^31 words."""
    return d % UNION_COLS == 0 and f <= UNION_MAX_F and union_workspace_ints(m, max_entries, gated) < 2**31


def union_down_supported(m: int, d: int, f: int, max_entries: int) -> bool:
    """A down step as a union product: :func:`union_dx_supported` with one row a neuron, its
    layout within the up step's partials ``[d / 64, max_entries]`` f32."""
    return union_dx_supported(m, d, f, max_entries, False) and (
        union_workspace_ints(m, max_entries, False) <= (d // UP_COLS) * max_entries)


def union_up_supported(m: int, d: int, f: int, max_entries: int) -> bool:
    """The up step as a union product (``UnionUpSupported``): f at most 65536 and its layout,
    after row 0 of the partials (rounded to an even word), within them (d at least 320)."""
    offset = max_entries + (max_entries & 1)
    return f <= UNION_MAX_F and d // UP_COLS >= 2 and (
        offset + union_up_workspace_ints(m, max_entries) <= (d // UP_COLS) * max_entries)


# --- stationary walk sizes and tests -----------------------------------------------------
def walk_cols(f: int) -> int:
    """Output columns a walk CTA owns: 16 where the slice (f x 32 bytes) fits, else 8."""
    return 16 if f <= WALK_MAX_F16 else 8


def walk_keys(f: int) -> int:
    """Sort keys ``ceil(c / 4)`` for at most f entries a token: ``0 .. ceil(f / 4)``."""
    return (f + 3) // 4 + 1


def walk_order_words(m: int) -> int:
    """Words of the tokens' order (``StatOrderWords``): ranks, order in groups, group offsets."""
    groups = -(-m // WALK_GROUP)
    return m + groups * WALK_GROUP + groups + 1


def walk_layout_words(m: int, f: int, max_entries: int) -> int:
    """Words of one walk layout (``StatLayout::glay_words``), 16-byte aligned."""
    return (max_entries + 3 * m + 16 * (f + 3) + 3) // 4 * 4


def walk_workspace_words(m: int, f: int, max_entries: int) -> int:
    """Words of the down walk's workspace (``StatLayoutOf(...).total``)."""
    chunks = -(-m // WALK_CHUNK)
    groups = -(-m // WALK_GROUP)
    goff = chunks * walk_keys(f) + m + groups * WALK_GROUP
    glay = (goff + groups + 1 + 1 + 3) // 4 * 4
    return glay + walk_layout_words(m, f, max_entries)


def walk_words(m: int, d: int, f: int, max_entries: int, tables: int) -> int:
    """Words of a walk over ``tables`` tables (``StationaryWalkWords``): two tables add a
    second layout and the first walk's f32 sums (d per token, rounded up to a group)."""
    one = walk_workspace_words(m, f, max_entries)
    if tables == 1:
        return one
    return one + walk_layout_words(m, f, max_entries) + -(-m // WALK_GROUP) * WALK_GROUP * d


def walk_supported(m: int, d: int, f: int, max_entries: int, tables: int) -> bool:
    """The handlers' test (``StationaryWalkSupported``): f at most 14,524, d a multiple of
    :func:`walk_cols`, the workspace within the partials ``[d / 64, max_entries]`` f32."""
    return (0 < f <= WALK_MAX_F and d % walk_cols(f) == 0
            and walk_words(m, d, f, max_entries, tables) <= (d // UP_COLS) * max_entries)


def stationary_down_supported(m: int, d: int, f: int, max_entries: int) -> bool:
    """The down step with the weight stationary (``StationaryDownSupported``): one table."""
    return walk_supported(m, d, f, max_entries, 1)


# --- blocked layout sizes ------------------------------------------------------------------
def blocked_supported(d: int, tile: int) -> bool:
    """Whether the blocked kernels take this shape: d a multiple of 64, at most 16384, tile <= 256."""
    return d % UP_COLS == 0 and d <= BLOCKED_MAX_D and tile <= MAX_TILE


def blocked_max_entries(m: int, f: int, tile: int, capacity: int) -> int:
    """Static entry budget of the blocked workspace for ``m`` tokens: ``m * min(f // 32,
    n_tiles * capacity)`` (3.1% of f a token, never more than the TwELL's slots), at least
    one tile. Calls that need more run the row kernel (inference) or dense (training)."""
    n_tiles = -(-f // tile)
    return max(tile, m * min(f // 32, n_tiles * capacity))


def train_max_entries(m: int, f: int, width: int) -> int:
    """Entry budget of the training buffers: ``width`` entries a token on average (never
    more than the TwELL's slots), at least one tile."""
    n_tiles = -(-f // TRAIN_TILE)
    return max(TRAIN_TILE, m * min(width, n_tiles * TRAIN_CAPACITY))


def train_backup_buckets(m: int, capacity: int | None = None) -> tuple[int, ...]:
    """Static sizes of the training backup (the rows past the hybrid width, computed dense
    over their gathered rows): 0 (no row), then M/64, M/32, M/16, M/8 and M/4 rounded up to 8 rows,
    none past ``capacity`` (None: no limit) or M. A call runs the smallest that holds its
    rows; one with more rows than the last runs dense."""
    cap = m if capacity is None else min(m, capacity)
    return tuple(sorted({min(cap, _share_rows(m, k)) for k in (64, 32, 16, 8, 4)} | {0}))


def _share_rows(m: int, k: int) -> int:
    """M/k rows (at least one) rounded up to 8."""
    return -(-(m // k or 1) // 8) * 8


def train_backup_kept_rows(m: int, capacity: int | None = None, share: int = 32) -> int:
    """Rows of the training backup whose g and u the forward keeps for the backward: the
    largest size of :func:`train_backup_buckets` up to M/``share`` (0 where there is none).
    A call whose backed-up rows fit it skips the backward's recompute of their gate and up
    products; every call keeps ``[rows, f]`` of each (zeros where unused), so the size
    stays a small share of M."""
    return max((b for b in train_backup_buckets(m, capacity) if b <= _share_rows(m, share)), default=0)


def grad_workspace_ints(m: int, f: int, tile: int, max_entries: int) -> int:
    """Words of the weight gradients' neuron-major lists (``GradWorkspaceOf``): a 4-word
    record an entry, each tile's list starts, each segment's first record per neuron."""
    n_tiles = -(-f // tile)
    n_blocks = -(-m // BLOCK_TOKENS)
    return 4 * max_entries + n_tiles * (tile + 1) + n_blocks * n_tiles * tile


# --- shape tests of the kernels (the handlers refuse anything else) ------------------------
def check_row_supported(d: int, dtype) -> None:
    """Raises ValueError naming the constraint when the row kernel can't take ``d``: rows are
    read 16 bytes at a time, d a multiple of 8 (bf16/f16) or 4 (f32), at most 8192 or 4096."""
    itemsize = jnp.dtype(dtype).itemsize
    vec = 16 // itemsize
    if d % vec or d * itemsize > ROW_MAX_D_BYTES:
        raise ValueError(
            f"the fused TwELL FFN kernel needs d a multiple of {vec} and at most "
            f"{ROW_MAX_D_BYTES // itemsize} for {jnp.dtype(dtype).name}, got d={d}; use implementation='xla'"
        )


def row_supported(d: int, dtype) -> bool:
    """True when the row kernel takes model width ``d`` in ``dtype``."""
    try:
        check_row_supported(d, dtype)
    except ValueError:
        return False
    return True


def check_blocked_supported(d: int, tile: int) -> None:
    """Raises ValueError naming the constraint when the blocked kernel can't take the shape."""
    if d % UP_COLS or d > BLOCKED_MAX_D:
        raise ValueError(f"the blocked TwELL FFN kernel needs d a multiple of {UP_COLS} and at most "
                         f"{BLOCKED_MAX_D}, got d={d}; use Kernel.ROW")
    if tile > MAX_TILE:
        raise ValueError(f"the blocked TwELL FFN kernel needs tile <= {MAX_TILE}, got {tile}; use Kernel.ROW")


def check_train_supported(d: int) -> None:
    """Raises ValueError when the training kernels can't take ``d`` (a multiple of 64, at most 16384)."""
    if d % UP_COLS or d > BLOCKED_MAX_D:
        raise ValueError(f"the CUDA training FFN needs d a multiple of {UP_COLS} and at most "
                         f"{BLOCKED_MAX_D}, got d={d}; use implementation='xla' or 'reference'")


def train_supported(d: int) -> bool:
    """True when the training kernels take model width ``d``."""
    return d % UP_COLS == 0 and d <= BLOCKED_MAX_D


def decode_supported(d: int, f: int, dtype) -> bool:
    """The decode kernel: bf16 or f16, d a multiple of 8 and at most 8192, f at most 50,000."""
    return jnp.dtype(dtype) in _HALF and 0 < d <= DECODE_MAX_D and d % 8 == 0 and 0 < f <= DECODE_MAX_F


def decode_gate_supported(m: int, d: int, f: int) -> bool:
    """The decode gate kernel (with :func:`decode_supported`): at most 64 tokens, d a
    multiple of 16, f of 8."""
    return 0 < m <= DECODE_GATE_MAX_TOKENS and d % 16 == 0 and f % 8 == 0


def decode_rows_supported(m: int, d: int, f: int, dtype) -> bool:
    """The rows kernel: bf16 or f16, 1 to 4 tokens, d a multiple of 8 and at most 8192, f at most 2^20."""
    return (jnp.dtype(dtype) in _HALF and 0 < m <= DECODE_ROWS_MAX_TOKENS
            and 0 < d <= DECODE_ROWS_MAX_D and d % 8 == 0 and 0 < f <= DECODE_ROWS_MAX_F)


def fused_gate_supported(d: int, f: int, tile: int, capacity: int, dtype) -> bool:
    """The fused gate kernel: bf16 or f16, tile 256, capacity in [1, 64], d and f positive multiples of 8."""
    return (jnp.dtype(dtype) in _HALF and tile == GATE_TILE and 1 <= capacity <= GATE_MAX_CAPACITY
            and d > 0 and d % 8 == 0 and f > 0 and f % 8 == 0)


def fused_gate_variant(d: int) -> int:
    """The fused gate GEMM's configuration for width ``d`` (ffi/twell_gate.cu, attribute
    ``variant``): ping-pong 64 x 256 tiles (1) below d=4096, cooperative 128 x 256 (0) from it."""
    return 0 if d >= 4096 else 1


# --- the warp-per-token FFN (ffi/twell_ffn_warp.cu) ----------------------------------------
WARP_MAX_D = 2048  # kMaxChunks * kChunk: a row's x and y stay in registers
WARP_MAX_ENTRIES = 128  # kMaxList: the pipelined forms list a row's entries in shared memory
WARP_ROW_BUDGET = 64  # entries a row may hold and stay on the kernel (past it: the dense backup)
WARP_MIN_TOKENS = 2048  # from here the warp path measured at least XLA's dense FFN (M=2,048: 1.00x)


# Tokens from which the warp path's device backup runs on wgmma (ffi/twell_backup_gemm.cu)
# rather than mma.sync (ffi/twell_backup.cu). bf16, d=2048, f=5632, against the same call
# on the mma.sync backup (ffi/notes/twell_backup.md, "Second GPU run" and after): a known
# layer with log-normal row rates at M=4,096 0.440 -> 0.349 ms (1.00x -> 1.26x of XLA,
# H200), at 8,192 0.770 -> 0.601 ms; M=16,384 with 2% of the tokens at 10-50% of f 1.406 ->
# 1.335 ms (H100); every row backed up 6.6 -> 2.4 ms; an empty backup (uniform rows) at
# M=2,048 15 us slower (its CUTLASS launches), at 16,384 within the noise. Real
# activations have tails, so from 4,096 tokens.
GEMM_BACKUP_MIN_TOKENS = 4096


def device_backup_supported(f: int) -> bool:
    """Whether the device backup (``jax_twell.ops.ffn.warp.backup_rows``) takes an FFN of
    ``f`` neurons (its products copy rows in 16-byte pieces: f a multiple of 8; the warp
    kernel already needs d a multiple of 8)."""
    return f % 8 == 0


def warp_supported(d: int, dtype) -> bool:
    """True where the warp kernel takes rows of width ``d`` in ``dtype`` (bf16/f16, d a
    multiple of 8 up to :data:`WARP_MAX_D`)."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and d % 8 == 0 and 0 < d <= WARP_MAX_D


def warp_backup_size(m: int) -> int:
    """Static number of dense-backup rows of an M-token warp call: 1/8 of the tokens,
    rounded up to a multiple of 8, at least 8, at most M (the call runs the smallest of
    its sizes that holds the rows left, so a larger backup costs nothing when unused)."""
    rows = -(-m // 8)
    return min(m, max(8, -(-rows // 8) * 8))
