"""The plans on CPU: what a call runs, decided from shapes, dtype, what is known about the
layer and the options (jax_twell.ops.plan), with no kernel and no device."""

import dataclasses
import inspect

import jax.numpy as jnp
import numpy as np
import pytest

import jax_twell as jt
from jax_twell.ops import layout
from jax_twell.ops.ffn import cuda as ffn_cuda
from jax_twell.ops.costs import DenseCrossover, TrainCrossover
from jax_twell.ops.plan import (
    FFNOptions,
    Kernel,
    LayerInfo,
    Path,
    Side,
    TrainOptions,
    plan_ffn,
    plan_ffn_train,
)

BF16 = jnp.bfloat16
HEADLINE = (16384, 2048, 5632)


def test_public_signatures_have_no_knobs():
    for fn in (jt.sparse_ffn, jt.sparse_ffn_train):
        assert list(inspect.signature(fn).parameters) == ["x", "w_gate", "w_up", "w_down", "implementation", "sharding"]


def test_sides_given_and_no_tokens():
    assert plan_ffn(0, 2048, 5632, BF16, gated=True).path == Path.EMPTY
    assert plan_ffn(4096, 2048, 5632, BF16, gated=True, layer=LayerInfo(side=Side.DENSE)).path == Path.DENSE
    forced = plan_ffn(300, 128, 704, BF16, gated=True, layer=LayerInfo(side=Side.SPARSE))
    assert forced.path == Path.TILES and not forced.device_choice and forced.prefer_blocked is True
    # a small call the rule prices dense at trace time
    assert plan_ffn(64, 2048, 5632, BF16, gated=True).path == Path.DENSE


def test_decode_sizes_with_a_known_fraction():
    known = LayerInfo(active_fraction=0.005)
    assert plan_ffn(1, 2048, 5632, BF16, gated=True, layer=known, w_up_t=True).path == Path.DECODE_GATE
    assert plan_ffn(1, 2048, 5632, BF16, gated=True, layer=known, w_up_t=True, w_act_t=True).path == Path.DECODE_ROWS
    assert plan_ffn(4, 2048, 5632, BF16, gated=True, layer=known, w_up_t=True, w_act_t=True).path == Path.DECODE_GATE
    assert plan_ffn(64, 2048, 5632, BF16, gated=True, layer=known, w_up_t=True).path == Path.DENSE  # past 0.4%
    assert plan_ffn(1, 2048, 5632, BF16, gated=True, layer=known).path == Path.DENSE  # w_up not transposed
    assert plan_ffn(1, 2048, 5632, BF16, gated=False, layer=known).path == Path.DECODE_GATE
    checked = FFNOptions(rule=DenseCrossover(decode_kernel_max_tokens=64, decode_dense_above=0.02))
    plan = plan_ffn(64, 2048, 5632, BF16, gated=True, options=checked, w_up_t=True)
    assert plan.path == Path.DECODE and plan.decode_check
    gather = FFNOptions(rule=DenseCrossover(decode_gather_max_tokens=64))
    assert plan_ffn(8, 2048, 5632, BF16, gated=True, options=gather).gather_width == 128 * 4


def test_one_token_with_both_transposed_weights_takes_the_rows_kernel_unasked():
    """A serving layer keeping w_up.T and w_gate.T (generate at one row) runs the rows
    kernel with no fraction known; without either copy, or past one token, or with a
    kernel asked for or the dense side given, it does not."""
    both = dict(w_up_t=True, w_act_t=True)
    assert plan_ffn(1, 2048, 5632, BF16, gated=True, **both).path == Path.DECODE_ROWS
    assert plan_ffn(1, 2048, 5632, BF16, gated=False, w_act_t=True).path == Path.DECODE_ROWS  # w_up is w_act
    assert plan_ffn(1, 2048, 5632, BF16, gated=True, w_up_t=True).path == Path.DENSE
    assert plan_ffn(1, 2048, 5632, BF16, gated=True, w_act_t=True).path == Path.DENSE
    assert plan_ffn(2, 2048, 5632, BF16, gated=True, **both).path == Path.DENSE
    assert plan_ffn(1, 2048, 5632, jnp.float32, gated=True, **both).path == Path.DENSE  # the kernel is bf16/f16
    assert plan_ffn(1, 2048, 5632, BF16, gated=True, layer=LayerInfo(side=Side.DENSE), **both).path == Path.DENSE
    off = FFNOptions(rule=DenseCrossover(decode_rows_unasked=False))
    assert plan_ffn(1, 2048, 5632, BF16, gated=True, options=off, **both).path == Path.DENSE
    assert plan_ffn(1, 2048, 5632, BF16, gated=True, options=FFNOptions(kernel=Kernel.WARP), **both).path != Path.DECODE_ROWS


def test_the_headline_shape_takes_the_warp_path():
    m, d, f = HEADLINE
    per_call = plan_ffn(m, d, f, BF16, gated=True)
    assert per_call.path == Path.WARP and per_call.device_choice and not per_call.fused_gate
    known = plan_ffn(m, d, f, BF16, gated=True, layer=LayerInfo(0.005))
    assert known.path == Path.WARP and not known.device_choice and known.fused_gate
    forced = plan_ffn(300, 128, 704, BF16, gated=True, layer=LayerInfo(side=Side.SPARSE),
                      options=FFNOptions(kernel=Kernel.WARP))
    assert forced.path == Path.WARP and not forced.device_choice
    # below WARP_MIN_TOKENS, past WARP_MAX_D and in f32 the other kernels plan as before
    assert plan_ffn(layout.WARP_MIN_TOKENS - 1, d, f, BF16, gated=True, layer=LayerInfo(side=Side.SPARSE)).path == Path.TILES
    assert plan_ffn(m, 4096, 11008, BF16, gated=True).path == Path.TILES
    assert plan_ffn(m, d, f, jnp.float32, gated=True).path == Path.TILES
    assert plan_ffn(m, d, f, BF16, gated=True, layer=LayerInfo(0.3)).path == Path.DENSE


def test_a_call_that_knows_nothing_runs_dense_where_its_choice_would_cost_more():
    """Below the rule's per_call_min_tokens (per_call_min_tokens_no_conditional where the
    choice is the device backup's flag), or d below per_call_min_d, a call with no
    fraction, side or kernel given is planned dense (measured losses there); a known
    fraction, a given side or an asked kernel still plan the kernels."""
    rule = dataclasses.replace(DenseCrossover(), per_call_min_tokens_no_conditional=None)
    d, f = 2048, 5632
    cond = FFNOptions(rule=rule)  # the choice a conditional
    for m in (1, 64, 512, 2048, rule.per_call_min_tokens - 1):
        assert plan_ffn(m, d, f, BF16, gated=True, options=cond).path == Path.DENSE, m
    assert plan_ffn(rule.per_call_min_tokens, d, f, BF16, gated=True, options=cond).path == Path.WARP
    rule = dataclasses.replace(rule, per_call_min_tokens_no_conditional=2048)  # the choice as a device flag
    floor = rule.per_call_min_tokens_no_conditional
    on_device = FFNOptions(rule=rule, choice_on_device=True)
    for m in (1, 64, 512, floor - 1):
        assert plan_ffn(m, d, f, BF16, gated=True, options=on_device).path == Path.DENSE, m
    assert plan_ffn(floor, d, f, BF16, gated=True, options=on_device).path == Path.WARP
    # the same rule with kernels whose choice is a conditional: the higher floor
    assert plan_ffn(floor, d, f, BF16, gated=True, options=FFNOptions(rule=rule)).path == Path.DENSE
    # without the device backup the choice is a conditional: the higher floor
    switch = FFNOptions(device_backup=False, rule=rule, choice_on_device=True)
    for m in (floor, rule.per_call_min_tokens - 1):
        assert plan_ffn(m, d, f, BF16, gated=True, options=switch).path == Path.DENSE, m
    assert plan_ffn(rule.per_call_min_tokens, d, f, BF16, gated=True, options=switch).path == Path.WARP
    lowered = FFNOptions(rule=dataclasses.replace(rule, per_call_min_tokens=1024))  # never raised
    assert plan_ffn(1024, d, f, BF16, gated=True, options=lowered).path != Path.DENSE
    assert plan_ffn(16384, 512, 1408, BF16, gated=True).path == Path.DENSE
    assert plan_ffn(16384, rule.per_call_min_d, 2816, BF16, gated=True).path == Path.WARP
    rule = DenseCrossover()
    no_per_call = FFNOptions(rule=dataclasses.replace(rule, per_call_min_tokens=0, per_call_min_d=0))
    for m in (64, 2048, 4096, 16384):  # the per-call floors do not reach a known fraction
        known = LayerInfo(0.005)
        a = plan_ffn(m, d, f, BF16, gated=True, layer=known)
        assert dataclasses.replace(a, options=no_per_call) == plan_ffn(m, d, f, BF16, gated=True, layer=known,
                                                                       options=no_per_call), m
    anywhere = FFNOptions(rule=dataclasses.replace(rule, per_call_min_tokens=0, per_call_min_d=0, layer_min_tokens=0))
    assert plan_ffn(2048, d, f, BF16, gated=True, layer=LayerInfo(side=Side.SPARSE)).path == Path.WARP
    assert plan_ffn(2048, d, f, BF16, gated=True, options=FFNOptions(kernel=Kernel.BLOCKED_UNION)).path == Path.TILES
    assert plan_ffn(2048, d, f, BF16, gated=True, options=anywhere).path == Path.WARP


def test_a_known_layer_runs_dense_below_its_token_floor_past_decode_sizes():
    """A known fraction below the rule's floor (and past the decode sizes) is planned dense:
    measured losing inside a model there. The floor is ``layer_min_tokens_no_conditional``
    where the warp path holds no conditional (the device backup, ``w_up.T`` given), else
    ``layer_min_tokens``. At the floor the kernels run; decode sizes keep their own bounds;
    a given side or an asked kernel is not overridden."""
    rule = DenseCrossover()
    d, f = 2048, 5632
    known = LayerInfo(0.002)
    low = rule.layer_min_tokens_no_conditional
    assert 2048 <= low < rule.layer_min_tokens
    for m in (65, 512, low - 1):
        assert plan_ffn(m, d, f, BF16, gated=True, layer=known, w_up_t=True).path == Path.DENSE, m
    for m in (low, 4096, rule.layer_min_tokens):
        assert plan_ffn(m, d, f, BF16, gated=True, layer=known, w_up_t=True).path == Path.WARP, m
    # without the transposed copy, or with the switch-form backup: the conditional's floor
    switch = FFNOptions(device_backup=False)
    for m in (low, rule.layer_min_tokens - 1):
        assert plan_ffn(m, d, f, BF16, gated=True, layer=known).path == Path.DENSE, m
        assert plan_ffn(m, d, f, BF16, gated=True, layer=known, w_up_t=True, options=switch).path == Path.DENSE, m
    assert plan_ffn(rule.layer_min_tokens, d, f, BF16, gated=True, layer=known).path == Path.WARP
    assert plan_ffn(rule.layer_min_tokens, d, f, BF16, gated=True, layer=known, w_up_t=True,
                    options=switch).path == Path.WARP
    # a shape the device backup does not take (f not a multiple of 8) keeps the higher floor
    assert plan_ffn(low, d, 5636, BF16, gated=True, layer=known, w_up_t=True).path == Path.DENSE
    assert plan_ffn(1, d, f, BF16, gated=True, layer=known, w_up_t=True, w_act_t=True).path == Path.DECODE_ROWS
    assert plan_ffn(2048, d, f, BF16, gated=True, layer=LayerInfo(side=Side.SPARSE)).path == Path.WARP
    asked = FFNOptions(kernel=Kernel.BLOCKED_UNION)
    assert plan_ffn(2048, d, f, BF16, gated=True, layer=known, options=asked).path == Path.TILES
    lower = FFNOptions(rule=dataclasses.replace(rule, layer_min_tokens=1024))
    assert plan_ffn(2048, d, f, BF16, gated=True, layer=known, options=lower).path == Path.WARP
    # a floor set below the warp path's tokens holds for the form without a conditional too
    # (w_up.T given never plans denser than without it)
    assert plan_ffn(2047, d, f, BF16, gated=True, layer=known, options=lower).path == Path.TILES
    assert plan_ffn(2047, d, f, BF16, gated=True, layer=known, w_up_t=True, options=lower).path == Path.TILES
    # the lower floor never lies above the conditional's own, where that is set lower
    both = FFNOptions(rule=dataclasses.replace(rule, layer_min_tokens=0, layer_min_tokens_no_conditional=4096))
    assert plan_ffn(2048, d, f, BF16, gated=True, layer=known, w_up_t=True, options=both).path == Path.WARP


def test_the_headline_shape_on_the_blocked_kernel():
    m, d, f = HEADLINE
    union = FFNOptions(kernel=Kernel.BLOCKED_UNION)
    per_call = plan_ffn(m, d, f, BF16, gated=True, options=union)
    assert per_call.path == Path.TILES and per_call.device_choice and per_call.prefer_blocked is None
    assert per_call.blocked and per_call.union_priced and not per_call.fused_gate
    assert per_call.steps.tensor_cores and per_call.steps.up_union and per_call.steps.down_union
    assert per_call.steps.down_stationary == DenseCrossover().down_stationary(m, d, f, 2, None, False)
    assert per_call.max_entries == layout.blocked_max_entries(m, f, 256, 32)
    known = plan_ffn(m, d, f, BF16, gated=True, layer=LayerInfo(0.005, 0.2), w_up_t=True, options=union)
    assert known.fused_gate and isinstance(known.prefer_blocked, bool) and known.gate_variant == 1
    assert not plan_ffn(m, d, f, BF16, gated=True, layer=LayerInfo(0.005), options=FFNOptions(fused_gate=False)).fused_gate
    unstationary = FFNOptions(kernel=Kernel.BLOCKED_UNION,
                              rule=dataclasses.replace(DenseCrossover(), stationary_down=False))
    assert not plan_ffn(m, d, f, BF16, gated=True, options=unstationary).steps.down_stationary
    row = plan_ffn(m, d, f, BF16, gated=True, options=FFNOptions(kernel="row"))
    assert row.path == Path.TILES and not row.blocked
    # f32 runs the row kernel; non-gated, the blocked kernel has no union steps
    assert not plan_ffn(m, d, f, jnp.float32, gated=True).blocked
    assert not plan_ffn(m, d, f, BF16, gated=False, options=union).steps.up_union
    with pytest.raises(ValueError, match="multiple of 64"):
        plan_ffn(m, 2056, f, BF16, gated=True, options=FFNOptions(kernel=Kernel.BLOCKED))


def test_plans_are_values():
    a = plan_ffn(*HEADLINE, BF16, gated=True, layer=LayerInfo(0.005))
    b = plan_ffn(*HEADLINE, BF16, gated=True, layer=LayerInfo(0.005))
    assert a == b and hash(a) == hash(b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.fused_gate = False
    with pytest.raises(ValueError, match="active_fraction"):
        LayerInfo(active_fraction=1.5)
    with pytest.raises(ValueError):
        FFNOptions(kernel="no such kernel")
    with pytest.raises(ValueError, match="kernel must be one of"):
        ffn_cuda.twell_ffn(None, None, None, None, None, kernel="auto")  # one kernel, named


def test_training_plans():
    m, d, f = HEADLINE
    for dtype, layer in ((BF16, LayerInfo(side=Side.DENSE)), (jnp.float32, LayerInfo()), (BF16, LayerInfo(0.3))):
        assert not plan_ffn_train(m, d, f, dtype, gated=True, layer=layer).kernels
    assert not plan_ffn_train(0, d, f, BF16, gated=True).kernels
    per_call = plan_ffn_train(m, d, f, BF16, gated=True)
    assert per_call.kernels and per_call.device_choice and not per_call.fused_gate
    assert per_call.steps.down_stationary and per_call.steps.dx_stationary and per_call.rule == TrainCrossover()
    known = plan_ffn_train(m, d, f, BF16, gated=True, layer=LayerInfo(0.005))
    assert known.kernels and not known.device_choice and known.fused_gate
    forced = plan_ffn_train(300, 64, 520, BF16, gated=True, layer=LayerInfo(side=Side.SPARSE))
    assert forced.kernels and not forced.device_choice  # below the rule's min_tokens, forced
    cuda_cores = plan_ffn_train(m, d, f, BF16, gated=True, options=TrainOptions(tensor_cores=False)).steps
    assert not (cuda_cores.up_union or cuda_cores.down_union or cuda_cores.dh_union or cuda_cores.down_stationary)
    assert not cuda_cores.dx_tensor_cores and not cuda_cores.dx_union  # dx follows tensor_cores
    with pytest.raises(ValueError, match="multiple of 64"):
        plan_ffn_train(m, 96, f, BF16, gated=True)
    with pytest.raises(ValueError, match="with active_fraction"):
        plan_ffn_train(m, d, f, BF16, gated=True, layer=LayerInfo(union_fraction=0.2))


def test_warp_layout_fit_counts_the_rows_past_the_layout_and_the_pairs_it_keeps():
    """Rows past 64 entries or with a 256-neuron tile past 32 are over; the kept fraction
    counts only the other rows' pairs."""
    from jax_twell.ops.stats import warp_layout_fit, warp_rows_over

    f = 600  # three tiles, the last one partial
    g = np.zeros((6, f), np.float32)
    g[0, :65 * 9:9] = 1.0  # 65 entries spread: past the budget
    g[1, :33] = 2.0  # 33 in the first tile: past its capacity
    g[2, :64 * 9:9] = 1.0  # 64 spread: fits
    g[3, 512:544] = 1.0  # 32 in the partial tile: fits
    g[4, 1] = -1.0  # negative values count as entries (the op's g is relu'd: not here)
    over, entries = warp_rows_over(jnp.asarray(g))
    assert np.asarray(over).tolist() == [True, True, False, False, False, False]
    assert np.asarray(entries).tolist() == [65, 33, 64, 32, 1, 0]
    fit = np.asarray(warp_layout_fit(jnp.asarray(g)))
    np.testing.assert_allclose(fit, [2 / 6, (64 + 32 + 1) / (6 * f)], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(warp_layout_fit(jnp.zeros((0, f)))), [0.0, 0.0])


def test_poisson_tail():
    from jax_twell.ops.costs import poisson_tail

    assert poisson_tail(0.0, 64) == 0.0
    assert poisson_tail(3.0, 0) == pytest.approx(1 - np.exp(-3.0))
    assert poisson_tail(65.0, 64) == pytest.approx(0.5164955945, rel=1e-8)  # scipy.stats.poisson.sf(64, 65)
    assert poisson_tail(28.0, 64) == pytest.approx(1.67934e-09, rel=1e-4)
    tails = [poisson_tail(mean, 64) for mean in (10.0, 40.0, 60.0, 80.0, 200.0)]
    assert tails == sorted(tails) and tails[-1] == pytest.approx(1.0)


def test_a_known_layer_on_the_warp_path_is_priced_by_its_backed_up_rows():
    """The warp path's price counts the rows its backup computes: a layer whose mean sits
    near the 64-entry budget runs dense, where the blocked kernels' model (not the kernel
    that runs) had sent it to the warp path; a measured overflow and kept fraction replace
    the Poisson stand-in."""
    rule = DenseCrossover()
    d, f, m = 2048, 5632, 16384
    assert rule.sparse_predicted(m, d, f, 2, 0.0115, True, Kernel.BLOCKED_UNION.value)  # the old pricing
    assert plan_ffn(m, d, f, BF16, gated=True, layer=LayerInfo(0.0115), w_up_t=True).path == Path.DENSE
    assert plan_ffn(m, d, f, BF16, gated=True, layer=LayerInfo(0.005), w_up_t=True).path == Path.WARP
    assert plan_ffn(2048, d, f, BF16, gated=True, layer=LayerInfo(0.005), w_up_t=True).path == Path.WARP
    # 2% of the tokens at 10-50% of f over a 0.5% bulk (mean 1.07%): sparse when measured
    tails = LayerInfo(0.0107, overflow_fraction=0.0195, kept_fraction=0.005)
    assert plan_ffn(m, d, f, BF16, gated=True, layer=tails, w_up_t=True).path == Path.WARP
    assert plan_ffn(m, d, f, BF16, gated=True, layer=LayerInfo(0.0107), w_up_t=True).path == Path.DENSE
    # a measured overflow of half the tokens at a low mean: the backup's products lose
    crowded = LayerInfo(0.005, overflow_fraction=0.5, kept_fraction=0.001)
    assert plan_ffn(m, d, f, BF16, gated=True, layer=crowded, w_up_t=True).path == Path.DENSE
    # the price: g's pack, entries at the warp rate, backed-up rows at the backup's, fixed;
    # transpose if not kept
    cost = rule.warp_cost(m, d, f, 2, 0.0107, 0.0195, 0.005)
    want = (m * f * 2 / rule.warp_pack_bandwidth + 0.005 * m * f * 2 * d * 2 / rule.warp_entry_bandwidth
            + 0.0195 * m * 4 * d * f / rule.warp_backup_gemm_flops + rule.warp_fixed_overhead)
    assert cost == pytest.approx(want)
    # below GEMM_BACKUP_MIN_TOKENS the backup runs on mma.sync, priced at its own rate
    small = layout.GEMM_BACKUP_MIN_TOKENS - 8
    backed = rule.warp_seconds(0.0, 100.0, small, d, f, 2) - rule.warp_seconds(0.0, 0.0, small, d, f, 2)
    assert backed == pytest.approx(100 * 4 * d * f / rule.warp_backup_flops)
    assert rule.warp_backup_gemm_flops > rule.warp_backup_flops
    assert rule.warp_cost(m, d, f, 2, 0.0107, 0.0195, 0.005, transposed=False) > cost
    with pytest.raises(ValueError, match="overflow_fraction"):
        rule.warp_cost(m, d, f, 2, 0.01, 1.5)
    with pytest.raises(ValueError, match="kept_fraction"):
        LayerInfo(0.01, kept_fraction=-0.1)


def test_known_layers_the_warp_path_loses_on_stay_dense():
    """Shapes where every sparse path measured below dense stay dense for a known layer:
    d=512 (f=1,408, M=16,384: 0.72-0.90x with w_up.T kept), whatever the fraction; and
    where the device backup does not apply (f not a multiple of 8, or the option off) the
    known layer is priced as before (the switch's form), not as the device backup."""
    rule = DenseCrossover()
    for d, f in ((512, 1408), (768, 2048)):
        for af in (0.001, 0.005):
            assert plan_ffn(16384, d, f, BF16, gated=True, layer=LayerInfo(af), w_up_t=True).path == Path.DENSE
    # the pack's price grows with M f: at d=1,024 a layer at 0.5% still runs sparse at 16,384
    assert plan_ffn(16384, 1024, 2816, BF16, gated=True, layer=LayerInfo(0.002), w_up_t=True).path == Path.WARP
    switch = FFNOptions(device_backup=False)
    for m, af in ((16384, 0.0115), (16384, 0.005), (65536, 0.009)):
        old = rule.sparse_predicted(m, 2048, 5632, 2, af, True, Kernel.BLOCKED_UNION.value)
        got = plan_ffn(m, 2048, 5632, BF16, gated=True, layer=LayerInfo(af), w_up_t=True, options=switch).path
        assert got == (Path.WARP if old else Path.DENSE), (m, af)


def test_the_non_gated_warp_path_is_priced_against_its_own_dense_side():
    """The non-gated FFN's entries read one weight row and its backed-up rows do one product,
    against a dense side of one product: both halves of the gated price, while the pack and
    the fixed costs stay whole. So it needs more tokens to win (M=2,048 at 0.5% runs dense
    non-gated, sparse gated), and no transpose is ever priced (it has no w_up)."""
    rule = DenseCrossover()
    m, d, f = 16384, 2048, 5632
    gated = rule.warp_seconds(1e6, 100.0, m, d, f, 2, transposed=False)
    plain = rule.warp_seconds(1e6, 100.0, m, d, f, 2, transposed=False, gated=False)
    fixed = m * f * 2 / rule.warp_pack_bandwidth + rule.warp_fixed_overhead
    transpose = 2.0 * d * f * 2 / rule.transpose_bandwidth
    assert plain - fixed == pytest.approx((gated - fixed - transpose) / 2)
    assert rule.dense_side_cost(m, d, f, 2, gated=False) == pytest.approx(rule.dense_cost(m, d, f, 2) / 2)
    known = LayerInfo(0.005)
    assert plan_ffn(2048, d, f, BF16, gated=True, layer=known, w_up_t=True).path == Path.WARP
    assert plan_ffn(2048, d, f, BF16, gated=False, layer=known).path == Path.DENSE
    assert plan_ffn(16384, d, f, BF16, gated=False, layer=known).path == Path.WARP
