"""The per-layer trace-time choice of the CUDA training FFN in the loop (train/ffn_paths):
the rule's hysteresis and its use of each layer's measured union, the register in the
train state (updated by the loop at log steps only), and the model traced with each
layer's side. On CPU the sparse FFN runs the reference
implementation with the choice switched on by hand: the mechanism, not the kernels."""

import dataclasses
import json
import types
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_twell.ops import cuda_train
from jax_twell.train import config, ffn_paths, optimizer, sharding
from jax_twell.train.state import setup_model
from jax_twell.train.step import make_train_step
from test_train_step import CFG, _batch

# Crosses over at 0.5% active for m=300, d=64, f=520 (see test_train_emulation).
HALF_PERCENT = cuda_train.TrainCrossover(
    matmul_rate=16 * 64 / (0.005 * 12 * 64 / 1e12), hbm_bandwidth=1e30, union_bandwidth=1e30,
    transpose_bandwidth=1e30, pair_rate=1e12, grad_stream_bandwidth=1e12, fixed_overhead=0.0, min_tokens=1,
)


@pytest.fixture
def rule():
    def use(r):
        previous = cuda_train.set_train_crossover(r)
        restore.append(previous)

    restore = []
    yield use
    for previous in restore[::-1]:
        cuda_train.set_train_crossover(previous)


def test_sides_change_with_hysteresis(rule):
    rule(HALF_PERCENT)
    paths = ffn_paths.PathRule(m=300, d=64, f=520)
    sparse = jnp.asarray([False, False, True, True, False])
    fraction = jnp.asarray([0.001, 0.0048, 0.0052, 0.02, 0.0])
    # dense -> sparse only when 10% denser would still win; sparse -> dense only when 10%
    # sparser would lose: 0.48% stays dense, 0.52% stays sparse.
    np.testing.assert_array_equal(paths.next(sparse, fraction), [True, False, True, False, True])
    rule(dataclasses.replace(HALF_PERCENT, min_tokens=301))  # the kernels never run for 300 tokens
    np.testing.assert_array_equal(paths.next(sparse, fraction), [False] * 5)
    with pytest.raises(ValueError, match="one value per layer"):
        paths.next(sparse, fraction[:4])


# Only the union rows cost: the kernels win below a union of 0.36 of f for m=300, d=64,
# f=520 (dense 16 m d f / matmul_rate against 5 blocks x union x f x 5 d x 2 B at 1e12 B/s).
UNION_ONLY = dataclasses.replace(HALF_PERCENT, pair_rate=1e30, grad_stream_bandwidth=1e30, union_bandwidth=1e12)


def test_sides_follow_the_measured_union(rule):
    rule(UNION_ONLY)
    crossing = UNION_ONLY.dense_cost(300, 64, 520) * 1e12 / (5 * 520 * 5 * 64 * 2)
    assert 0.3 < crossing < 0.4
    paths = ffn_paths.PathRule(m=300, d=64, f=520)
    # 1% active: the uniform pattern's union (47% of f) loses; a trained layer's smaller one wins
    fraction = [0.01] * 4
    union = [0.2, 0.6, np.nan, 1.05 * crossing]
    # NaN (a dense layer's, or unmeasured): the uniform pattern's union; hysteresis on the
    # union too: 5% past the crossing stays sparse, does not go sparse
    np.testing.assert_array_equal(paths.next([False] * 4, fraction, union), [True, False, False, False])
    np.testing.assert_array_equal(paths.next([True] * 4, fraction, union), [True, False, False, True])
    np.testing.assert_array_equal(paths.next([False] * 4, fraction), [False] * 4)  # no union: uniform


def test_path_rule_sees_one_shard_of_one_micro_batch():
    model = dataclasses.replace(CFG.model, ffn_implementation="cuda", d_ff=64)
    mesh = sharding.make_mesh(config.MeshConfig(data=1), jax.devices()[:1])
    r = ffn_paths.path_rule(model, mesh, micro_batch=4, seq_len=32)
    assert (r.m, r.d, r.f) == (128, model.d_model, 64)
    assert ffn_paths.enabled(model) and not ffn_paths.enabled(CFG.model)


def _setup(cfg):
    mesh = sharding.make_mesh(config.MeshConfig(data=1), jax.devices()[:1])
    tx = optimizer.make_optimizer(cfg.optim, cfg.steps)
    schedule = optimizer.learning_rate_schedule(cfg.optim, cfg.steps)
    return mesh, tx, schedule


@pytest.mark.slow
def test_the_loop_moves_layers_by_probe_and_the_traced_sides_follow(monkeypatch, rule):
    monkeypatch.setattr(ffn_paths, "enabled", lambda model_cfg: True)  # reference FFN, choice on
    rule(cuda_train.TrainCrossover(margin=float("inf")))  # every layer prefers the kernels
    cfg = dataclasses.replace(CFG, log_every=3)
    mesh, tx, schedule = _setup(cfg)
    with sharding.mesh_context(mesh):
        setup = setup_model(cfg.model, cfg.seed, tx, mesh)
        state = setup.init()
        assert not np.asarray(state.ffn_sparse).any()  # dense from initialisation
        step = make_train_step(cfg, ffn_paths.with_paths(setup, (False,) * setup.num_layers), tx, schedule)
        for i in range(3):
            state, metrics = step(state, _batch(i, cfg))
        assert not np.asarray(state.ffn_sparse).any()  # the step never moves a layer
        # The union probe: each layer's mean 64-token union on the micro-batch, as the model measures it.
        probe = ffn_paths.make_union_probe(setup)
        tokens = jnp.asarray(_batch(3, cfg))[0]
        unions = np.asarray(probe(state.params, tokens))
        _, direct = setup.bind(state.params).measure_ffn(tokens[:, :-1])
        np.testing.assert_allclose(unions, np.asarray(direct), rtol=1e-6)
        assert unions.shape == (setup.num_layers,) and ((unions > 0) & (unions <= 1)).all()
        path_rule = ffn_paths.PathRule(m=tokens.shape[0] * (tokens.shape[1] - 1), d=cfg.model.d_model, f=setup.d_ff)
        state, sides, measured = ffn_paths.update_sides(state, setup, path_rule, probe, tokens, metrics["nnz_mean"])
        assert sides == (True, True) and tuple(np.asarray(state.ffn_sparse)) == sides
        assert measured is None  # every union gives the same sides: not measured
        rule(cuda_train.TrainCrossover(margin=0.0))  # every layer prefers dense
        state, sides, _ = ffn_paths.update_sides(state, setup, path_rule, probe, tokens, metrics["nnz_mean"])
        assert sides == (False, False) and not np.asarray(state.ffn_sparse).any()
        state = state._replace(ffn_sparse=jnp.asarray([True, True]))

        # Each layer's FFN is traced with its side; the reference FFN ignores it, so the
        # loss is the same whichever side each layer is on.
        mixed = ffn_paths.with_paths(setup, (True, False))
        model = mixed.bind(state.params)
        assert [layer.ffn.active_fraction for layer in model.layers] == [0.0, 1.0]
        assert setup.bind(state.params).layers[0].ffn.active_fraction is None
        losses = [  # the step donates its state: each gets a copy
            float(make_train_step(cfg, s, tx, schedule)(jax.tree.map(jnp.copy, state), _batch(5, cfg))[1]["loss"])
            for s in (setup, mixed)
        ]
        assert losses[0] == losses[1]
    with pytest.raises(ValueError, match="one side per layer"):
        ffn_paths.with_paths(setup, (True,))


def test_the_register_stays_off_without_the_cuda_ffn():
    mesh, tx, schedule = _setup(CFG)
    with sharding.mesh_context(mesh):
        setup = setup_model(CFG.model, CFG.seed, tx, mesh)
        state = setup.init()
        step = make_train_step(dataclasses.replace(CFG, log_every=1), setup, tx, schedule)
        state, _ = step(state, _batch(0))
    assert not np.asarray(state.ffn_sparse).any()


@pytest.mark.slow
def test_the_loop_re_jits_when_layers_change_side(monkeypatch, rule, tmp_path):
    """In the bundled loop: the layers start dense, move to the kernels' side at the first
    log step where the rule says so, the loop says it re-jits, and the run goes on."""
    import io

    from rich.console import Console

    from jax_twell.train.trainer import train

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):  # the split is by file (a hash of its name)
        (corpus / f"doc{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}\n" * 200)
    monkeypatch.setattr(ffn_paths, "enabled", lambda model_cfg: True)
    rule(cuda_train.TrainCrossover(margin=float("inf")))
    cfg = dataclasses.replace(
        CFG, workdir=str(tmp_path / "run"), steps=6, log_every=2, eval_every=100, eval_batches=1,
        checkpoint_every=100, data=dataclasses.replace(CFG.data, source=str(corpus), eval_percent=20),
    )
    out = io.StringIO()
    last = train(cfg, console=Console(file=out, width=200))
    assert last["train"]["step"] == 6 and np.isfinite(last["train"]["loss"])
    text = out.getvalue()
    assert text.count("re-jit") == 1 and "step 2: FFN on the sparse kernels in 2/2 layers" in text
    # each log record carries the layers' sides (and, where measured, unions)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["kind"] == "train"]
    assert train_records and all(r["ffn_sparse"] == [True, True] for r in train_records)


class _State(typing.NamedTuple):
    ffn_sparse: jax.Array
    params: dict


def test_the_probe_runs_only_where_a_union_could_move_a_layer(rule):
    """update_sides measures unions only when the sides with no union and with the uniform
    pattern's differ; then the measured union decides. Rule: pairs cross over at 0.5% alone
    (HALF_PERCENT), plus union rows (a union of 0.36 of f costs as much as dense)."""
    rule(dataclasses.replace(HALF_PERCENT, union_bandwidth=1e12))
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    setup = types.SimpleNamespace(d_ff=520, state_shardings=_State(one_device, None))
    path_rule = ffn_paths.PathRule(m=300, d=64, f=520)
    calls = []

    def probe(measured):
        def run(params, tokens):
            calls.append(tokens)
            return jnp.asarray(measured, jnp.float32)
        return run

    state = _State(jnp.asarray([False, False]), {})
    # 0.4% active: pairs alone win, with the uniform union (23%) they lose: measured, decides
    state, sides, unions = ffn_paths.update_sides(state, setup, path_rule, probe([0.02, 0.2]), "tokens", [2.08, 2.08])
    assert sides == (True, False) and len(calls) == 1 and np.allclose(unions, [0.02, 0.2])
    assert tuple(np.asarray(state.ffn_sparse)) == (True, False)
    # 0.05% active: the uniform union (3%) wins too; 60%: pairs alone lose: not measured
    for nnz, expected in (([0.26, 0.26], (True, True)), ([312.0, 312.0], (False, False))):
        state, sides, unions = ffn_paths.update_sides(state, setup, path_rule, probe([0.1, 0.1]), "tokens", nnz)
        assert unions is None and len(calls) == 1 and sides == expected
