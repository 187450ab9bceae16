"""The token-blocked FFN algorithm (NumPy model of ffi/twell_ffn_blocked.cu) against the
reference, on CPU: layout invariants, overflowed tiles recomputed, adversarial rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_twell.formats import pack_twell_reference, relu_matmul
from jax_twell.ops import blocked_emulation as emu
from jax_twell.ops import reference
from jax_twell.testing import synthetic_ffn_inputs, with_extreme_rows
from specs import assert_close, fused_tolerance

pytestmark = pytest.mark.slow  # the NumPy model of the blocked kernels: CI runs it (-m slow)



def _case(m, d, f, density, pattern, dtype, key, *, full=0, empty=0):
    inp = synthetic_ffn_inputs(jax.random.key(key), m, d, f, density=density, pattern=pattern, dtype=dtype)
    inp = with_extreme_rows(inp, full=full, empty=empty)
    return inp.x, inp


def _run(x, inp, gated, tile, capacity, max_entries=None):
    w_act = inp.w_gate
    w_up = inp.w_up if gated else None
    act = pack_twell_reference(relu_matmul(x, w_act), tile=tile, capacity=capacity)
    need = emu.needed_entries(np.asarray(act.counts), capacity, tile, act.f)
    y, ws = emu.blocked_ffn(
        x, act.values, act.cols, act.counts, w_act, w_up, None if w_up is None else w_up.T, inp.w_down,
        tile=tile, max_entries=max(need, 1) if max_entries is None else max_entries,
    )
    want = reference.twell_ffn(x, act, w_act, w_up, inp.w_down)
    return y, want, act, ws, need


CASES = [
    # m, d, f, density, pattern, empty rows, full rows
    (1, 64, 260, 0.05, "uniform", 0, 0),  # M=1, f not a multiple of the tile
    (3, 64, 520, 0.02, "uniform", 1, 1),  # an empty row and a row far over capacity
    (77, 128, 300, 0.05, "heavy", 5, 3),
    (1100, 64, 700, 0.02, "heavy", 10, 4),  # two token blocks, the second partial
    (64, 192, 256, 0.5, "dense", 0, 0),  # every tile overflowed
]


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"m{c[0]}_d{c[1]}_f{c[2]}_{c[4]}")
def test_emulation_matches_reference(case, gated):
    m, d, f, density, pattern, empty, full = case
    x, inp = _case(m, d, f, density, pattern, jnp.bfloat16, m + f, empty=empty, full=full)
    for tile, capacity in [(256, 32), (64, 4), (32, 1)]:
        y, want, act, ws, need = _run(x, inp, gated, tile, capacity)
        assert_close(y, want, fused_tolerance(jnp.bfloat16, f), f"{case} gated={gated} tile={tile} cap={capacity}")
        if full:
            assert bool(act.overflowed[0, : f // tile].all())
        if empty:
            assert int(act.counts[full].sum()) == 0


def test_emulation_f16():
    x, inp = _case(200, 64, 400, 0.05, "heavy", jnp.float16, 5, empty=2, full=2)
    for gated in (True, False):
        y, want, *_ = _run(x, inp, gated, 128, 8)
        assert_close(y, want, fused_tolerance(jnp.float16, 400), f"f16 gated={gated}")


def test_layout_invariants():
    """Segments tile the entry space in (block, tile, token) order; each token's entries of a
    tile are contiguous; overflowed tiles reserve their whole width, flagged."""
    x, inp = _case(1500, 64, 600, 0.03, "heavy", jnp.bfloat16, 9, empty=3, full=2)
    tile, capacity = 128, 8
    y, want, act, ws, need = _run(x, inp, True, tile, capacity)
    counts = np.asarray(act.counts)
    m, n_tiles = counts.shape
    n_blocks = -(-m // emu.BLOCK_TOKENS)
    assert ws.seg_start.shape == (n_blocks * n_tiles + 1,) and ws.seg_start[0] == 0
    assert ws.seg_start[-1] == need == emu.reserved(counts, capacity, tile, 600).sum()
    assert np.all(np.diff(ws.seg_start) == ws.tok_off[..., -1].reshape(-1))
    assert np.all(np.diff(ws.tok_off, axis=-1) >= 0)
    # Tokens past M reserve nothing.
    tail = ws.tok_off[-1, :, m - (n_blocks - 1) * emu.BLOCK_TOKENS :]
    assert np.all(tail == tail[:, :1])
    over = counts > capacity
    for t, k in zip(*np.nonzero(over)):
        b, i = t // emu.BLOCK_TOKENS, t % emu.BLOCK_TOKENS
        e0 = ws.seg_start[b * n_tiles + k] + ws.tok_off[b, k, i]
        width = min(tile, 600 - k * tile)
        words = ws.entries[e0 : e0 + width]
        assert np.all(words & emu.RECOMPUTE_FLAG) and np.array_equal(words & emu.COLUMN_MASK, np.arange(width))
        assert np.all((words >> emu.WORD_TOKEN_SHIFT) & 31 == t % 32)  # the token's row in its warp's run
    # Stored entries keep the tile's column order, unflagged, with h in the high half.
    t, k = np.argwhere((counts > 1) & ~over)[0]
    b, i = t // emu.BLOCK_TOKENS, t % emu.BLOCK_TOKENS
    e0 = ws.seg_start[b * n_tiles + k] + ws.tok_off[b, k, i]
    words = ws.entries[e0 : e0 + counts[t, k]]
    assert not np.any(words & emu.RECOMPUTE_FLAG)
    np.testing.assert_array_equal(words & emu.COLUMN_MASK, np.asarray(act.cols[t, k, : counts[t, k]]))
    assert np.all((words >> emu.WORD_TOKEN_SHIFT) & 31 == t % 32)
    assert_close(y, want, fused_tolerance(jnp.bfloat16, 600), "layout case")


def test_over_budget_is_nan_never_wrong():
    x, inp = _case(50, 64, 300, 0.05, "uniform", jnp.bfloat16, 3, full=1)
    y, want, act, ws, need = _run(x, inp, True, 64, 4)
    y_small, *_ = _run(x, inp, True, 64, 4, max_entries=need - 1)
    assert np.isnan(np.asarray(y_small, np.float32)).all()
    assert np.isfinite(np.asarray(y, np.float32)).all()


def test_token_order_within_neuron_irrelevant_and_deterministic():
    """Each y row sums its own entries in neuron order whatever the block layout: rows
    computed alone (M=1) give the same bits as inside a block of many rows."""
    x, inp = _case(40, 64, 300, 0.05, "heavy", jnp.bfloat16, 4, full=1, empty=1)
    y, *_ = _run(x, inp, True, 64, 4)
    for t in (0, 1, 17, 39):
        y_t, *_ = _run(x[t : t + 1], inp, True, 64, 4)
        np.testing.assert_array_equal(np.asarray(y_t).view(np.uint16), np.asarray(y[t : t + 1]).view(np.uint16))
