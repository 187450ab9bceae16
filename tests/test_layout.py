"""jax_twell.ops.layout against the CUDA sources: each Python constant equals the
``constexpr`` it mirrors (parsed from ffi/, no GPU needed), so a change on one side only
fails here instead of as a wrong workspace size on the GPU."""

import pathlib
import re

import pytest

from jax_twell.ops import layout

FFI = pathlib.Path(__file__).resolve().parent.parent / "ffi"

# (Python name, CUDA file, CUDA constant)
MIRRORED = [
    ("BLOCK_TOKENS", "twell_blocked.cuh", "kBlockTokens"),
    ("UP_COLS", "twell_blocked.cuh", "kUpCols"),
    ("UP_LANES", "twell_blocked.cuh", "kUpLanes"),
    ("DOWN_COLS", "twell_blocked.cuh", "kDownCols"),
    ("MAX_TILE", "twell_blocked.cuh", "kMaxTile"),
    ("RECOMPUTE_FLAG", "twell_blocked.cuh", "kFlag"),
    ("COLUMN_MASK", "twell_blocked.cuh", "kColumnMask"),
    ("WORD_TOKEN_SHIFT", "twell_blocked.cuh", "kWordTokenShift"),
    ("UNION_TOKENS", "twell_union.h", "kTok"),
    ("UNION_CHUNK", "twell_union.h", "kChunk"),
    ("UNION_COLS", "twell_union.h", "kCols"),
    ("UNION_UP_NEURONS", "twell_union.h", "kUpNeurons"),
    ("UNION_MAX_F", "twell_union.h", "kMaxF"),
    ("WALK_GROUP", "twell_stationary.cuh", "kStatGroup"),
    ("WALK_CHUNK", "twell_stationary.cuh", "kStatChunk"),
    ("SMEM_LIMIT", "twell_stationary.cuh", "kStatSmemLimit"),
    ("TOKEN_SHIFT", "twell_train.cu", "kTokenShift"),
    ("GATE_TILE", "twell_gate_epilogue.cuh", "kGateTileN"),
    ("GATE_MAX_CAPACITY", "twell_gate_epilogue.cuh", "kGateMaxCapacity"),
    ("DECODE_TILE", "twell_decode.cu", "kDecTile"),
    ("DECODE_MAX_D", "twell_decode.cu", "kMaxD"),
    ("DECODE_MAX_F", "twell_decode.cu", "kMaxF"),
    ("DECODE_GATE_COLS", "twell_decode.cu", "kGateCols"),
    ("DECODE_GATE_K", "twell_decode.cu", "kGateK"),
    ("DECODE_GATE_MAX_SPLITS", "twell_decode.cu", "kGateMaxSplits"),
    ("DECODE_GATE_MAX_TOKENS", "twell_decode.cu", "kMaxGateTokens"),
    ("DECODE_ROWS_MAX_TOKENS", "twell_decode_rows.cu", "kRowsMaxTokens"),
    ("DECODE_ROWS_MAX_D", "twell_decode_rows.cu", "kRowsMaxD"),
    ("DECODE_ROWS_MAX_F", "twell_decode_rows.cu", "kRowsMaxF"),
]


def cuda_constants(name: str) -> dict[str, int]:
    """``constexpr`` integers of one ffi source whose value is a literal expression of
    integers and constants defined before it (``+ - * / << ( )``, hex, ``u`` suffixes)."""
    text = (FFI / name).read_text()
    values: dict[str, int] = {}
    pattern = r"constexpr\s+(?:int|uint32_t|int64_t|size_t)\s+(k\w+)\s*=\s*([^;]+);"
    for const, expr in re.findall(pattern, text):
        expr = re.sub(r"(0x[0-9a-fA-F]+|\d+)u\b", r"\1", expr)
        expr = re.sub(r"\bk\w+\b", lambda m: str(values[m.group(0)]) if m.group(0) in values else m.group(0), expr)
        if re.fullmatch(r"[\d\sxa-fA-F+\-*/<>()]+", expr):
            values[const] = int(eval(expr.replace("/", "//")))  # integer arithmetic, as C++'s on ints
    return values


@pytest.mark.parametrize("py_name,source,cuda_name", MIRRORED, ids=[m[0] for m in MIRRORED])
def test_layout_constant_matches_the_cuda_source(py_name, source, cuda_name):
    values = cuda_constants(source)
    assert cuda_name in values, f"{cuda_name} not found as a constexpr in ffi/{source}"
    assert getattr(layout, py_name) == values[cuda_name], f"layout.{py_name} != ffi/{source} {cuda_name}"


def test_derived_bounds_match_the_cuda_source():
    """The stationary walk's largest f (shared memory of the sort's key counts), and the
    rows of the row kernel's register tiling, derived as the sources derive them."""
    stat = cuda_constants("twell_stationary.cuh")
    assert layout.WALK_MAX_F == stat["kStatMaxF"] == 14524
    assert layout.WALK_MAX_F16 == 7264
    row = cuda_constants("twell_ffn.cu")
    assert layout.ROW_MAX_D_BYTES == row["kWarps"] * row["kMaxChunksPerWarp"] * 32 * 16
    assert cuda_constants("twell_decode_rows.cu")["kRowsPerCta"] == layout.DECODE_ROWS_NEURONS
