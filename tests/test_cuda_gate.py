"""The fused gate kernel (ffi/twell_gate.cu): relu(x @ w) packed as TwELL in the GEMM's
epilogue, against the reference pack of the same activation, and the FFN paths using it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_twell as jt
from jax_twell.formats import pack_twell_reference, relu_matmul
from jax_twell.testing import synthetic_ffn_inputs
from specs import assert_close, fused_tolerance, tolerance
from jax_twell.ops.costs import DenseCrossover
from jax_twell.ops.ffn import binding as ffn_binding
from jax_twell.ops.ffn import reference as ffn_reference
from jax_twell.ops import xla
from cuda_calls import cuda_ffn
from cuda_calls import cuda_ffn_train
from jax_twell.ops.plan import Side

pytestmark = pytest.mark.gpu

TILE = 256


def integer_gate_inputs(seed: int, m: int, d: int, f: int, active: float, dtype=jnp.bfloat16):
    """x, w with small integer entries, so x @ w is exact in f32 whatever the order of the
    sum, and the fused kernel must match the reference bit for bit.

    Column 0 of x is -1 and row 0 of w a per-neuron shift (>= 1), so about ``active`` of
    the pre-activations are positive; one neuron in ten has a smaller shift (heavy-tailed
    neurons). With m > 2, row 0 is empty and row 1 fires everywhere (every tile past any
    capacity): their x[:, 0] is a power of two past d, which outweighs the other terms."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-1, 2, size=(m, d)).astype(np.float32)
    w = rng.integers(-1, 2, size=(d, f)).astype(np.float32)
    z = {0.5: 0.0, 0.05: 1.645, 0.02: 2.054, 0.005: 2.576}[active]
    shift = np.full(f, round(z * np.sqrt(4 / 9 * (d - 1))), np.float32)
    shift[rng.random(f) < 0.1] //= 2
    x[:, 0] = -1.0
    w[0, :] = np.maximum(shift, 1.0)
    if m > 2:
        big = float(2 ** int(np.ceil(np.log2(d))))
        x[0, 0] = -big  # -big * w0 + (at most d - 1) < 0: nothing fires
        x[1, 0] = big  # big * w0 - (at most d - 1) > 0: everything fires
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype)


def exact_relu_matmul(x, w):
    with jax.default_matmul_precision("highest"):
        g = jnp.maximum(jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32)), 0.0)
    return g.astype(x.dtype)


def assert_same_twell(got, want, what: str):
    for name in ("counts", "cols", "values"):
        a, b = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        assert a.shape == b.shape, f"{what}: {name} shape {a.shape} != {b.shape}"
        if name == "values":
            a, b = a.view(np.uint16), b.view(np.uint16)
        bad = np.argwhere(a != b)
        assert bad.size == 0, f"{what}: {name} differ at {len(bad)} places, first {bad[:3].tolist()}"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize(
    "m,d,f,active,capacity",
    [
        (1, 64, 256, 0.05, 32),
        (3, 64, 8, 0.5, 32),  # one partial tile of 8 columns
        (77, 136, 520, 0.02, 32),  # M and f not tile multiples, d not a multiple of 64
        (300, 512, 1032, 0.5, 64),  # dense: every tile far over capacity
        (1100, 2048, 5632, 0.005, 32),
        (2048, 1024, 4096, 0.02, 1),
    ],
    ids=lambda v: str(v),
)
@pytest.mark.parametrize("variant", [0, 1, 2, 1 + 8 + 32], ids=["cooperative", "pingpong", "pingpong_cluster4", "pingpong_n_swizzle4"])
def test_fused_gate_is_the_pack_of_the_exact_activation(m, d, f, active, capacity, dtype, variant):
    if dtype == jnp.float16 and d > 512:
        pytest.skip("row 1's values pass f16's range at this d")
    x, w = integer_gate_inputs(m + d + f, m, d, f, active, dtype)
    got = jax.jit(lambda x, w: ffn_binding.gate_pack(x, w, tile=TILE, capacity=capacity, variant=variant))(x, w)
    want = pack_twell_reference(exact_relu_matmul(x, w), tile=TILE, capacity=capacity)
    assert_same_twell(got, want, f"m={m} d={d} f={f} cap={capacity}")
    if m > 2:  # the adversarial rows are what the inputs promise
        counts = np.asarray(got.counts)
        assert counts[0].sum() == 0
        widths = np.minimum(TILE, f - TILE * np.arange(counts.shape[1]))
        assert (counts[1] == widths).all()
    assert 0 < int(np.asarray(got.counts).sum()) < m * f


@pytest.mark.parametrize("m,d,f", [(77, 256, 1000), (2048, 2048, 5632)])
def test_fused_gate_matches_xla_gate_on_random_inputs(m, d, f):
    """Normal inputs: the kernel's f32 sum runs in another order than XLA's, so g agrees to
    the last bit of bf16, and an element can flip to zero only where |g| is that small."""
    inp = synthetic_ffn_inputs(jax.random.key(m), m, d, f, density=0.02, dtype=jnp.bfloat16)
    got = ffn_binding.gate_pack(inp.x, inp.w_gate, tile=TILE, capacity=64)
    g_xla = relu_matmul(inp.x, inp.w_gate)
    dense = np.asarray(got.to_dense(inp.x, inp.w_gate), np.float32)  # overflowed tiles from XLA's g
    want = np.asarray(g_xla, np.float32)
    assert_close(dense, want, tolerance(jnp.bfloat16, d), f"m={m} d={d} f={f}")
    flipped = (dense != 0) != (want != 0)
    assert flipped.mean() < 1e-3
    if flipped.any():
        assert np.abs(np.where(flipped, dense + want, 0)).max() <= 2 ** -6 * np.abs(want).max()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_fused_gate_packs_tiny_and_non_finite_values_as_xla_and_the_pack(dtype):
    """An element is packed exactly when relu(a) rounds to a non-zero: a tie at half the
    smallest subnormal rounds to zero (even), a value above it to the subnormal; inf and
    NaN (inf * 0, inf - inf) are non-zeros. Compared with XLA's gate (the same tensor cores)
    and the reference pack: counts and columns equal, values equal bit for bit or both NaN."""
    d, f = 8, 16
    # Scales whose product is half the smallest subnormal: 2^-134 (bf16), 2^-25 (f16).
    sx, sw = (2.0**-67, 2.0**-67) if dtype == jnp.bfloat16 else (2.0**-12, 2.0**-13)
    x = np.zeros((4, d), np.float32)
    w = np.zeros((d, f), np.float32)
    w[0] = np.array([1, 1.5, -1, 0, 2, 1.25, 3, -1.5, 1, 1, 0.5, 4, 1, -2, 1, 1.75]) * sw
    w[1] = np.where(np.arange(f) % 3 == 0, -sw, sw)
    x[0, 0] = sx  # tiny: ties, values just above them, exact subnormals
    x[1, 0] = np.inf  # inf where w[0] > 0, NaN where w[0] == 0, zero where w[0] < 0
    x[2, :2] = np.inf  # inf - inf = NaN where the signs of w[0] and w[1] differ
    x[3] = np.arange(1, d + 1) * sx
    x, w = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
    got = ffn_binding.gate_pack(x, w, tile=TILE, capacity=8)
    want = pack_twell_reference(relu_matmul(x, w), tile=TILE, capacity=8)
    np.testing.assert_array_equal(np.asarray(got.counts), np.asarray(want.counts))
    np.testing.assert_array_equal(np.asarray(got.cols), np.asarray(want.cols))
    a, b = np.asarray(got.values, np.float32), np.asarray(want.values, np.float32)
    assert ((a == b) | (np.isnan(a) & np.isnan(b))).all(), (a, b)
    assert np.isnan(b).any() and np.isinf(b).any()
    if dtype == jnp.float16:  # f16's rounding boundary is an f32 normal: ties and values above it both present
        assert 0 < int(np.asarray(want.counts)[0].sum()) < f


@pytest.mark.parametrize("variant", [0, 1])
@pytest.mark.parametrize("f", [16, 264, 520])
def test_fused_gate_packs_no_padding_column_of_a_partial_last_tile(f, variant):
    """The GEMM computes a last, partial tile's columns past f as x @ 0, which is NaN on a
    row holding an inf or a NaN: those columns are not part of the problem and must not be
    packed. Rows of inf, NaN and -inf against ones and a mixed-sign weight; counts, columns
    and values equal the reference pack of XLA's gate."""
    d = 24
    x = np.zeros((6, d), np.float32)
    x[1, 0] = np.inf
    x[2, 3] = np.nan
    x[3, 5] = -np.inf
    x[4, :2] = np.inf
    x[5] = 1.0
    w = np.ones((d, f), np.float32)
    w[1, ::2] = -1.0
    x, w = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    got = ffn_binding.gate_pack(x, w, tile=TILE, capacity=64, variant=variant)
    want = pack_twell_reference(relu_matmul(x, w), tile=TILE, capacity=64)
    np.testing.assert_array_equal(np.asarray(got.counts), np.asarray(want.counts))
    np.testing.assert_array_equal(np.asarray(got.cols), np.asarray(want.cols))
    a, b = np.asarray(got.values, np.float32), np.asarray(want.values, np.float32)
    assert ((a == b) | (np.isnan(a) & np.isnan(b))).all()
    last = f - TILE * (got.counts.shape[1] - 1)  # the last tile's width
    assert int(np.asarray(got.counts)[:, -1].max()) <= last
    assert int(np.asarray(want.counts)[1, -1]) == last  # the inf row: every column inf or NaN


def test_fused_gate_leading_dims_and_vmap():
    x, w = integer_gate_inputs(5, 2 * 150, 64, 520, 0.05)
    x3 = x.reshape(2, 150, 64)
    want = pack_twell_reference(exact_relu_matmul(x3, w), tile=TILE, capacity=32)
    assert_same_twell(ffn_binding.gate_pack(x3, w, tile=TILE, capacity=32), want, "leading dims")
    got_v = jax.vmap(lambda xi: ffn_binding.gate_pack(xi, w, tile=TILE, capacity=32))(x3)
    assert_same_twell(got_v, want, "vmap")
    # The public op: the fused kernel from FUSED_GATE_MIN_TOKENS (2048) tokens, counted over
    # the leading dimensions; XLA's matmul + the pack below; the same result either way.
    xb, _ = integer_gate_inputs(5, 2048, 64, 520, 0.05)
    for lead in ((2, 1024), (2, 1023)):
        xl = xb[: lead[0] * lead[1]].reshape(*lead, 64)
        fn = lambda x: jt.gate_twell(x, w, implementation="cuda")
        assert ("jax_twell_gate_pack" in _custom_calls(fn, xl)) == (lead[1] == 1024)
        want_l = pack_twell_reference(exact_relu_matmul(xl, w), tile=TILE, capacity=32)
        assert_same_twell(fn(xl), want_l, f"gate_twell, {lead} tokens")


def test_fused_gate_refuses_what_it_cannot_tile():
    x, w = integer_gate_inputs(1, 16, 12, 256, 0.5)
    with pytest.raises(Exception, match="multiples of 8"):
        jax.block_until_ready(ffn_binding.gate_pack(x, w, tile=TILE, capacity=32))
    x, w = integer_gate_inputs(1, 16, 64, 256, 0.5)
    with pytest.raises(Exception, match="tiles of 256"):
        jax.block_until_ready(ffn_binding.gate_pack(x, w, tile=128, capacity=32))
    with pytest.raises(Exception, match="variant"):
        jax.block_until_ready(ffn_binding.gate_pack(x, w, tile=TILE, capacity=32, variant=3))
    with pytest.raises(Exception, match="bf16 or f16"):
        jax.block_until_ready(ffn_binding.gate_pack(x.astype(jnp.float32), w.astype(jnp.float32), tile=TILE, capacity=32))
    # The public op runs XLA's matmul + the pack kernel where the fused kernel does not fit.
    x, w = integer_gate_inputs(2, 16, 12, 256, 0.5)
    assert_same_twell(jt.gate_twell(x, w, implementation="cuda"), pack_twell_reference(exact_relu_matmul(x, w)), "d=12")


def _custom_calls(fn, *args) -> str:
    return str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("how", ["forced", "known_fraction"])
def test_sparse_ffn_with_the_fused_gate(gated, how):
    m, d, f = 2100, 256, 1032  # from FUSED_GATE_MIN_TOKENS (2048) tokens
    inp = synthetic_ffn_inputs(jax.random.key(3), m, d, f, density=0.01, pattern="heavy", dtype=jnp.bfloat16)
    w_gate, w_up = (inp.w_gate, inp.w_up) if gated else (None, inp.w_gate)
    if how == "forced":
        # the fused gate is the form with the backup's switch (with the device backup the
        # forced side takes XLA's gate and the pack: test_cuda_ffn_warp.py)
        fn = lambda x, wg, wu, wd: cuda_ffn(x, wg, wu, wd, tile=TILE, capacity=32, side=Side.SPARSE,
                                            device_backup=False)
    else:
        rule = DenseCrossover(margin=1e9, layer_min_tokens=0)  # a known fraction the rule sends to the kernels
        # the known layer's fused-gate form is the one with the backup's switch (with the
        # device backup it takes XLA's gate and the pack: test_cuda_ffn_warp.py)
        fn = lambda x, wg, wu, wd: cuda_ffn(x, wg, wu, wd, tile=TILE, capacity=32, active_fraction=1e-4,
                                            w_up_t=None if wg is None else wu.T, rule=rule, device_backup=False)
    args = (inp.x, w_gate, w_up, inp.w_down)
    assert "jax_twell_gate_pack" in _custom_calls(fn, *args)
    y = jax.jit(fn)(*args)
    want = ffn_reference.ffn(inp.x, w_gate, w_up, inp.w_down, tile=TILE, capacity=32)
    assert_close(y, want, 2 * fused_tolerance(jnp.bfloat16, f), f"{how} gated={gated}")


def test_training_ffn_with_the_fused_gate():
    m, d, f = 2100, 256, 1032  # from FUSED_GATE_MIN_TOKENS (2048) tokens
    inp = synthetic_ffn_inputs(jax.random.key(4), m, d, f, density=0.01, pattern="heavy", dtype=jnp.bfloat16)

    def loss(fn):
        def scalar(x, wg, wu, wd):
            y, l1, _, _ = fn(x, wg, wu, wd)
            return (y.astype(jnp.float32) ** 2).sum() * 1e-3 + 0.1 * l1

        return jax.value_and_grad(scalar, argnums=(0, 1, 2, 3))

    kernels = loss(lambda *a: cuda_ffn_train(*a, width=128, side=Side.SPARSE))
    args = (inp.x, inp.w_gate, inp.w_up, inp.w_down)
    assert "jax_twell_gate_pack" in _custom_calls(kernels, *args)
    (value, grads) = jax.jit(kernels)(*args)
    (want_value, want_grads) = jax.jit(loss(xla.ffn_with_aux))(*args)
    assert_close(value, want_value, 4 * tolerance(jnp.bfloat16, f), "loss")
    for name, a, b in zip(("dx", "dw_gate", "dw_up", "dw_down"), grads, want_grads):
        assert_close(a, b, 4 * fused_tolerance(jnp.bfloat16, f), name)
