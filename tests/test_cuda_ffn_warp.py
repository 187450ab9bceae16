"""The warp-per-token FFN kernel (ffi/twell_ffn_warp.cu) and its dense backup
(jax_twell/ops/warp.py) against the reference: every row exact, whichever side computes it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_twell._kernels import dense_if_available
from jax_twell.formats import pack_twell_reference, relu_matmul
from jax_twell.ops.ffn import reference
from jax_twell.ops.ffn import cuda, warp
from jax_twell.ops import xla
from jax_twell.ops.common import finite_columns
from jax_twell.ops.pack.binding import pack_twell
from jax_twell.testing import synthetic_ffn_inputs, with_extreme_rows
from specs import GPU_SPECS, assert_close, assert_rows_close, fused_tolerance

pytestmark = pytest.mark.gpu

SPECS = [s for s in GPU_SPECS if s.d <= warp.MAX_D and s.d % 8 == 0]
DEVICE_SPECS = [s for s in SPECS if warp.device_backup_supported(s.f)]


@pytest.fixture(params=["mma", "wgmma"])
def backup(request):
    """The device backup's two kernels, one contract: ffi/twell_backup.cu (mma.sync tiles in
    one cooperative launch) and ffi/twell_backup_gemm.cu (CUTLASS grouped GEMMs on wgmma)."""
    return warp.backup_rows if request.param == "mma" else warp.backup_rows_gemm


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


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("spec", DEVICE_SPECS, ids=str)
def test_device_backup_rows_match_reference(spec, dtype, gated, backup):
    """The device backup (ffi/twell_backup.cu) writes exactly the backed-up rows, each as
    the dense formula has it, and leaves every other row of y bit for bit; with no row to
    back up, y is untouched; with every row backed up, all of y is the dense FFN."""
    inp = synthetic_ffn_inputs(jax.random.key(spec.m + 17), spec.m, spec.d, spec.f, density=spec.density,
                               pattern=spec.pattern, dtype=dtype)
    if spec.pattern != "skewed" and spec.m > 4:
        inp = with_extreme_rows(inp, full=min(5, spec.m // 4), empty=1)
    w_act = inp.w_gate if gated else inp.w_up
    w_up = inp.w_up if gated else None
    x = inp.x if gated else None
    g = relu_matmul(inp.x, w_act)
    act = _act(inp.x, w_act, 256, 32)
    sentinel = jnp.full(inp.x.shape, 3.0, dtype)
    want = np.asarray(reference.twell_ffn(inp.x, act, w_act, w_up, inp.w_down), np.float32)
    for budget in (warp.ROW_BUDGET, 12, 0):
        left = np.asarray(warp.backed_up(act, budget))
        # g given, or recomputed from x for the listed rows (the fused gate writes no g)
        for given in (g, None):
            y = np.asarray(jax.jit(lambda xx, gg, a, wa, wu, wd, yy: backup(
                xx, gg, a, wu, wd, yy, row_budget=budget, w_act=wa))(
                x if given is not None else inp.x, given, act, w_act, w_up, inp.w_down, sentinel), np.float32)
            what = f"{spec} budget={budget} g {'given' if given is not None else 'recomputed'}"
            assert np.all(y[~left] == 3.0), f"{what}: a row not backed up was written"
            if left.any():
                assert_rows_close(y[left], want[left], dtype, what)


def _every_row(inp, w_act):
    """The TwELL form of ``w_act``'s activation with every row past a row budget of 0."""
    act = _act(inp.x, w_act, 256, 32)
    return dataclasses.replace(act, counts=jnp.maximum(act.counts, 1))


def _dense_rows(inp, w_act, gated):
    return xla.up_down(inp.x, relu_matmul(inp.x, w_act), inp.w_up if gated else None, inp.w_down)


@pytest.mark.parametrize("gated,given", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_device_backup_every_row_and_odd_shapes(dtype, gated, given, backup):
    """Shapes off the tiles (M, d and f not multiples of 64; f below one K step) with
    every row backed up, in each form: the products' edges are masked, and every row is
    the dense formula's (y starts as a sentinel, so an unwritten row fails)."""
    for m, d, f in [(1, 8, 8), (67, 72, 200), (130, 264, 1032), (2049, 512, 1416)]:
        inp = synthetic_ffn_inputs(jax.random.key(m + d), m, d, f, density=0.3, dtype=dtype)
        w_act = inp.w_gate if gated else inp.w_up
        g = relu_matmul(inp.x, w_act) if given else None
        y = backup(inp.x if gated or not given else None, g, _every_row(inp, w_act),
                             inp.w_up if gated else None, inp.w_down, jnp.full_like(inp.x, 3.0), row_budget=0,
                             w_act=w_act)
        assert_rows_close(y, _dense_rows(inp, w_act, gated), dtype, f"m={m} d={d} f={f}")


@pytest.mark.parametrize("given", [True, False])
def test_device_backup_more_tiles_than_ctas(given, backup):
    """2,048 rows of d=2048, f=5632 in one chunk: 2,816 tiles in the up product and 1,024 in
    the down product, more than the grid's CTAs (a few hundred), so each CTA goes through
    several tiles and refills its pipeline between them."""
    m, d, f = 2048, 2048, 5632
    inp = synthetic_ffn_inputs(jax.random.key(77), m, d, f, density=0.3)
    g = relu_matmul(inp.x, inp.w_gate)
    y = backup(inp.x, g if given else None, _every_row(inp, inp.w_gate), inp.w_up, inp.w_down,
                         jnp.full_like(inp.x, 3.0), row_budget=0, w_act=inp.w_gate, chunk_rows=m)
    assert_rows_close(y, xla.up_down(inp.x, g, inp.w_up, inp.w_down), jnp.bfloat16, "tiles > CTAs")


@pytest.mark.parametrize("gated,given", [(True, True), (True, False), (False, True), (False, False)])
def test_device_backup_in_chunks(gated, given, backup):
    """More backed-up rows than the scratch holds (chunks of 64 and of 1 row): every row
    exact, the products gone through chunk by chunk in one launch (its grid barriers)."""
    m, d, f = 700, 264, 520
    inp = with_extreme_rows(synthetic_ffn_inputs(jax.random.key(31), m, d, f, density=0.01), full=230, empty=4)
    w_act = inp.w_gate if gated else inp.w_up
    w_up = inp.w_up if gated else None
    g = relu_matmul(inp.x, w_act)
    act = _act(inp.x, w_act, 256, 32)
    left = np.asarray(warp.backed_up(act, warp.ROW_BUDGET))
    assert left.sum() >= 230
    want = np.asarray(reference.twell_ffn(inp.x, act, w_act, w_up, inp.w_down), np.float32)
    for chunk in (64, 1):
        y = backup(inp.x if gated or not given else None, g if given else None, act, w_up, inp.w_down,
                             jnp.full_like(inp.x, 3.0), w_act=w_act, chunk_rows=chunk)
        y = np.asarray(y, np.float32)
        assert_rows_close(y[left], want[left], jnp.bfloat16, f"chunk={chunk}")
        assert np.all(y[~left] == 3.0)


@pytest.mark.parametrize("gated,given", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("full", [1, 3, 70])
def test_device_backup_split_products(gated, given, full, backup):
    """A few backed-up rows of a wide layer: each product has fewer tiles than half the grid,
    so its K loop is split over CTAs and the slices' partials summed in a reduction phase
    (70 rows: two row tiles). Every row as the dense formula has it, the others untouched,
    and the same bits call after call."""
    m, d, f = 1024, 1024, 5632
    inp = with_extreme_rows(synthetic_ffn_inputs(jax.random.key(full + 5), m, d, f, density=0.003), full=full, empty=2)
    w_act = inp.w_gate  # the sparse activation's weight, gated or not (w_up's activation would be dense)
    w_up = inp.w_up if gated else None
    g = relu_matmul(inp.x, w_act)
    act = _act(inp.x, w_act, 256, 32)
    left = np.asarray(warp.backed_up(act, warp.ROW_BUDGET))
    assert full <= left.sum() < 2 * full + 8
    want = np.asarray(reference.twell_ffn(inp.x, act, w_act, w_up, inp.w_down), np.float32)
    fn = jax.jit(lambda xx, gg, a, wa, wu, wd, yy: backup(xx, gg, a, wu, wd, yy, w_act=wa))
    args = (inp.x if gated or not given else None, g if given else None, act, w_act, w_up, inp.w_down,
            jnp.full_like(inp.x, 3.0))
    y = np.asarray(fn(*args), np.float32)
    assert np.all(y[~left] == 3.0)
    assert_rows_close(y[left], want[left], jnp.bfloat16, f"full={full}")
    assert np.array_equal(np.asarray(fn(*args), np.float32), y)


def test_device_backup_is_deterministic(backup):
    """The list's order varies with the atomics; no bit of y may."""
    m, d, f = 4096, 256, 1024
    inp = with_extreme_rows(synthetic_ffn_inputs(jax.random.key(8), m, d, f, density=0.01), full=300)
    g = relu_matmul(inp.x, inp.w_gate)
    act = _act(inp.x, inp.w_gate, 256, 32)
    fn = jax.jit(lambda *a: backup(*a))
    first = np.asarray(fn(inp.x, g, act, inp.w_up, inp.w_down, jnp.zeros_like(inp.x)))
    for _ in range(3):
        assert np.array_equal(np.asarray(fn(inp.x, g, act, inp.w_up, inp.w_down, jnp.zeros_like(inp.x))), first)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_unless_kernels_match_when_not_skipped(gated):
    """The pack and the warp kernel with a skip flag (the per-call choice's dense side): with
    the flag unset, the same arrays and rows bit for bit as without it."""
    m, d, f = 1100, 256, 1032
    inp = with_extreme_rows(synthetic_ffn_inputs(jax.random.key(5), m, d, f, density=0.01), full=20, empty=3)
    g = relu_matmul(inp.x, inp.w_gate)
    want = pack_twell(g, tile=256, capacity=32)
    got = jax.jit(lambda a, s: pack_twell(a, tile=256, capacity=32, skip=s))(g, jnp.asarray(False))
    for a, b in zip((want.values, want.cols, want.counts), (got.values, got.cols, got.counts)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    skipped = jax.jit(lambda a, s: pack_twell(a, tile=256, capacity=32, skip=s))(g, jnp.asarray(True))
    assert not np.asarray(skipped.counts).any()  # set: empty tiles, so a backup lists no row
    w_up_t = inp.w_up.T if gated else None
    y0 = warp.ffn_rows(inp.x, want, w_up_t, inp.w_down)
    y1 = jax.jit(lambda x, a, wu, wd, s: warp.ffn_rows(x, a, wu, wd, skip=s))(inp.x, want, w_up_t, inp.w_down,
                                                                               jnp.asarray(False))
    np.testing.assert_array_equal(np.asarray(y0, np.float32), np.asarray(y1, np.float32))


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("m,d,f", [(2048, 256, 1024), (67, 72, 200), (1, 8, 8)])
def test_gemm_backup_dense_flag(gated, m, d, f):
    """The wgmma backup's dense flag: set, every row of y is the dense formula's whatever
    the counts (y starts as a sentinel, so a row left unwritten fails); unset, only the
    backed-up rows are written, on the same inputs."""
    inp = with_extreme_rows(synthetic_ffn_inputs(jax.random.key(m + 3), m, d, f, density=0.01), full=min(3, m),
                            empty=0)
    w_act = inp.w_gate if gated else inp.w_up
    w_up = inp.w_up if gated else None
    g = relu_matmul(inp.x, w_act)
    act = _act(inp.x, w_act, 256, 32)
    sentinel = jnp.full(inp.x.shape, 3.0, inp.x.dtype)
    fn = jax.jit(lambda xx, gg, a, wu, wd, yy, flag: warp.backup_rows_gemm(xx, gg, a, wu, wd, yy, dense=flag))
    x = inp.x if gated else None
    y = fn(x, g, act, w_up, inp.w_down, sentinel, jnp.asarray(True))
    assert_rows_close(y, _dense_rows(inp, w_act, gated), inp.x.dtype, f"dense m={m}")
    left = np.asarray(warp.backed_up(act, warp.ROW_BUDGET))
    y = np.asarray(fn(x, g, act, w_up, inp.w_down, sentinel, jnp.asarray(False)), np.float32)
    assert np.all(y[~left] == 3.0)
    want = np.asarray(_dense_rows(inp, w_act, gated), np.float32)
    if left.any():
        assert_rows_close(y[left], want[left], inp.x.dtype, f"sparse m={m}")


@pytest.mark.parametrize("case", ["sparse", "tail", "dense", "nan_x", "nan_w_down", "inf_w_up"])
@pytest.mark.parametrize("backup_name,device_choice", [("mma", False), ("wgmma", False), ("wgmma", True),
                                                        ("mma", "dense_if")],
                         ids=["cond", "gemm_cond", "flag", "dense_if"])
def test_per_call_device_backup_exact(case, backup_name, device_choice):
    """The per-call form with the device backup (no switch) on each side and with
    non-finite operands: the dense formula's values and NaN; with either backup behind the
    ``lax.cond``, with the choice as a device flag to the wgmma backup, and with the dense
    side on cuBLAS in a conditional graph node (the last two with no conditional)."""
    if device_choice == "dense_if" and not dense_if_available():
        pytest.skip("the library was built without cuBLASLt's header")
    m, d, f = 2048, 256, 1024
    inp = synthetic_ffn_inputs(jax.random.key(21), m, d, f, density=0.3 if case == "dense" else 0.004)
    if case == "tail":
        inp = with_extreme_rows(inp, full=40, empty=3)
    if case == "nan_x":
        inp = inp._replace(x=inp.x.at[7, 3].set(jnp.nan))
    if case == "nan_w_down":
        inp = inp._replace(w_down=inp.w_down.at[9, 5].set(jnp.nan))
    if case == "inf_w_up":
        inp = inp._replace(w_up=inp.w_up.at[4, 11].set(jnp.inf))
    kernel = warp.backup_rows_gemm if backup_name == "wgmma" else warp.backup_rows
    dense_kernel = warp.dense_ffn_if if device_choice == "dense_if" else None
    fn = jax.jit(lambda x, wg, wu, wd: warp.sparse_ffn(x, wg, wu, wd, backup_kernel=kernel,
                                                       columns=lambda: finite_columns(wu, wd),
                                                       device_choice=device_choice is True, dense_kernel=dense_kernel))
    y = np.asarray(fn(*inp), np.float32)
    want = np.asarray(xla.ffn(*inp), np.float32)
    assert np.array_equal(np.isnan(y), np.isnan(want)), case
    ok = np.isfinite(want)
    assert_close(np.where(ok, y, 0), np.where(ok, want, 0), fused_tolerance(jnp.bfloat16, f), case)


@pytest.mark.parametrize("spec", DEVICE_SPECS, ids=str)
def test_with_device_backup_matches_reference(spec):
    """The known-layer form with no conditional (XLA's gate, the pack, the warp kernel, the
    device backup) on every spec, with fully active and empty rows mixed in."""
    inp = synthetic_ffn_inputs(jax.random.key(spec.m + 23), spec.m, spec.d, spec.f, density=spec.density,
                               pattern=spec.pattern, dtype=jnp.bfloat16)
    if spec.pattern != "skewed" and spec.m > 4:
        inp = with_extreme_rows(inp, full=min(3, spec.m // 4), empty=1)

    def fn(x, wg, wu, wd):
        g = relu_matmul(x, wg)
        act = pack_twell(g, tile=256, capacity=32)
        return warp.ffn_with_backup(x, g, act, wu, wd, finite_columns(wu, wd))

    def fused(x, wg, wu, wd):  # the gate packed in its matmul's epilogue: no g
        act = cuda.gate_twell(x, wg, tile=256, capacity=32)
        return warp.ffn_with_backup(x, None, act, wu, wd, finite_columns(wu, wd), w_act=wg)

    want = xla.ffn(*inp)
    for form in (fn, fused):
        y = jax.jit(form)(*inp)
        assert_close(y, want, fused_tolerance(jnp.bfloat16, spec.f), f"{spec} {form.__name__}")


@pytest.mark.parametrize("layer", ["per_call", "known", "forced"])
@pytest.mark.parametrize("m", [1100, 2048, 8192])
def test_op_with_the_device_backup(layer, m):
    """The inference op with the default ``FFNKernels.warp_backup`` (the mma.sync backup
    below ``GEMM_BACKUP_MIN_TOKENS``, the wgmma one from there): the per-call form (one
    conditional), a known layer and a forced one (none: XLA's gate, the pack, the warp
    kernel and the device backup), with fully active rows (the plans are checked on the CPU
    in test_cuda_dispatch.py)."""
    from jax_twell.ops.ffn import cuda as ffn_cuda
    from jax_twell.ops.plan import FFNOptions, Kernel, LayerInfo, Side
    from jax_twell.ops.costs import DenseCrossover

    d, f = 2048, 5632
    # Known and forced: past the switch's largest size (M/8); per call, under the sample's
    # bound (M/16), so that its sparse side runs.
    full = m // 30 if layer == "per_call" else m // 6
    inp = with_extreme_rows(synthetic_ffn_inputs(jax.random.key(m + 41), m, d, f, density=0.005), full=full, empty=3)
    kernels = ffn_cuda.BINDINGS
    assert kernels.warp_backup is warp.backup_rows_by_size
    info = {"per_call": LayerInfo(), "known": LayerInfo(active_fraction=0.001), "forced": LayerInfo(side=Side.SPARSE)}[layer]
    rule = DenseCrossover(per_call_min_tokens=0, layer_min_tokens=0)
    options = FFNOptions(kernel=Kernel.WARP, rule=rule)
    fn = jax.jit(lambda x, wg, wu, wd: ffn_cuda.sparse_ffn(x, wg, wu, wd, layer=info, options=options, kernels=kernels))
    y = fn(*inp)
    assert_close(y, xla.ffn(*inp), fused_tolerance(jnp.bfloat16, f), f"{layer} m={m}")


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("m,d,f", [(2048, 256, 1024), (67, 72, 200), (1, 8, 8)])
def test_dense_ffn_if(gated, dtype, m, d, f):
    """The dense side on cuBLAS behind a device flag (ffi/twell_dense_if.cu): unset, y is
    y_in bit for bit; set, every row is the dense formula's. Called again with other
    operands (a new graph) and with the first ones (the kept one), each still right."""
    if not dense_if_available():
        pytest.skip("the library was built without cuBLASLt's header")
    fn = jax.jit(lambda x, g, wu, wd, y, flag: warp.dense_ffn_if(x, g, wu, wd, y, flag))
    for key in (m + 11, m + 12, m + 11):
        inp = synthetic_ffn_inputs(jax.random.key(key), m, d, f, density=0.3, dtype=dtype)
        w_act = inp.w_gate if gated else inp.w_up
        w_up = inp.w_up if gated else None
        g = relu_matmul(inp.x, w_act)
        sentinel = jnp.full(inp.x.shape, 3.0, dtype)
        kept = np.asarray(fn(inp.x, g, w_up, inp.w_down, sentinel, jnp.asarray(False)), np.float32)
        np.testing.assert_array_equal(kept, np.full(inp.x.shape, 3.0, np.float32))
        got = np.asarray(fn(inp.x, g, w_up, inp.w_down, sentinel, jnp.asarray(True)), np.float32)
        want = np.asarray(xla.up_down(inp.x, g, w_up, inp.w_down).astype(dtype), np.float32)
        assert_close(got, want, fused_tolerance(dtype, f), f"dense_ffn_if m={m} d={d} f={f}")


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("m,d,f", [(300, 2048, 5632), (67, 72, 200), (130, 264, 1032), (5, 8, 8)])
def test_kernel_nan_rule_matches_reference(gated, dtype, m, d, f):
    """ffn_rows with the weights' finite columns: the rows it computes carry the dense
    formula's NaN (a NaN and an Inf in x's rows, two columns masked off, the row vote
    across both warps of a row at d=2048 and over one warp at d<=256) as the reference
    puts it; the rows it leaves are zero; without columns the same rows are the plain
    sums. Per element: NaN exactly where the reference has NaN."""
    inp = with_extreme_rows(synthetic_ffn_inputs(jax.random.key(m + d), m, d, f, density=0.01, dtype=dtype),
                            full=min(2, m - 2))
    x = inp.x.at[1, d - 1].set(jnp.inf).at[m - 1, 0].set(jnp.nan)
    act = _act(inp.x, inp.w_gate, 256, 32)  # the activation of finite x, so the poisoned rows are kept rows
    w_up_t = inp.w_up.T if gated else None
    cols = jnp.ones((d,), bool).at[d // 2].set(False).at[3].set(False)
    for columns in (None, cols):
        y = np.asarray(warp.ffn_rows(x, act, w_up_t, inp.w_down, columns=columns), np.float32)
        want = np.asarray(warp.ffn_rows_reference(x, act, w_up_t, inp.w_down, columns=columns), np.float32)
        assert np.array_equal(np.isnan(y), np.isnan(want)), f"NaN pattern, columns={columns is not None}"
        assert np.array_equal(np.isinf(y), np.isinf(want))
        ok = np.isfinite(want)
        assert_close(np.where(ok, y, 0), np.where(ok, want, 0), fused_tolerance(dtype, f), f"m={m} d={d} f={f}")
    left = np.asarray(warp.backed_up(act, warp.ROW_BUDGET))
    assert np.all(y[left] == 0)
    assert np.isnan(y[m - 1]).all() or left[m - 1]  # a NaN in x poisons its whole row


def test_op_nan_rule_in_the_kernel():
    """The per-call op and a known layer with the NaN rule in the warp kernel (no pass over
    y): a NaN in x's row, an Inf in w_down's column, a NaN in w_up: the dense formula's
    NaN pattern exactly, every other element close to it."""
    from jax_twell.ops.ffn import cuda as ffn_cuda
    from jax_twell.ops.plan import FFNOptions, Kernel, LayerInfo
    from jax_twell.ops.costs import DenseCrossover

    m, d, f = 2048, 2048, 5632
    base = with_extreme_rows(synthetic_ffn_inputs(jax.random.key(5), m, d, f, density=0.005), full=20, empty=3)
    rule = DenseCrossover(per_call_min_tokens=0, layer_min_tokens=0)
    options = FFNOptions(kernel=Kernel.WARP, rule=rule)
    for case in ("x_nan", "w_down_inf", "w_up_nan"):
        inp = base
        if case == "x_nan":
            inp = inp._replace(x=inp.x.at[17, 4].set(jnp.nan))
        elif case == "w_down_inf":
            inp = inp._replace(w_down=inp.w_down.at[9, 100].set(jnp.inf))
        else:
            inp = inp._replace(w_up=inp.w_up.at[3, 70].set(jnp.nan))
        want = np.asarray(xla.ffn(*inp), np.float32)
        for info in (LayerInfo(), LayerInfo(active_fraction=0.001)):
            fn = jax.jit(lambda x, wg, wu, wd: ffn_cuda.sparse_ffn(x, wg, wu, wd, layer=info, options=options))
            y = np.asarray(fn(*inp), np.float32)
            assert np.array_equal(np.isnan(y), np.isnan(want)), f"{case} {info}"
            ok = np.isfinite(want)
            assert_close(np.where(ok, y, 0), np.where(ok, want, 0), fused_tolerance(jnp.bfloat16, f), f"{case}")


def _crowd(g, start, rows, width=48):
    """g with rows ``start .. start + rows`` active on ``width`` neighbouring columns only
    (one TwELL tile of 256 past its capacity of 32 at width > 32, the row within the budget
    of 64): rows the kernel reading g keeps where the TwELL kernel leaves them to the
    backup. ``start`` past with_extreme_rows' full and empty rows, which stay as they are."""
    cols = jnp.arange(g.shape[1])
    row = jnp.where((cols >= 8) & (cols < 8 + width), jnp.asarray(1.5, g.dtype), jnp.zeros((), g.dtype))
    return g.at[start:start + rows].set(jnp.broadcast_to(row, (rows, g.shape[1])))


def _odd_values(g, row):
    """g with row ``row`` holding the bit patterns the kernel's test must tell apart: -0
    (not an entry), NaN and a negative value (entries, as ``g != 0`` has them) and a
    subnormal (an entry), beside its own entries."""
    f = g.shape[1]
    tiny = jnp.finfo(g.dtype).smallest_subnormal
    vals = jnp.asarray([-0.0, jnp.nan, -2.0, tiny], g.dtype)
    idx = jnp.asarray([0, f // 3, f // 2, f - 1])
    return g.at[row, idx].set(vals)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("m,d,f", [(300, 2048, 5632), (257, 2048, 1408), (67, 72, 200), (130, 264, 1032),
                                   (33, 1040, 3000), (1, 8, 8), (5, 8, 8), (96, 512, 1408)])
def test_kernel_from_g_matches_reference(gated, dtype, m, d, f):
    """ffn_rows_from_g (the rows listed from g in the kernel) against its reference: the
    counts exactly, zeros on the rows past the budget (fully active rows), the kept rows
    close, with and without the NaN rule (a NaN and an Inf in x, two columns masked);
    budgets 64, 12 and 0; rows whose entries crowd one tile are kept."""
    inp = with_extreme_rows(synthetic_ffn_inputs(jax.random.key(m + d + 3), m, d, f, density=0.01, dtype=dtype),
                            full=min(2, m - 1), empty=min(1, m - 1))
    # the sparse gate's activation in both forms (non-gated, it is the hidden itself), of
    # finite x, so that the poisoned rows below stay rows
    g = relu_matmul(inp.x, inp.w_gate)
    full_rows = min(2, m - 1)  # with_extreme_rows' full rows come first, then the empty one
    first = full_rows + min(1, m - 1)
    crowded = f >= 256 and m >= first + 4
    if crowded:
        g = _crowd(g, first, 3)
    if m >= first + 5:
        g = _odd_values(g, first + 3)
    x = inp.x
    if m >= 5:
        x = x.at[m - 2, d - 1].set(jnp.inf).at[m - 1, 0].set(jnp.nan)
    w_up_t = inp.w_up.T if gated else None
    cols = jnp.ones((d,), bool).at[d // 2].set(False).at[3].set(False)
    fn = jax.jit(warp.ffn_rows_from_g, static_argnames=("row_budget",))
    for budget in (64, 12, 0):
        for columns in (None, cols):
            y, counts = fn(x, g, w_up_t, inp.w_down, row_budget=budget, columns=columns)
            want, want_counts = warp.ffn_rows_from_g_reference(x, g, w_up_t, inp.w_down, row_budget=budget,
                                                               columns=columns)
            np.testing.assert_array_equal(np.asarray(counts.counts), np.asarray(want_counts.counts))
            y, want = np.asarray(y, np.float32), np.asarray(want, np.float32)
            what = f"m={m} d={d} f={f} budget={budget} columns={columns is not None}"
            assert np.array_equal(np.isnan(y), np.isnan(want)), what
            assert np.array_equal(np.isinf(y), np.isinf(want)), what
            left = np.asarray(want_counts.counts)[:, 0] > budget
            assert np.all(y[left] == 0), what
            ok = np.isfinite(want)
            assert_close(np.where(ok, y, 0), np.where(ok, want, 0), fused_tolerance(dtype, f), what)
            if crowded and budget == 64:  # kept, and not zero: past the TwELL tile's capacity
                crowd = slice(first, first + 3)
                assert np.asarray(warp.backed_up(pack_twell_reference(g, tile=256, capacity=32), 64))[crowd].all()
                assert not left[crowd].any() and np.abs(np.where(ok, y, 0)[crowd]).max() > 0, what
            if budget == 0 and full_rows:  # every row with an entry leaves; the full rows have f
                assert np.all(np.asarray(counts.counts)[:full_rows, 0] == f) and left[:full_rows].all(), what


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("m,d,f", [(2048, 2048, 5632), (300, 256, 1024), (77, 72, 200)])
def test_from_g_with_backup_matches_dense(gated, m, d, f, backup):
    """ffn_from_g_with_backup: the kernel reading g and either device backup over the rows
    it leaves (fully active, empty and crowded rows, rows past the budget): the dense
    formula of that g on every row, and the same bits when run again (deterministic)."""
    full = m // 20 + 1
    inp = with_extreme_rows(synthetic_ffn_inputs(jax.random.key(m + 7), m, d, f, density=0.005), full=full, empty=3)
    w_up = inp.w_up if gated else None

    def fn(x, g, wu, wd):
        return warp.ffn_from_g_with_backup(x, g, wu, wd, finite_columns(wu, wd), backup_kernel=backup)

    g = _crowd(relu_matmul(inp.x, inp.w_gate), full + 3, 4)
    assert int((np.asarray(g) != 0).sum(axis=1).max()) > warp.ROW_BUDGET  # the backup has rows to compute
    run = jax.jit(fn)
    y = run(inp.x, g, w_up, inp.w_down)
    want = xla.up_down(inp.x, g, w_up, inp.w_down)
    assert_close(y, want, fused_tolerance(jnp.bfloat16, f), f"m={m} d={d} f={f}")
    np.testing.assert_array_equal(np.asarray(run(inp.x, g, w_up, inp.w_down), np.float32), np.asarray(y, np.float32))


def test_from_g_bad_operands_are_refused():
    """The kernel reading g refuses f not a multiple of 8 and mismatched shapes by name."""
    inp = synthetic_ffn_inputs(jax.random.key(1), 16, 64, 100, density=0.05)
    g = relu_matmul(inp.x, inp.w_gate)
    with pytest.raises(ValueError, match="multiple of 8"):
        warp.ffn_rows_from_g(inp.x, g, inp.w_up.T, inp.w_down)
    with pytest.raises(ValueError, match="g must be"):
        warp.ffn_rows_from_g(inp.x, g[:, :96], inp.w_up.T, inp.w_down)
