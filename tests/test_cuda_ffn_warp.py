"""The warp-per-token FFN kernel (ffi/twell_ffn_warp.cu) and its dense backup
(jax_twell/ops/warp.py) against the reference: every row exact, whichever side computes it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_twell.formats import pack_twell_reference, relu_matmul
from jax_twell.ops.ffn import reference
from jax_twell.ops.ffn import warp
from jax_twell.testing import synthetic_ffn_inputs, with_extreme_rows
from specs import GPU_SPECS, assert_close, fused_tolerance

pytestmark = pytest.mark.gpu

SPECS = [s for s in GPU_SPECS if s.d <= warp.MAX_D and s.d % 8 == 0]


def _act(x, w_act, tile, capacity):
    return pack_twell_reference(relu_matmul(x, w_act), tile=tile, capacity=capacity)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_kernel_rows_match_reference(spec, dtype, gated):
    """Rows that fit are the reference's; rows left to the backup are zeros (poisoned output
    would show as a mismatch: the kernel writes every row)."""
    inp = synthetic_ffn_inputs(jax.random.key(spec.m + 11), spec.m, spec.d, spec.f, density=spec.density,
                               pattern=spec.pattern, dtype=dtype)
    w_act = inp.w_gate if gated else inp.w_up
    for tile, capacity, budget in [(256, 32, 64), (64, 4, 12), (256, 64, 128)]:
        act = _act(inp.x, w_act, tile, capacity)
        y = warp.ffn_rows(inp.x, act, inp.w_up.T if gated else None, inp.w_down, row_budget=budget)
        want = reference.twell_ffn(inp.x, act, w_act, inp.w_up if gated else None, inp.w_down)
        left = np.asarray(warp.backed_up(act, budget))
        assert np.all(np.asarray(y, np.float32)[left] == 0), f"{spec}: a backed-up row was not zeroed"
        keep = ~left
        if keep.any():
            assert_close(np.asarray(y, np.float32)[keep], np.asarray(want, np.float32)[keep],
                         fused_tolerance(dtype, spec.f), f"{spec} tile={tile} cap={capacity} budget={budget}")


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_with_backup_matches_reference(spec, gated):
    """The whole path (kernel + backup, or dense past the backup's size) equals the dense
    formula on every row, with fully active rows and empty rows mixed in."""
    inp = synthetic_ffn_inputs(jax.random.key(spec.m + 5), spec.m, spec.d, spec.f, density=spec.density,
                               pattern=spec.pattern, dtype=jnp.bfloat16)
    if spec.pattern != "skewed" and spec.m > 4:
        inp = with_extreme_rows(inp, full=min(3, spec.m // 4), empty=1)
    w_gate = inp.w_gate if gated else None
    w_up = inp.w_up if gated else inp.w_gate
    w_act = w_gate if gated else w_up
    act = _act(inp.x, w_act, 256, 32)
    fn = jax.jit(lambda x, a, wg, wu, wd: warp.ffn_from_gate(x, a, wg, wu, wd))
    y = fn(inp.x, act, w_gate, w_up, inp.w_down)
    want = reference.twell_ffn(inp.x, act, w_act, w_up if gated else None, inp.w_down)
    assert_close(y, want, fused_tolerance(jnp.bfloat16, spec.f), str(spec))


def test_backup_overflow_runs_dense():
    """More rows to back up than the backup holds: the dense FFN, exact."""
    m, d, f = 96, 256, 1024
    inp = with_extreme_rows(synthetic_ffn_inputs(jax.random.key(3), m, d, f, density=0.01), full=40)
    act = _act(inp.x, inp.w_gate, 256, 32)
    assert int(warp.backed_up(act, warp.ROW_BUDGET).sum()) > warp.backup_size(m)
    y = jax.jit(warp.ffn_from_gate)(inp.x, act, inp.w_gate, inp.w_up, inp.w_down)
    want = reference.twell_ffn(inp.x, act, inp.w_gate, inp.w_up, inp.w_down)
    assert_close(y, want, fused_tolerance(jnp.bfloat16, f), "backup overflow")


def test_bad_operands_are_refused():
    m, d, f = 8, 64, 256
    inp = synthetic_ffn_inputs(jax.random.key(0), m, d, f)
    act = _act(inp.x, inp.w_gate, 256, 32)
    with pytest.raises(Exception, match=r"max_entries must be in \[0, 128\]"):
        jax.block_until_ready(warp.ffn_rows(inp.x, act, inp.w_up.T, inp.w_down, row_budget=129))
    with pytest.raises(Exception, match="w_up_t must have shape"):
        jax.block_until_ready(warp.ffn_rows(inp.x, act, inp.w_up, inp.w_down))
    with pytest.raises(Exception, match="bf16 or f16"):
        x32 = inp.x.astype(jnp.float32)
        act32 = _act(x32, inp.w_gate.astype(jnp.float32), 256, 32)
        jax.block_until_ready(warp.ffn_rows(x32, act32, inp.w_up.T.astype(jnp.float32), inp.w_down.astype(jnp.float32)))


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_per_call_choice_matches_reference(spec):
    """The per-call path (either side of its device choice) equals the reference."""
    inp = synthetic_ffn_inputs(jax.random.key(spec.m + 9), spec.m, spec.d, spec.f, density=spec.density,
                               pattern=spec.pattern, dtype=jnp.bfloat16)
    if spec.m > 4:
        inp = with_extreme_rows(inp, full=1, empty=1)
    y = jax.jit(warp.sparse_ffn)(*inp)
    want = reference.ffn(*inp, tile=256, capacity=32)
    assert_close(y, want, fused_tolerance(jnp.bfloat16, spec.f), str(spec))
