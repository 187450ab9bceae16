"""`jax-twell grow` on the tiny preset (CPU): the layer map, the quiet layout, the copied
weights, the grown model's function and every layer's statistics against its trained
layer's (quiet copies) or the first layer's (full copies), the new run's checkpoint loading
and evaluating, the per-token counts against a direct count, and the refusals."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_twell.cli import main
from jax_twell.train import grow, sharding, trainer

TINY = ["model.n_layers=2", "batch_size=4", "seq_len=32", "eval_batches=1", "log_every=1", "checkpoint_every=2"]


@pytest.fixture(scope="module")
def source(tmp_path_factory, corpus):
    run = tmp_path_factory.mktemp("grow") / "src"
    code = main(["train", "--preset", "tiny", "--sample-tokens", "0", f"workdir={run}", f"data.source={corpus}",
                 "steps=2", *TINY])
    assert code == 0
    return run


@pytest.fixture(scope="module")
def grown(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("grow") / "big"
    assert main(["grow", "--from", str(source), "--preset", "tiny", "--workdir", str(out), "model.n_layers=5"]) == 0
    return out


@pytest.fixture(scope="module")
def grown_full(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("grow") / "full"
    assert main(["grow", "--from", str(source), "--preset", "tiny", "--workdir", str(out), "--full-copies",
                 "model.n_layers=5"]) == 0
    return out


@pytest.mark.parametrize("l0,l", [(1, 1), (1, 4), (2, 5), (8, 28), (8, 38), (3, 3)])
def test_layer_sources_use_every_layer_once_as_ordered_blocks(l0, l):
    sources = grow.layer_sources(l0, l)
    assert len(sources) == l and sources[0] == 0 and sources[-1] == l0 - 1
    assert all(b - a in (0, 1) for a, b in zip(sources, sources[1:]))  # ordered, none skipped
    sizes = np.bincount(sources)
    assert len(sizes) == l0 and sizes.max() - sizes.min() <= 1


def test_layer_sources_refuse_fewer_layers():
    with pytest.raises(ValueError, match="at least the source's 4 layers"):
        grow.layer_sources(4, 3)


@pytest.mark.parametrize("sources,want", [
    ([0], [(False, False)]),
    ([0, 1], [(False, False), (False, False)]),
    ([0, 0, 1], [(False, True), (True, False), (False, False)]),
    ([0, 0, 0, 1, 1], [(False, True), (True, True), (True, False), (False, True), (True, False)]),
])
def test_quiet_outputs_keep_the_first_attention_and_the_last_ffn_of_each_block(sources, want):
    assert grow.quiet_outputs(sources) == want


@pytest.mark.parametrize("fixture,full", [("grown", False), ("grown_full", True)])
def test_the_grown_run_holds_the_source_layers_in_order(source, fixture, full, request):
    grown = request.getfixturevalue(fixture)
    src_cfg, big_cfg = trainer.load_run_config(source), trainer.load_run_config(grown)
    assert big_cfg.model.n_layers == 5 and big_cfg.model.d_model == src_cfg.model.d_model
    assert big_cfg.data == src_cfg.data
    _, src = trainer.restore_run(src_cfg, shard_tokens=False)
    _, big = trainer.restore_run(big_cfg, 2, shard_tokens=False)  # the grown step (a later test resumes it)
    assert int(big.step) == int(src.step) == 2, "the source's step: its schedule continues"
    sources = grow.layer_sources(2, 5)
    quiet = grow.quiet_outputs(sources)
    assert any(a or f for a, f in quiet)
    for i, s in enumerate(sources):
        got, want = big.params["layers"][i], src.params["layers"][s]
        for path, a in jax.tree_util.tree_leaves_with_path(got):
            b = want
            for key in path:
                b = b[key.key]
            name = jax.tree_util.keystr(path)
            scaled = not full and ((name == "['attn']['wo']" and quiet[i][0]) or (name == "['ffn']['w_down']" and quiet[i][1]))
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b) * (grow.QUIET if scaled else 1), err_msg=f"{i} {name}")
            assert not scaled or np.count_nonzero(np.asarray(a)) == np.count_nonzero(np.asarray(b)), "quiet, not zero"
    for key in ("embed", "final_norm"):
        for a, b in zip(jax.tree.leaves(big.params[key]), jax.tree.leaves(src.params[key])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _assert_training_state_mapped(src, big, sources)


def _assert_training_state_mapped(src, big, sources):
    """The optimizer's moments, dead-neuron counters and traced sides follow the layer map."""
    src_leaves = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(src.opt_state)}
    layer_leaves = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(big.opt_state):
        key = jax.tree_util.keystr(grow._layer_map_path(path, sources))
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(src_leaves[key]), err_msg=key)
        layer_leaves += "['layers']" in key
    assert layer_leaves > 0
    assert any(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(big.opt_state) if x.ndim), "the source's moments"
    np.testing.assert_array_equal(np.asarray(big.since_fired), np.asarray(src.since_fired)[sources])
    np.testing.assert_array_equal(np.asarray(big.ffn_sparse), np.asarray(src.ffn_sparse)[sources])


def test_training_state_follows_the_layer_map(source):
    """With distinct per-layer values (the tiny source's layers all run dense on the CPU):
    each grown layer takes its source layer's side, counters and moments."""
    cfg = trainer.load_run_config(source)
    _, src = trainer.restore_run(cfg, shard_tokens=False)
    src = src._replace(
        since_fired=src.since_fired + jnp.arange(src.since_fired.shape[0], dtype=src.since_fired.dtype)[:, None] * 7,
        ffn_sparse=jnp.asarray([True, False]),
        opt_state=jax.tree_util.tree_map_with_path(
            lambda p, x: x + 1000 * int(str(p).count("DictKey(key=1)") > 0) if x.ndim else x, src.opt_state),
    )
    sources = grow.layer_sources(2, 5)
    big_cfg = grow.grown_config(cfg, "tiny", ["model.n_layers=5"])
    setup, state = grow.run_state(big_cfg, grow.grow_params(src.params, sources), step=0)
    with sharding.mesh_context(setup.mesh):
        big = grow.grow_training_state(src, state, sources)
    assert int(big.step) == int(src.step)
    assert list(np.asarray(big.ffn_sparse)) == [True, True, True, False, False]
    _assert_training_state_mapped(src, big, sources)


def test_quiet_copies_reproduce_every_layer_and_the_function(source, grown):
    report = json.loads((grown / grow.GROW_FILE).read_text())
    sources = grow.layer_sources(2, 5)
    assert report["layer_sources"] == sources and report["layout"] == "quiet copies"
    assert len(report["layers"]) == 5 and len(report["source_layers"]) == 2 and report["tokens"] > 0
    # Every copy's FFN reads what its trained layer's read: the same statistics.
    for i, s in enumerate(sources):
        assert report["layers"][i] == report["source_layers"][s], i
    for row in report["layers"] + report["source_layers"]:
        assert 0 <= row["active_fraction"] <= 1 and row["nnz_p50"] <= row["nnz_p99"] <= row["nnz_max"]
    # Token by token, and the logits: the grown model computes the source's function.
    src_cfg, big_cfg = trainer.load_run_config(source), trainer.load_run_config(grown)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, src_cfg.model.vocab_size, (2, 24)), jnp.int32)
    out = {}
    for name, cfg in (("src", src_cfg), ("big", big_cfg)):
        setup, state = trainer.restore_run(cfg, 2, shard_tokens=False)
        with sharding.mesh_context(setup.mesh):
            model = setup.bind(state.params)
            out[name] = (np.asarray(grow.token_nnz(model, state.params, tokens)), np.asarray(model(tokens)[0], np.float32))
    np.testing.assert_array_equal(out["big"][0], out["src"][0][sources])
    assert out["big"][0].sum() > 0
    np.testing.assert_allclose(out["big"][1], out["src"][1], rtol=1e-5, atol=1e-5)


def test_full_copies_match_the_first_layer_only(source, grown_full):
    report = json.loads((grown_full / grow.GROW_FILE).read_text())
    assert report["layout"] == "full copies"
    # Layer 0 reads exactly what the trained layer 0 read: the same statistics.
    assert report["layers"][0] == report["source_layers"][0]


def test_the_grown_run_evaluates_and_resumes(grown):
    assert main(["eval", "--workdir", str(grown), "--batches", "1"]) == 0
    assert main(["train", "--resume", "--sample-tokens", "0", f"workdir={grown}", "steps=3"]) == 0
    _, state = trainer.restore_run(trainer.load_run_config(grown), shard_tokens=False)
    assert int(state.step) == 3


def test_token_counts_are_the_gate_signs(source):
    cfg = trainer.load_run_config(source)
    setup, state = trainer.restore_run(cfg, shard_tokens=False)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 16)), jnp.int32)
    with sharding.mesh_context(setup.mesh):
        model = setup.bind(state.params)
        counts = np.asarray(grow.token_nnz(model, state.params, tokens))
        inputs = model.ffn_inputs(tokens, [0, 1])
    for i, h in enumerate(inputs):
        pre = np.asarray(h, np.float32).reshape(-1, h.shape[-1]) @ np.asarray(state.params["layers"][i]["ffn"]["w_gate"], np.float32)
        # The same signs, up to the summation order's rounding right at zero.
        assert np.all((pre > 1e-5).sum(-1) <= counts[i]) and np.all(counts[i] <= (pre > -1e-5).sum(-1))
        assert counts[i].sum() > 0
    stats = grow.layer_statistics(counts, cfg.model.d_ff)
    assert stats[0]["nnz_max"] == counts[0].max() and stats[0]["active_fraction"] == pytest.approx(counts[0].mean() / cfg.model.d_ff)


def test_refusals(source, grown, tmp_path, capsys):
    # Another width: the small preset is not the tiny one made deeper.
    assert main(["grow", "--from", str(source), "--preset", "small", "--workdir", str(tmp_path / "a")]) == 2
    assert "differs from the source run in more than its depth" in capsys.readouterr().out
    # Fewer layers than the source.
    assert main(["grow", "--from", str(source), "--preset", "tiny", "--workdir", str(tmp_path / "b"), "model.n_layers=1"]) == 2
    assert "at least the source's 2 layers" in capsys.readouterr().out
    # A directory that holds a run already.
    assert main(["grow", "--from", str(source), "--preset", "tiny", "--workdir", str(grown), "model.n_layers=5"]) == 2
    assert "is not empty" in capsys.readouterr().out
    # No run at all.
    assert main(["grow", "--from", str(tmp_path / "none"), "--preset", "tiny", "--workdir", str(tmp_path / "c")]) == 2
    # float16 parameters cannot hold a quiet projection (2^-64 underflows there).
    with pytest.raises(ValueError, match="float16"):
        grow._quiet(jnp.ones((2, 2), jnp.float16))
