"""The CPU kernels (cpu/twell_cpu.cc through jax_twell.ops.ffn.cpu) against the reference
and the dense formula: f32 and bf16, gated and non-gated, odd shapes, full and empty rows,
NaN and Inf as the dense formula has them, and the default implementation on the CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_twell as jt
from jax_twell import _cpu
from jax_twell.formats import pack_twell_reference, relu_matmul
from jax_twell.ops.common import finite_columns
from jax_twell.ops.ffn import cpu
from jax_twell.ops.ffn_train import cpu as train_cpu
from jax_twell.ops.ffn.api import sparse_ffn_for_layer
from jax_twell.testing import synthetic_ffn_inputs, with_extreme_rows
from specs import assert_close, fused_tolerance, tolerance

pytestmark = pytest.mark.skipif(
    not _cpu.cpu_kernels_available(), reason=f"CPU kernels unavailable: {_cpu.cpu_kernel_status().reason}")

DTYPES = [jnp.float32, jnp.bfloat16]


def dense_f32(x, w_gate, w_up, w_down):
    x, w_up, w_down = (a.astype(jnp.float32) for a in (x, w_up, w_down))
    with jax.default_matmul_precision("highest"):
        h = jax.nn.relu(x @ w_up) if w_gate is None else jax.nn.relu(x @ w_gate.astype(jnp.float32)) * (x @ w_up)
        return h @ w_down


def reference_up_down(x, g, w_up, w_down):
    """jax_twell/ops/ffn/reference.py's rounding: u rounded, h = g * u in the dtype."""
    h = g
    if w_up is not None:
        h = g * jnp.matmul(x, w_up, preferred_element_type=jnp.float32).astype(x.dtype)
    return jnp.matmul(h, w_down, preferred_element_type=jnp.float32).astype(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: jnp.dtype(t).name)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("m,d,f,density", [(0, 13, 37, 0.1), (1, 37, 301, 0.05), (7, 29, 203, 0.2),
                                           (300, 45, 157, 0.05)])
@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_up_down_is_the_reference(dtype, gated, m, d, f, density, layout):
    if layout == "columns" and not gated:
        pytest.skip("non-gated: no up weight")
    x, w_gate, w_up, w_down = synthetic_ffn_inputs(jax.random.key(m + d), m, d, f, density=density, dtype=dtype)
    if not gated:
        w_gate, w_up = None, w_gate
    if m >= 3:  # a fully active row and an empty one
        x = with_extreme_rows(synthetic_ffn_inputs(jax.random.key(m + d), m, d, f, density=density, dtype=dtype)
                              ._replace(x=x), full=1, empty=1).x
    g = relu_matmul(x, w_gate if gated else w_up)
    w_up_k = w_up if gated else None
    y = jax.jit(lambda *a: cpu.up_down(*a, w_up_t=w_up.T if gated and layout == "rows" else None))(x, g, w_up_k, w_down)
    assert y.shape == (m, d) and y.dtype == dtype
    want = reference_up_down(x, g, w_up_k, w_down)
    assert_close(y, want, tolerance(dtype, f), f"{layout} vs reference")
    if m:
        assert_close(y, dense_f32(x, w_gate, w_up, w_down), fused_tolerance(dtype, d + f), "vs dense formula")


def token_form_padding(m: int):
    """Rows of empty tokens that take ``m`` tokens past cpu.UNION_MAX_TOKENS (the token form)."""
    return ((0, cpu.UNION_MAX_TOKENS + 1 - m), (0, 0))


def assert_union_is_token_form(call, x, g, dtype) -> np.ndarray:
    """``call(x, g)`` of a few tokens (the union form) and of the same tokens padded past
    cpu.UNION_MAX_TOKENS with empty rows (the token form) give the same bits; returns y."""
    m = x.shape[0]
    y = np.asarray(call(x, g))
    pad = token_form_padding(m)
    y_tokens = np.asarray(call(jnp.pad(x, pad), jnp.pad(g, pad)))[:m]
    bits = np.uint16 if dtype == jnp.bfloat16 else np.uint32
    np.testing.assert_array_equal(y.view(bits), y_tokens.view(bits))
    return y


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: jnp.dtype(t).name)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_union_form_is_the_token_form_bit_for_bit(dtype, gated, layout):
    """Calls of a few tokens run neuron by neuron (each weight row read once for all the
    tokens that have its neuron active; the union and the columns split over the cores),
    longer ones token by token. The same tokens padded past cpu.UNION_MAX_TOKENS with empty
    rows take the token form: y is the same bits, rows of every density (dense, sparse,
    empty, a NaN entry)."""
    if layout == "columns" and not gated:
        pytest.skip("non-gated: no up weight")
    m, d, f = 9, 320, 1100  # d: five 64-column ranges; the dense rows put ~all of f in the union
    inp = synthetic_ffn_inputs(jax.random.key(7), m, d, f, density=0.02, dtype=dtype)
    x = with_extreme_rows(inp, full=2, empty=1).x
    x = x.at[3, 5].set(jnp.nan)  # a NaN token: all of its row is NaN or active
    w_act, w_up, w_down = (inp.w_gate, inp.w_up, inp.w_down) if gated else (inp.w_gate, None, inp.w_down)
    g = relu_matmul(x, w_act)
    assert int((g != 0).any(0).sum()) >= 128  # two threads' worth of union rows
    w_up_t = w_up.T if gated and layout == "rows" else None
    call = jax.jit(lambda x, g: cpu.up_down(x, g, w_up, w_down, w_up_t=w_up_t))
    y = assert_union_is_token_form(call, x, g, dtype)
    ok = np.isfinite(y.astype(np.float32)).all(1)
    assert ok.sum() >= m - 1 and not ok[3]
    want = np.asarray(reference_up_down(x, g, w_up, w_down))
    assert_close(y[ok], want[ok], tolerance(dtype, f), "vs reference")
    if gated and layout == "rows":  # the training forward: y and u, the same way
        train = jax.jit(lambda x, g: train_cpu.forward(x, g, w_up.T, w_down))
        pad, bits = token_form_padding(m), np.uint16 if dtype == jnp.bfloat16 else np.uint32
        (y2, u2), (y3, u3) = train(x, g), train(jnp.pad(x, pad), jnp.pad(g, pad))
        np.testing.assert_array_equal(np.asarray(y2).view(bits), np.asarray(y3)[:m].view(bits))
        np.testing.assert_array_equal(np.asarray(u2).view(bits), np.asarray(u3)[:m].view(bits))
        np.testing.assert_array_equal(np.asarray(y2).view(bits), y.view(bits))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: jnp.dtype(t).name)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_blocked_union_form_is_the_token_form_bit_for_bit(dtype, gated):
    """Dense calls (half the neurons active, two full rows) take the union form's blocked
    down products (cpu/twell_cpu.cc down_chunk: each token of a group adds a zero product
    at the neurons where it is inactive): the same bits as the token form, in groups of 4,
    4 and 3 tokens, a column tail past the 16-column blocks, and an Inf weight at a neuron
    that some tokens skip (its block runs again guarded: no NaN from Inf * 0)."""
    m, d, f = 11, 200, 400  # two column ranges: 128 and 72 (four blocks and a tail of 8)
    inp = synthetic_ffn_inputs(jax.random.key(11), m, d, f, density=0.5, dtype=dtype)
    x = with_extreme_rows(inp, full=2, empty=1).x
    w_act, w_up = (inp.w_gate, inp.w_up) if gated else (inp.w_gate, None)
    g = relu_matmul(x, w_act)
    active = np.asarray(g != 0)
    assert active.mean() > 0.4
    n = int(np.argmax(active.any(0) & ~active.all(0)))  # a neuron some tokens skip
    w_down = inp.w_down.at[n, 130].set(jnp.inf).at[n, 5].set(-jnp.inf)
    w_up_t = w_up.T if gated else None
    call = jax.jit(lambda x, g: cpu.up_down(x, g, w_up, w_down, w_up_t=w_up_t))
    y = assert_union_is_token_form(call, x, g, dtype)
    skip = ~active[:, n]
    assert skip.any() and np.isfinite(y[skip][:, [5, 130]].astype(np.float32)).all()
    ok = np.isfinite(y.astype(np.float32)).all(1)
    want = np.asarray(reference_up_down(x, g, w_up, inp.w_down))
    assert ok.sum() == skip.sum()
    assert_close(y[ok], want[ok], tolerance(dtype, f), "vs reference")


@pytest.mark.parametrize("m,conditional", [(1, False), (4, False), (8, False), (16, False), (17, True)])
def test_few_f32_tokens_with_the_caches_run_the_kernel_unconditionally(m, conditional):
    """f32 calls of up to 16 tokens (cpu.UNION_MAX_TOKENS) with w_up.T and the finite
    columns kept: the union form is the faster side at every density
    (cpu.UNION_MAX_FRACTION), so the call holds no count and no conditional; from 17 tokens
    it chooses per call. Fully active rows give the dense formula either way."""
    assert (cpu.sparse_max_fraction(m, union=True) >= 1.0) == (not conditional)
    inp = synthetic_ffn_inputs(jax.random.key(m), m, 64, 256, density=0.05, dtype=jnp.float32)
    x = with_extreme_rows(inp, full=1, empty=0).x
    ok = finite_columns(inp.w_up, inp.w_down)
    fn = jax.jit(lambda x: cpu.sparse_ffn(x, inp.w_gate, inp.w_up, inp.w_down, w_up_t=inp.w_up.T, weights_finite=ok))
    text = fn.lower(x).as_text()
    assert ("stablehlo.case" in text or "stablehlo.if" in text) == conditional
    assert_close(fn(x), dense_f32(x, inp.w_gate, inp.w_up, inp.w_down), fused_tolerance(jnp.float32, 64 + 256), f"m={m}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: jnp.dtype(t).name)
@pytest.mark.parametrize("m", [1, 7, 20])
def test_gate_is_xla_matmul(dtype, m):
    x, w, _, _ = synthetic_ffn_inputs(jax.random.key(m), m, 37, 301, density=0.1, dtype=dtype)
    x = x.at[0, 3].set(jnp.nan)
    got, want = np.asarray(cpu.gate(x, w), np.float32), np.asarray(relu_matmul(x, w), np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    assert_close(got[ok], want[ok], tolerance(dtype, 37), "gate")


SLOW = pytest.mark.slow


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: jnp.dtype(t).name)
@pytest.mark.parametrize("m,f,tile,capacity", [(0, 301, 64, 4), (1, 301, 64, 4), (7, 301, 64, 4),
                                               pytest.param(20, 520, 256, 64, marks=SLOW),
                                               pytest.param(9, 64, 64, 64, marks=SLOW),
                                               pytest.param(3, 2000, 32, 1, marks=SLOW)])
def test_gate_twell_is_the_pack_of_the_kernels_gate(dtype, m, f, tile, capacity):
    """The one-pass TwELL gate is pack_twell_reference of the kernel's dense gate, bit for
    bit (the same f32 sums per column): entries in column order, true counts past
    capacity, zeros in unused slots, a partial last tile, NaN as an entry."""
    x, w, _, _ = synthetic_ffn_inputs(jax.random.key(m + f), m, 29, f, density=0.15, dtype=dtype)
    if m:
        x = x.at[0, 3].set(jnp.nan)  # row 0: every column NaN (all entries, all tiles overflow)
    act = jax.jit(lambda x, w: cpu.gate_twell(x, w, tile=tile, capacity=capacity))(x, w)
    want = pack_twell_reference(cpu.gate(x, w), tile=tile, capacity=capacity)
    assert act.values.shape == want.values.shape == (m, -(-f // tile), capacity)
    np.testing.assert_array_equal(act.counts, want.counts)
    np.testing.assert_array_equal(act.cols, want.cols)
    np.testing.assert_array_equal(np.asarray(act.values, np.float32), np.asarray(want.values, np.float32))
    if m > 1:
        assert (np.asarray(act.counts) > capacity).any() or capacity == tile  # overflow is exercised
    # and against XLA's matmul, up to the last bit of a value
    ref = pack_twell_reference(relu_matmul(x, w), tile=tile, capacity=capacity)
    dense = np.asarray(act.to_dense(x, w), np.float32)
    ok = ~np.isnan(dense)
    assert_close(dense[ok], np.asarray(ref.to_dense(x, w), np.float32)[ok], tolerance(dtype, 29), "vs XLA's gate")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: jnp.dtype(t).name)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("layout", ["rows", "columns"])
@pytest.mark.parametrize("m,f,tile,capacity,density", [pytest.param(0, 301, 64, 4, 0.1, marks=SLOW),
                                                        (1, 301, 64, 4, 0.05), (7, 203, 32, 2, 0.2),
                                                        pytest.param(16, 520, 256, 64, 0.01, marks=SLOW),
                                                        pytest.param(5, 640, 128, 8, 0.6, marks=SLOW)])
def test_up_down_twell_is_up_down_on_the_dense_gate(dtype, gated, layout, m, f, tile, capacity, density):
    """The up and down kernel on TwELL gives the bits of the kernel on the dense gate: the
    same entries in the same order, tiles past capacity recomputed with the gate's own
    sums (a NaN token, a fully active one and an empty one included)."""
    if layout == "columns" and not gated:
        pytest.skip("non-gated: no up weight")
    d = 37
    inp = synthetic_ffn_inputs(jax.random.key(m + f), m, d, f, density=density, dtype=dtype)
    if m >= 3:
        inp = with_extreme_rows(inp, full=1, empty=1)
    x, w_gate, w_up, w_down = inp
    if m >= 4:
        x = x.at[2, 5].set(jnp.nan)
    if not gated:
        w_gate, w_up = None, w_gate
    w_act = w_gate if gated else w_up
    w_up_k = w_up if gated else None
    w_up_t = w_up.T if gated and layout == "rows" else None
    act = cpu.gate_twell(x, w_act, tile=tile, capacity=capacity)
    y = jax.jit(lambda x, v, c, n, wa, wu, wd, wut: cpu.up_down_twell(
        x, type(act)(v, c, n, f=f, tile=tile), wa, wu, wd, w_up_t=wut))(
        x, act.values, act.cols, act.counts, w_act, w_up_k, w_down, w_up_t)
    want = cpu.up_down(x, cpu.gate(x, w_act), w_up_k, w_down, w_up_t=w_up_t)
    assert y.shape == (m, d) and y.dtype == dtype
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
    if m:
        assert (np.asarray(act.counts) > capacity).any() == (density >= 0.2 or m >= 3)
        ok = ~np.isnan(np.asarray(want, np.float32))
        y_ref = np.asarray(reference_up_down(x, relu_matmul(x, w_act), w_up_k, w_down), np.float32)
        assert_close(np.asarray(y, np.float32)[ok], y_ref[ok], fused_tolerance(dtype, d + f), "vs reference")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: jnp.dtype(t).name)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("m", [1, 8, 70, 300])
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "plain"])
def test_sparse_ffn_is_the_dense_formula(dtype, gated, m, cached):
    """Both sides of the device choice (0.5% and 60% active) and both up layouts."""
    for density in (0.005, 0.6):
        x, w_gate, w_up, w_down = synthetic_ffn_inputs(jax.random.key(3), m, 64, 520, density=density, dtype=dtype)
        if not gated:
            w_gate, w_up = None, w_gate
        extra = {}
        if cached:
            extra = dict(w_up_t=w_up.T if gated else None, weights_finite=finite_columns(w_up if gated else None, w_down))
        y = jax.jit(lambda *a: sparse_ffn_for_layer(*a, implementation="cpu", **extra))(x, w_gate, w_up, w_down)
        assert y.shape == x.shape and y.dtype == dtype
        assert_close(y, dense_f32(x, w_gate, w_up, w_down), fused_tolerance(dtype, 64 + 520), f"density {density}")


@pytest.mark.parametrize("case", ["nan_w_up_quiet", "inf_w_down_quiet", "nan_x_row", "inf_x_row", "nan_w_act",
                                  "nan_g_entry"])
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "plain"])
@pytest.mark.parametrize("dtype,m", [(jnp.float32, 300), (jnp.bfloat16, 1), (jnp.bfloat16, 8)],
                         ids=["f32-m300", "bf16-m1", "bf16-m8"])
def test_nan_and_inf_as_the_dense_formula(case, cached, dtype, m):
    # Plain bf16 calls run the kernel at every M, plain f32 calls of 300 tokens below ~1.6%
    # active (cpu.WEIGHT_PASS_ENTRIES): all of these do.
    d, f = 40, 300
    density = 0.01 if dtype == jnp.float32 else 0.02
    x, w_gate, w_up, w_down = synthetic_ffn_inputs(jax.random.key(4), m, d, f, density=density, dtype=dtype)
    fired = (relu_matmul(x, w_gate) > 0).sum(0)
    quiet = int(jnp.argmin(fired))
    if case == "nan_w_up_quiet":
        w_up = w_up.at[3, quiet].set(jnp.nan)
    elif case == "inf_w_down_quiet":
        w_down = w_down.at[quiet, 1].set(jnp.inf)
    elif case == "nan_x_row":
        x = x.at[0, 2].set(jnp.nan)
    elif case == "inf_x_row":
        x = x.at[-1, 0].set(-jnp.inf)
    elif case == "nan_w_act":
        w_gate = w_gate.at[1, quiet].set(jnp.nan)
    else:  # one active neuron's gate weight NaN only where x's feature 5 is large
        busy = int(jnp.argmax(fired))
        w_gate = w_gate.at[5, busy].set(jnp.inf)
        x = x.at[0, 5].set(jnp.abs(x[0, 5]) + 1)  # token 0 sees it (+Inf in its gate)
    extra = dict(w_up_t=w_up.T, weights_finite=finite_columns(w_up, w_down)) if cached else {}
    y = np.asarray(jax.jit(lambda *a: sparse_ffn_for_layer(*a, implementation="cpu", **extra))(x, w_gate, w_up, w_down))
    want = np.asarray(dense_f32(x, w_gate, w_up, w_down))
    bad = ~np.isfinite(want)
    assert bad.any()
    np.testing.assert_array_equal(~np.isfinite(y), bad, err_msg=case)
    assert_close(np.where(bad, 0, y.astype(np.float32)), np.where(bad, 0, want), fused_tolerance(dtype, d + f), case)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: jnp.dtype(t).name)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_finite_columns_by_sums_is_the_elementwise_check(dtype, gated):
    """The sums' check against the elementwise one: finite weights, NaN and Inf anywhere
    (+Inf and -Inf in one column, whose sum is NaN), and finite weights whose sums
    overflow (the exact check must decide those)."""
    d, f = 24, 200
    k1, k2 = jax.random.split(jax.random.key(11))
    w_up = jax.random.normal(k1, (d, f), dtype) if gated else None
    w_down = jax.random.normal(k2, (f, d), dtype)
    big = float(jnp.finfo(dtype).max) / 2
    cases = {
        "finite": (w_up, w_down),
        "nan_down": (w_up, w_down.at[17, 3].set(jnp.nan)),
        "inf_pair_down": (w_up, w_down.at[5, 7].set(jnp.inf).at[9, 7].set(-jnp.inf)),
        "overflowing_down": (w_up, w_down.at[:, 11].set(big)),
    }
    if gated:
        cases["inf_up"] = (w_up.at[2, 150].set(-jnp.inf), w_down)
        cases["overflowing_up"] = (w_up.at[:, 4].set(big), w_down)
        cases["nan_up_and_overflowing_down"] = (w_up.at[0, 0].set(jnp.nan), w_down.at[:, 1].set(big))
    check = jax.jit(cpu.finite_columns_by_sums)
    for name, (wu, wd) in cases.items():
        want = np.asarray(finite_columns(wu, wd))
        np.testing.assert_array_equal(np.asarray(check(wu, wd)), want, err_msg=name)
        if name.startswith("overflowing"):
            assert want.all(), name  # the case is finite: only the sums overflow


@pytest.mark.parametrize("dtype,m,kernel", [(jnp.bfloat16, 1, True), (jnp.bfloat16, 8, True), (jnp.bfloat16, 64, False),
                                            (jnp.bfloat16, 512, True), (jnp.float32, 1, False), (jnp.float32, 64, False),
                                            (jnp.float32, 256, True)],
                         ids=["bf16-m1", "bf16-m8", "bf16-m64", "bf16-m512", "f32-m1", "f32-m64", "f32-m256"])
def test_plain_call_takes_the_kernel_where_the_check_pays(dtype, m, kernel):
    """With nothing kept by a layer the call checks the weights (and transposes w_up)
    itself: bf16 calls of up to cpu.GATE_MAX_M tokens take the kernel at every M (XLA's
    products of so few bf16 rows are slow on the CPU), f32 calls and longer bf16 ones only
    where those passes leave the kernel a bound (cpu.WEIGHT_PASS_ENTRIES)."""
    x, w_gate, w_up, w_down = synthetic_ffn_inputs(jax.random.key(12), m, 64, 256, density=0.01, dtype=dtype)
    hlo = jax.jit(jt.sparse_ffn).lower(x, w_gate, w_up, w_down).as_text()
    assert ("jax_twell_cpu_up_down" in hlo) == kernel
    assert_close(jt.sparse_ffn(x, w_gate, w_up, w_down), dense_f32(x, w_gate, w_up, w_down),
                 fused_tolerance(dtype, 64 + 256), "public op")


def test_implementation_none_runs_the_kernel_on_the_cpu():
    x, w_gate, w_up, w_down = synthetic_ffn_inputs(jax.random.key(5), 300, 64, 256, density=0.01, dtype=jnp.float32)
    hlo = jax.jit(jt.sparse_ffn).lower(x, w_gate, w_up, w_down).as_text()
    assert "jax_twell_cpu_up_down" in hlo
    assert_close(jt.sparse_ffn(x, w_gate, w_up, w_down), dense_f32(x, w_gate, w_up, w_down),
                 fused_tolerance(jnp.float32, 64 + 256), "public op")


def test_module_infer_with_caches_runs_the_kernel():
    from flax import nnx

    from jax_twell.modules import SparseFFN

    layer = SparseFFN(32, 96, rngs=nnx.Rngs(0))
    layer.cache_transposed_up_weight(jnp.float32)
    x = jax.random.normal(jax.random.key(6), (1, 32))
    hlo = jax.jit(lambda x: layer.infer(x)).lower(x).as_text()
    assert "jax_twell_cpu_up_down" in hlo


def test_status_reports_the_module():
    status = _cpu.cpu_kernel_status()
    assert status.available and status.module and status.ffi_api is not None


def _train_grads(impl, inp, gated, cot):
    argnums = (0, 1, 2, 3) if gated else (0, 2, 3)

    def loss(*a):
        y, aux = jt.sparse_ffn_train(*a, implementation=impl)
        return (y.astype(jnp.float32) * cot).sum() + 0.37 * aux.l1

    fn = jax.jit(jax.value_and_grad(loss, argnums))
    return fn, fn(*inp)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_training_default_runs_the_kernels_where_g_is_sparse(gated):
    """The default training op on the CPU at a size where it chooses per call
    (jax_twell.ops.ffn_train.cpu.train_max_fraction): the kernels at 0.5% active, its dense
    side at 20%; both the dense formula's loss and gradients (value_and_grad, L1 term)."""
    m, d, f = 512, 2048, 2048
    for density in (0.005, 0.2):
        x, w_gate, w_up, w_down = synthetic_ffn_inputs(jax.random.key(21), m, d, f, density=density, dtype=jnp.float32)
        inp = (x, w_gate, w_up, w_down) if gated else (x, None, w_gate, w_down)
        cot = jax.random.normal(jax.random.key(22), (m, d), jnp.float32)
        fn, (loss, grads) = _train_grads(None, inp, gated, cot)
        if density == 0.005:
            assert "jax_twell_cpu_backward" in fn.lower(*inp).as_text()
        _, (loss_want, want) = _train_grads("xla", inp, gated, cot)
        tol = 2 * tolerance(jnp.float32, d + f + m, grad=True)
        assert_close(loss, loss_want, tol, f"loss {density}")
        for g, w in zip(grads, want):
            assert_close(g, w, tol, f"grad {density}")


@pytest.mark.parametrize("m,d,f,kernels", [(256, 2048, 2048, False), (512, 1024, 2048, False), (512, 2048, 2048, True)],
                         ids=["m256", "small-layer", "m512"])
def test_training_default_leaves_small_calls_to_xla(m, d, f, kernels):
    """Below TRAIN_MIN_TOKENS tokens or TRAIN_MIN_WEIGHT weights the step is XLA's own, with
    no count and no branch (jax_twell.ops.ffn_train.cpu)."""
    inp = tuple(synthetic_ffn_inputs(jax.random.key(23), m, d, f, density=0.005, dtype=jnp.float32))
    fn, _ = _train_grads(None, inp, True, jax.random.normal(jax.random.key(24), (m, d), jnp.float32))
    assert ("jax_twell_cpu_backward" in fn.lower(*inp).as_text()) == kernels


def test_the_per_call_count_reads_a_sample_of_rows():
    """The CPU per-call choice's count (cpu.sampled_nonzeros): every row where M is at most
    the smallest sample, else M // 8 rows (between the sample's bounds) at warp.sample_row_indices,
    scaled to M; rows off the sample do not move it, a NaN in the sample makes it NaN."""
    from jax_twell.ops.ffn import warp

    lo, hi = cpu.COUNT_SAMPLE_ROWS
    g = jax.nn.relu(jax.random.normal(jax.random.key(0), (lo, 40)))
    assert float(cpu.sampled_nonzeros(g)) == float((g > 0).sum())
    m, f = 1024, 24
    rows = min(hi, max(lo, m // 8))
    sampled = np.asarray(warp.sample_row_indices(m, rows))
    g = np.zeros((m, f), np.float32)
    g[sampled[:5]] = 1.0  # five full rows in the sample
    off = np.setdiff1d(np.arange(m), sampled)
    g[off[:50], :3] = 2.0  # entries off it
    assert float(cpu.sampled_nonzeros(jnp.asarray(g))) == 5 * f * m / rows
    g[sampled[7], 0] = np.nan
    assert np.isnan(float(cpu.sampled_nonzeros(jnp.asarray(g))))
    g[sampled[7], 0] = 0.0
    g[off[60], 0] = np.nan
    assert float(cpu.sampled_nonzeros(jnp.asarray(g))) == 5 * f * m / rows


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_cpu_dense_side_products_round_once(dtype):
    """The CPU paths' products (cpu._matmul): f32 sums rounded once to the operands'
    dtype, so a bf16 product is the f32 product of the same operands rounded."""
    a = jax.random.normal(jax.random.key(1), (33, 70), dtype)
    b = jax.random.normal(jax.random.key(2), (70, 29), dtype)
    want = np.asarray(jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32),
                                 precision=jax.lax.Precision.HIGHEST).astype(dtype), np.float32)
    got = cpu._matmul(a, b)
    assert got.dtype == dtype
    got = np.asarray(got, np.float32)
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    else:  # the f32 sums' order may differ from the reference's by a last bit: a rare tie
        np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=0)
        assert (got == want).mean() > 0.99


def test_long_bf16_calls_take_the_bf16_bounds():
    """bf16 calls past cpu.GATE_MAX_M tokens, whose dense side runs at the f32 rate or
    faster, take cpu.BF16_SPARSE_MAX_FRACTION (lower than the f32 bounds); calls of up to
    GATE_MAX_M tokens and f32 calls keep theirs."""
    for m in (cpu.GATE_MAX_M + 1, 64, 128, 129, 4096):
        want = next(b for upto, b in cpu.BF16_SPARSE_MAX_FRACTION if upto is None or m <= upto)
        assert cpu.sparse_max_fraction(m, union=True, bf16=True) == want
        assert want < cpu.sparse_max_fraction(m, union=True)
    assert cpu.sparse_max_fraction(cpu.GATE_MAX_M, bf16=True) == cpu.sparse_max_fraction(cpu.GATE_MAX_M)
    # M=512 with the caches: 1% active is under the bf16 bound (1.5%), 3% over it; either
    # side equals the dense formula
    bound = cpu.sparse_max_fraction(512, union=True, bf16=True)
    for density, under in ((0.01, True), (0.03, False)):
        x, w_gate, w_up, w_down = synthetic_ffn_inputs(jax.random.key(9), 512, 64, 512, density=density,
                                                       dtype=jnp.bfloat16)
        counted = float(cpu.sampled_nonzeros(jax.nn.relu(cpu._matmul(x, w_gate)))) / (512 * 512)
        assert (counted <= bound) == under, (density, counted)
        ok = finite_columns(w_up, w_down)
        y = jax.jit(lambda x: cpu.sparse_ffn(x, w_gate, w_up, w_down, w_up_t=w_up.T, weights_finite=ok))(x)
        assert_close(y, dense_f32(x, w_gate, w_up, w_down), fused_tolerance(jnp.bfloat16, 64 + 512), "bf16 bounds")
