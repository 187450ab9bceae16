"""The jax-twell command line: train, eval, generate, plot, sweep (in-process, tiny model)."""

import json

import pytest

from jax_twell.cli import main

MODEL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.head_dim=16", "model.d_ff=64",
         "model.max_seq_len=48"]
RUN = [*MODEL, "steps=6", "batch_size=8", "seq_len=32", "log_every=2", "eval_every=6", "checkpoint_every=3",
       "eval_batches=1", "data.eval_percent=20"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    workdir = tmp_path_factory.mktemp("run")
    assert main(["train", "--sample-tokens", "8", *RUN, f"data.source={corpus}", f"workdir={workdir}"]) == 0
    return workdir


@pytest.mark.slow
def test_train_writes_a_run_and_refuses_to_overwrite_it(trained, corpus, capsys):
    assert (trained / "config.json").exists() and (trained / "checkpoints" / "6").is_dir()
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [2, 4, 6]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [6]
    last = records[-2]
    assert len(last["nnz_mean"]) == 2 and 0 <= last["active_fraction"] <= 1 and last["tokens_per_s"] > 0
    assert main(["train", *RUN, f"data.source={corpus}", f"workdir={trained}"]) == 2
    assert "--resume" in capsys.readouterr().out


@pytest.mark.slow
def test_eval_generate_plot(trained, capsys):
    assert main(["eval", "--workdir", str(trained)]) == 0
    out = capsys.readouterr().out
    assert "held-out CE" in out and "bits/byte" in out
    assert main(["generate", "--workdir", str(trained), "--prompt", "def", "--max-new-tokens", "5", "--temperature", "0"]) == 0
    assert "def" in capsys.readouterr().out
    assert main(["plot", "--workdir", str(trained)]) == 0
    assert sorted(p.name for p in (trained / "plots").iterdir()) == ["loss.png", "sparsity.png", "sparsity_per_layer.png"]


def test_generate_says_when_it_cuts_max_new_tokens(trained, capsys):
    args = ["generate", "--workdir", str(trained), "--prompt", "def", "--temperature", "0"]
    assert main([*args, "--max-new-tokens", "1000"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--max-new-tokens 1000 cut to 45: the prompt (3 tokens) and the new tokens must fit" in out
    assert main([*args, "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens must be >= 1" in capsys.readouterr().out


def test_help_says_what_hardware_each_command_is_for(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "a few minutes on a CPU; --preset small and larger are meant for GPUs" in out
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "tiny: CPU, a few minutes; small: one GPU" in out and "143 / 130 stopped by SIGTERM" in out
    assert "keep_checkpoints=0 keeps every checkpoint" in out


def test_show_config_and_bad_override(capsys):
    assert main(["train", "--show-config", "steps=5", "optim.lr=0.01"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["steps"] == 5 and cfg["optim"]["lr"] == 0.01 and cfg["model"]["d_model"] == 128
    assert main(["train", "--show-config", "nope=1"]) == 2
    assert "unknown config key" in capsys.readouterr().out


@pytest.mark.parametrize("command", [[], ["train"], ["eval"], ["generate"], ["plot"], ["sweep"]])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    assert "usage: jax-twell" in capsys.readouterr().out


@pytest.mark.slow
def test_sweep_writes_table_and_plot(tmp_path, corpus):
    sweep_dir = tmp_path / "sweep"
    args = ["sweep", "--l1", "0,1e-2", "--workdir", str(sweep_dir), *RUN, "steps=3", "eval_every=3",
            f"data.source={corpus}"]
    assert main(args) == 0
    rows = json.loads((sweep_dir / "sweep.json").read_text())
    assert [r["l1"] for r in rows] == [0.0, 0.01] and (sweep_dir / "sweep.png").exists()
    assert (sweep_dir / "sweep.md").read_text().startswith("| L1 | 0 | 0.01 |")
    assert main(args) == 0, "a finished sweep is read back, not retrained"
    (sweep_dir / "sweep.json").unlink()
    assert main(["sweep", "--report", "--workdir", str(sweep_dir)]) == 0
    assert [r["l1"] for r in json.loads((sweep_dir / "sweep.json").read_text())] == [0.0, 0.01]
    assert main(["sweep", "--workdir", str(sweep_dir)]) == 2, "--l1 or --report"
