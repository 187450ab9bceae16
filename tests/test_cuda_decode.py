"""The decode kernels (ffi/twell_decode.cu) against the reference, on the GPU: every
activation pattern exact (dense rows, empty rows, partial tiles), the workspace's entry
lists, and the dispatch of decode-sized calls through cuda.sparse_ffn."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_twell.formats import pack_twell_reference, relu_matmul
from jax_twell.testing import synthetic_ffn_inputs, with_extreme_rows
from specs import assert_close, fused_tolerance
from jax_twell.ops.costs import DenseCrossover
from jax_twell.ops.ffn import binding as ffn_binding
from jax_twell.ops import layout
from jax_twell.ops.ffn import reference as ffn_reference
from jax_twell.ops import xla
from cuda_calls import cuda_ffn
from jax_twell.ops.ffn.api import sparse_ffn_for_layer
from jax_twell.ops.plan import LayerInfo

pytestmark = pytest.mark.gpu

# m, d, f, density, pattern, full rows, empty rows
CASES = [
    (1, 2048, 5632, 0.005, "uniform", 0, 0),
    (64, 2048, 5632, 0.005, "heavy", 0, 0),
    (3, 64, 260, 0.05, "uniform", 1, 1),  # f not a multiple of 256; one dense row
    (77, 192, 1000, 0.02, "heavy", 3, 5),  # M past 64 still works
    (16, 8, 300, 0.5, "dense", 0, 0),  # smallest d
    (8, 8192, 700, 0.01, "uniform", 1, 2),  # largest d
    (5, 256, 20000, 0.01, "uniform", 2, 1),  # large f: a dense row has 20,000 entries
]


def _want(x, g, w_up, w_down):
    """The reference on the same g: TwELL with room for every column (nothing overflows)."""
    act = pack_twell_reference(g, tile=256, capacity=256)
    with jax.default_matmul_precision("highest"):
        return ffn_reference.twell_ffn(x, act, None, w_up, w_down)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"m{c[0]}_d{c[1]}_f{c[2]}_{c[4]}")
def test_decode_matches_reference(case, gated, dtype):
    m, d, f, density, pattern, full, empty = case
    inp = synthetic_ffn_inputs(jax.random.key(m * 7 + f), m, d, f, density=density, pattern=pattern, dtype=dtype)
    inp = with_extreme_rows(inp, full=full, empty=empty)
    g = relu_matmul(inp.x, inp.w_gate)  # non-gated too: the kernel sees only the activation
    w_up = inp.w_up if gated else None
    y, counts, entries = jax.jit(lambda x, g: ffn_binding.decode_ffn(x, g, w_up, inp.w_down, workspace=True))(inp.x, g)
    assert y.dtype == dtype and y.shape == (m, d)
    assert_close(y, _want(inp.x, g, w_up, inp.w_down), fused_tolerance(dtype, f), f"{case} gated={gated}")
    # The entry lists: per (token, tile) the active columns in order; non-gated h is g itself.
    n_tiles = -(-f // layout.DECODE_TILE)
    active = np.zeros((m, n_tiles * layout.DECODE_TILE), bool)
    active[:, :f] = np.asarray(g, np.float32) != 0
    active = active.reshape(m, n_tiles, layout.DECODE_TILE)
    counts, entries = np.asarray(counts), np.asarray(entries).reshape(m, n_tiles, layout.DECODE_TILE)
    np.testing.assert_array_equal(counts, active.sum(-1))
    g_bits = np.pad(np.asarray(g).view(np.uint16), ((0, 0), (0, n_tiles * layout.DECODE_TILE - f)))
    g_bits = g_bits.reshape(m, n_tiles, layout.DECODE_TILE)
    for t, k in zip(*np.nonzero(counts)):
        cols = np.nonzero(active[t, k])[0]
        got = entries[t, k, : len(cols)]
        np.testing.assert_array_equal(got & 0xFFFF, cols, f"token {t} tile {k}")
        if not gated:
            np.testing.assert_array_equal(got >> 16, g_bits[t, k, cols], f"token {t} tile {k}")
    if full:
        assert counts.sum(-1).max() == f  # the dense rows did list every column
    if empty:
        assert (counts.sum(-1) == 0).sum() >= empty


def test_decode_is_deterministic_and_given_w_up_t():
    inp = synthetic_ffn_inputs(jax.random.key(5), 64, 2048, 5632, density=0.01, pattern="heavy")
    g = relu_matmul(inp.x, inp.w_gate)
    a = ffn_binding.decode_ffn(inp.x, g, inp.w_up, inp.w_down)
    b = ffn_binding.decode_ffn(inp.x, g, inp.w_up, inp.w_down, w_up_t=inp.w_up.T)
    np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


@pytest.mark.parametrize("check", [None, 0.02])
@pytest.mark.parametrize("density", [0.005, 0.5])
def test_sparse_ffn_runs_the_decode_kernel(check, density):
    """Decode-sized calls under jit through the dispatch: the kernel (or, with the device
    check, dense above 2% active) gives the FFN either way."""
    rule = DenseCrossover(decode_kernel_max_tokens=64, decode_dense_above=check)
    pattern = "dense" if density == 0.5 else "uniform"
    for m in (1, 64):
        inp = synthetic_ffn_inputs(jax.random.key(m), m, 2048, 5632, density=density, pattern=pattern)
        y = jax.jit(lambda x, wg, wu, wd: cuda_ffn(x, wg, wu, wd, tile=256, capacity=32, rule=rule))(*inp)
        with jax.default_matmul_precision("highest"):
            want = xla.ffn(*inp)
        assert_close(y, want, 2 * fused_tolerance(jnp.bfloat16, 5632), f"m={m} density={density}")


# m, d, f, density, pattern, full rows, empty rows: shapes the gate kernel takes
GATE_CASES = [
    (1, 2048, 5632, 0.005, "uniform", 0, 0),
    (16, 2048, 5632, 0.01, "heavy", 0, 0),
    (17, 1024, 2816, 0.02, "uniform", 1, 1),  # two token blocks of 16, the second nearly empty
    (64, 2048, 5632, 0.005, "heavy", 2, 3),
    (5, 48, 1000, 0.05, "uniform", 0, 0),  # d not a multiple of 128 (a partial stage), f of 64
    (33, 4096, 11008, 0.005, "uniform", 0, 0),
]


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("case", GATE_CASES, ids=lambda c: f"m{c[0]}_d{c[1]}_f{c[2]}_{c[4]}")
def test_decode_gate_kernel_matches_reference(case, gated):
    """The gate on tensor cores: g is relu(x @ w) rounded once (up to the order of the f32
    additions), the same on a second call (deterministic) and with the K ranges added in
    a thread-block cluster, the active columns are those of relu(x @ w) up to rounding ties, and
    y matches the reference."""
    m, d, f, density, pattern, full, empty = case
    inp = synthetic_ffn_inputs(jax.random.key(m * 3 + f), m, d, f, density=density, pattern=pattern)
    inp = with_extreme_rows(inp, full=full, empty=empty)
    w_act = inp.w_gate  # non-gated too (the activation's weight): keeps the synthetic sparsity
    w_up = inp.w_up if gated else None
    fn = jax.jit(lambda x: ffn_binding.decode_ffn_gate(x, w_act, w_up, inp.w_down, workspace=True))
    y, g_kernel, counts, _ = fn(inp.x)
    assert g_kernel.shape == (m, f) and g_kernel.dtype == inp.x.dtype
    pre = np.maximum(np.asarray(inp.x, np.float64) @ np.asarray(w_act, np.float64), 0.0)
    # one rounding of a sum that is exact to f32: within half an ulp of bf16 plus f32 noise
    err = np.abs(np.asarray(g_kernel, np.float64) - pre)
    assert np.all(err <= 2.0**-8 * np.abs(pre) + 1e-5 * np.abs(pre).max()), err.max()
    y2, g2, _, _ = fn(inp.x)
    np.testing.assert_array_equal(np.asarray(g2), np.asarray(g_kernel))
    np.testing.assert_array_equal(np.asarray(y2), np.asarray(y))
    # the K-range sums in a cluster instead of through the workspace: the same bits
    other = jax.jit(lambda x: ffn_binding.decode_ffn_gate(x, w_act, w_up, inp.w_down, workspace=True, cluster=True))
    y3, g3, counts3, _ = other(inp.x)
    np.testing.assert_array_equal(np.asarray(g3), np.asarray(g_kernel))
    np.testing.assert_array_equal(np.asarray(y3), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(counts3), np.asarray(counts))
    g = relu_matmul(inp.x, w_act)
    active = np.asarray(g, np.float32) != 0
    n_tiles = -(-f // layout.DECODE_TILE)
    per_tile = np.pad(active, ((0, 0), (0, n_tiles * layout.DECODE_TILE - f))).reshape(m, n_tiles, -1).sum(-1)
    assert np.abs(np.asarray(counts) - per_tile).sum() <= max(2, m * f // 20000)  # rounding ties at 0 only
    want = _want(inp.x, g, w_up, inp.w_down)
    assert_close(y, want, 2 * fused_tolerance(jnp.bfloat16, f), f"{case} gated={gated}")


def test_sparse_ffn_takes_the_gate_kernel_when_asked():
    rule = DenseCrossover(decode_kernel_max_tokens=64, decode_fused_gate=True)
    inp = synthetic_ffn_inputs(jax.random.key(9), 8, 2048, 5632, density=0.005)
    fn = jax.jit(lambda x, wg, wu, wd: cuda_ffn(x, wg, wu, wd, tile=256, capacity=32, rule=rule))
    assert "jax_twell_decode_fused_gated" in fn.lower(*inp).as_text()
    with jax.default_matmul_precision("highest"):
        want = xla.ffn(*inp)
    assert_close(fn(*inp), want, 2 * fused_tolerance(jnp.bfloat16, 5632), "default rule, decode on")


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_public_op_runs_the_rows_kernel_for_one_token(gated):
    """The inference op with a known active fraction and the activation's weight stored
    by neuron: one token (leading dims [1, 1]) runs the rows kernel and matches dense."""
    inp = synthetic_ffn_inputs(jax.random.key(21), 1, 2048, 5632, density=0.005)
    # Non-gated, the sparse-firing gate weight serves as the activation's (w_up) weight.
    w_gate, w_up = (inp.w_gate, inp.w_up) if gated else (None, inp.w_gate)
    w_act = inp.w_gate
    kw = dict(implementation="cuda", layer=LayerInfo(active_fraction=0.005), w_act_t=w_act.T,
              w_up_t=w_up.T if gated else None)
    fn = jax.jit(lambda x, wg, wu, wd: sparse_ffn_for_layer(x, wg, wu, wd, **kw))
    x = inp.x.reshape(1, 1, 2048)
    target = "jax_twell_decode_rows_gated" if gated else "jax_twell_decode_rows"
    assert target in fn.lower(x, w_gate, w_up, inp.w_down).as_text()
    with jax.default_matmul_precision("highest"):
        want = xla.ffn(inp.x, w_gate, w_up, inp.w_down)
    y = fn(x, w_gate, w_up, inp.w_down)
    assert y.shape == (1, 1, 2048)
    assert_close(y.reshape(1, 2048), want, 2 * fused_tolerance(jnp.bfloat16, 5632), f"gated={gated}")


# m, d, f, density, pattern, full rows, empty rows: shapes the rows kernel takes (1-4 tokens)
ROWS_CASES = [
    (1, 2048, 5632, 0.005, "uniform", 0, 0),
    (4, 2048, 5632, 0.01, "heavy", 0, 0),
    (3, 64, 260, 0.05, "uniform", 1, 1),  # f not a multiple of 16; a dense row, an empty row
    (2, 8, 300, 0.5, "dense", 0, 0),  # smallest d
    (1, 8192, 700, 0.01, "uniform", 1, 0),  # largest d, one dense token
    (4, 8192, 1000, 0.02, "uniform", 0, 1),  # 64 KB of staged x (past the default 48 KB)
    (2, 64, 70000, 0.02, "heavy", 1, 0),  # 4,375 neuron groups: the sum lists them in two passes
    (2, 2056, 333, 0.05, "uniform", 0, 1),  # d past two 1024-element passes; f odd; an empty token
    (1, 2048, 5632, 0.3, "uniform", 1, 0),  # a fully active token: every group's partial summed (two rounds)
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("case", ROWS_CASES, ids=lambda c: f"m{c[0]}_d{c[1]}_f{c[2]}_{c[4]}")
def test_decode_rows_kernel_matches_reference(case, gated, dtype):
    """The rows kernel: its activation is relu(x @ w) rounded once (up to the order of the
    f32 additions), its flags count each 16-neuron group's active neurons per token, y
    matches the reference on that activation, and a second call gives the same bits."""
    m, d, f, density, pattern, full, empty = case
    inp = synthetic_ffn_inputs(jax.random.key(m * 5 + f), m, d, f, density=density, pattern=pattern, dtype=dtype)
    inp = with_extreme_rows(inp, full=full, empty=empty)
    w_act = inp.w_gate  # non-gated too (the activation's weight): keeps the synthetic sparsity
    w_up = inp.w_up if gated else None
    w_up_t = inp.w_up.T if gated else None
    fn = jax.jit(lambda x, wa_t, wu_t, wd: ffn_binding.decode_ffn_rows(x, wa_t, wd, w_up_t=wu_t, workspace=True))
    y, g, flags = fn(inp.x, w_act.T, w_up_t, inp.w_down)
    assert y.shape == (m, d) and y.dtype == dtype and g.shape == (m, f) and flags.shape == (-(-f // 16), m)
    pre = np.maximum(np.asarray(inp.x, np.float64) @ np.asarray(w_act, np.float64), 0.0)
    ulp = 2.0**-8 if dtype == jnp.bfloat16 else 2.0**-11
    err = np.abs(np.asarray(g, np.float64) - pre)
    assert np.all(err <= ulp * np.abs(pre) + 1e-5 * np.abs(pre).max()), err.max()
    active = np.pad(np.asarray(g, np.float32) != 0, ((0, 0), (0, -f % 16))).reshape(m, -1, 16).sum(-1).T
    flags = np.asarray(flags)
    if gated:  # h = g * u may round to zero where g does not
        assert np.all(flags <= active) and flags.sum() >= active.sum() - max(2, active.sum() // 100)
    else:
        np.testing.assert_array_equal(flags, active)
    if full:
        assert active.sum(0).max() == f
    if empty:
        assert (active.sum(0) == 0).sum() >= empty
    assert_close(y, _want(inp.x, g, w_up, inp.w_down), fused_tolerance(dtype, f), f"{case} gated={gated}")
    y2, g2, _ = fn(inp.x, w_act.T, w_up_t, inp.w_down)
    np.testing.assert_array_equal(np.asarray(y2).view(np.uint16), np.asarray(y).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(g2).view(np.uint16), np.asarray(g).view(np.uint16))

