"""Training configuration: presets, key=value overrides, JSON round trip."""

import dataclasses

import pytest

from jax_twell.models import PRESETS as MODEL_PRESETS
from jax_twell.train import config


def test_presets_follow_the_documented_recipes():
    for name in ("tiny", "small"):
        assert config.PRESETS[name].l1_coef == 1e-3
        assert config.PRESETS[name].model == MODEL_PRESETS[name]
    for name in ("0.5b", "1b", "1.5b", "2b"):
        cfg = config.PRESETS[name]
        assert cfg.l1_coef == 2e-5
        assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.b1, cfg.optim.b2) == (1e-3, 0.1, 0.9, 0.95)
        assert (cfg.optim.warmup_steps, cfg.optim.grad_clip, cfg.batch_size) == (600, 1.0, 512)


def test_overrides_parse_by_field_type_and_reach_nested_fields():
    cfg = config.get_config(
        "tiny",
        ["steps=12", "l1_coef=3e-3", "dead_reinit=true", "optim.lr=2e-3", "model.n_layers=2",
         "data.source=/x,/y", "mesh.tensor=2", "model.n_kv_heads=2", "grad_accum=1e1", "batch_size=20"],
    )
    assert cfg.steps == 12 and cfg.l1_coef == 3e-3 and cfg.dead_reinit is True
    assert cfg.optim.lr == 2e-3 and cfg.model.n_layers == 2 and cfg.data.source == "/x,/y"
    assert cfg.mesh.tensor == 2 and cfg.model.n_kv_heads == 2 and cfg.grad_accum == 10
    assert config.PRESETS["tiny"].steps != 12, "presets are not mutated"


@pytest.mark.parametrize(
    "override, error",
    [("nosuchkey=1", KeyError), ("optim.nope=1", KeyError), ("optim=1", KeyError), ("steps", ValueError),
     ("dead_reinit=maybe", ValueError), ("steps=abc", ValueError)],
)
def test_bad_overrides_raise_clear_errors(override, error):
    with pytest.raises(error):
        config.get_config("tiny", [override])


def test_unknown_preset():
    with pytest.raises(KeyError, match="unknown preset"):
        config.get_config("huge")


def test_json_round_trip(tmp_path):
    cfg = config.get_config("small", ["model.n_kv_heads=4", "data.tokenizer=bpe", "seed=7"])
    config.save(cfg, tmp_path / "config.json")
    assert config.load(tmp_path / "config.json") == cfg
    assert dataclasses.asdict(config.load(tmp_path / "config.json")) == config.to_dict(cfg)
