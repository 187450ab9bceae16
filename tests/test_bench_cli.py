"""`jax-twell bench` on the tiny preset with tiny sizes (CPU): the JSON's metrics for the three
models, ratios that match the raw numbers, nulls with reasons where a CPU cannot measure,
the PNG, checkpoint weights, help and refusals; the power integration on a stand-in NVML."""

import json
import math
import time

import jax
import pytest

from jax_twell.cli import main
from jax_twell.train import bench_measure
from jax_twell.train import config as config_lib
from jax_twell.train import sharding
from jax_twell.train.checkpoint import Checkpointer
from jax_twell.train.optimizer import make_optimizer
from jax_twell.train.state import setup_model

MODELS = ("sparse", "swiglu", "dense_relu")
SMALL = ["model.n_layers=1", "batch_size=2", "seq_len=32"]
SIZES = ["--prefill", "1x32", "--decode", "1", "--prompt", "8", "--new-tokens", "4", "--train-steps", "2",
         "--repeats", "2", "--warmup", "1", "--min-seconds", "0"]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "fresh.json"
    assert main(["bench", "--preset", "tiny", *SIZES, "--out", str(out), *SMALL]) == 0
    return json.loads(out.read_text()), out


@pytest.mark.slow  # a whole bench run
def test_every_metric_for_every_model(fresh):
    result, _ = fresh
    cases = ("prefill_1x32", "decode_b1", "train")
    expected = {f"{c}_{m}" for c in cases for m in ("tokens_per_s", "joules_per_token")}
    assert set(result["metrics"]) == expected | {"train_mfu", "train_peak_bytes", "serve_peak_bytes"}
    assert list(result["models"]) == list(MODELS)
    assert [result["models"][n]["ffn"] for n in MODELS] == ["sparse_relu", "dense_silu", "dense_relu"]
    for name, metric in result["metrics"].items():
        assert set(metric["values"]) == set(MODELS), name
        assert metric["better"] in ("higher", "lower") and metric["unit"]
        for value in metric["values"].values():
            assert value is None or (math.isfinite(value) and value > 0), name
        missing = any(v is None for v in metric["values"].values())
        assert (isinstance(metric["reason"], str) and metric["reason"]) if missing else metric["reason"] is None, name
    for case in cases:
        assert all(result["metrics"][f"{case}_tokens_per_s"]["values"][n] > 0 for n in MODELS)
        for n in MODELS:
            row = result["cases"][case]["models"][n]
            assert row["tokens_per_s"] == pytest.approx(result["cases"][case]["tokens_per_call"] / row["seconds"])
            assert result["metrics"][f"{case}_tokens_per_s"]["values"][n] == row["tokens_per_s"]
    assert result["cases"]["decode_b1"]["tokens_per_call"] == 4 and result["cases"]["train"]["tokens_per_call"] == 64
    assert all(result["metrics"][m]["values"][n] > 0 for m in ("train_peak_bytes", "serve_peak_bytes") for n in MODELS)
    # Each layer's active fraction in the first and last training step run, for every model.
    for n in MODELS:
        steps = result["cases"]["train"]["models"][n]["active_fraction_steps"]
        assert set(steps) == {"first", "last"} and all(len(v) == 1 and 0 <= v[0] <= 1 for v in steps.values()), n
    assert result["cases"]["train"]["models"]["sparse"]["active_fraction_steps"]["first"][0] > 0
    assert "d_ff" not in result["cases"]["train"]


@pytest.mark.slow  # a whole bench run
def test_ratios_match_the_raw_numbers(fresh):
    result, _ = fresh
    assert set(result["ratios"]) == {"sparse/swiglu", "sparse/dense_relu"}
    for key, row in result["ratios"].items():
        base = key.split("/")[1]
        assert set(row) == set(result["metrics"])
        for name, ratio in row.items():
            values = result["metrics"][name]["values"]
            if values["sparse"] is None or values[base] is None:
                assert ratio is None
            else:
                assert ratio == pytest.approx(values["sparse"] / values[base])


@pytest.mark.slow  # a whole bench run
def test_cpu_nulls_say_why_and_the_run_is_described(fresh):
    result, out = fresh
    for case in ("prefill_1x32", "decode_b1", "train"):
        metric = result["metrics"][f"{case}_joules_per_token"]
        assert set(metric["values"].values()) == {None} and "cpu" in metric["reason"]
    mfu = result["metrics"]["train_mfu"]
    assert set(mfu["values"].values()) == {None} and "peak_tflops=" in mfu["reason"]
    assert result["device_memory"]["peak_bytes_in_use"] is None and "cpu" in result["device_memory"]["reason"]
    assert result["energy"]["reason"] and result["peak_flops_per_device"] is None
    assert result["weights"]["source"] == "fresh" and "mean nothing" in result["weights"]["note"]
    assert "random" in result["data"]
    meta = result["metadata"]
    assert meta["jax"] == jax.__version__ and meta["platform"] == "cpu" and meta["commit"]
    assert result["settings"]["prefill"] == [[1, 32]] and result["settings"]["train_batch"] == 2
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and result["files"]["png"] == str(png)


@pytest.mark.slow  # a whole bench run
def test_checkpoint_weights_and_the_context_cut(tmp_path, corpus, capsys):
    cfg = config_lib.get_config("tiny", [*SMALL, f"data.source={corpus}", "data.eval_percent=20", f"workdir={tmp_path}"])
    config_lib.save(cfg, tmp_path / "config.json")
    mesh = sharding.make_mesh(config_lib.MeshConfig(1, 1, 1), jax.devices()[:1])
    with sharding.mesh_context(mesh):
        state = setup_model(cfg.model, cfg.seed, make_optimizer(cfg.optim, cfg.steps), mesh).init()
    checkpointer = Checkpointer(tmp_path, 1)
    checkpointer.save(0, state)
    checkpointer.close()
    args = ["--prefill", "1x16,1x4096", "--decode", "none", "--train-steps", "0", "--repeats", "1", "--warmup", "1",
            "--min-seconds", "0"]
    assert main(["bench", "--workdir", str(tmp_path), *args]) == 0
    assert "measured as 1x256" in " ".join(capsys.readouterr().out.split())
    result = json.loads((tmp_path / "bench_cpu.json").read_text())
    assert (tmp_path / "bench_cpu.png").is_file()
    assert result["weights"] == {"source": "checkpoint", "workdir": str(tmp_path), "step": 0}
    assert "corpus" in result["data"] and result["settings"]["prefill"] == [[1, 16], [1, 256]]
    assert set(result["metrics"]) == {
        "prefill_1x16_tokens_per_s", "prefill_1x16_joules_per_token",
        "prefill_1x256_tokens_per_s", "prefill_1x256_joules_per_token", "serve_peak_bytes",
    }
    assert "calibrated on" in result["models"]["sparse"]["serving"]


def test_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "usage: jax-twell bench" in out and "--prefill" in out and "swiglu and dense_relu" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prefill", "1y32"], "expected BATCHxSEQ"),
        (["--decode", "8,0"], "expected positive batch sizes"),
        (["--repeats", "0"], "expected an integer >= 1"),
        (["--min-seconds", "-1"], "expected a finite number of seconds"),
    ],
)
def test_bad_argument(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--workdir", "{tmp}/nothing"], "config.json not found"),
        (["nope=1"], "unknown config key"),
        (["--prefill", "none", "--decode", "none", "--train-steps", "0"], "nothing to measure"),
        (["--step", "3"], "--step needs --workdir"),
    ],
)
def test_refusals(args, message, tmp_path, capsys):
    assert main(["bench", *(a.format(tmp=tmp_path) for a in args)]) == 2
    assert message in " ".join(capsys.readouterr().out.split())


def test_power_integration():
    samples = [(0.0, 100.0), (1.0, 200.0), (2.0, 200.0)]
    assert bench_measure.integrate_power(samples, 0.25, 0.75) == pytest.approx(0.5 * 150.0)
    assert bench_measure.integrate_power(samples, 0.5, 1.5) == pytest.approx(0.5 * 175.0 + 0.5 * 200.0)
    assert bench_measure.integrate_power(samples, 1.5, 2.5) is None  # no reading after the window


class _FakeNVML:
    """A stand-in for pynvml: no instantaneous field, 150 W from nvmlDeviceGetPowerUsage."""

    NVML_FI_DEV_POWER_INSTANT = 186

    def nvmlDeviceGetFieldValues(self, handle, fields):
        raise RuntimeError("not supported")

    def nvmlDeviceGetPowerUsage(self, handle):
        return 150_000

    def nvmlShutdown(self):
        pass


def test_power_sampler_on_a_stand_in_nvml():
    sampler = bench_measure.PowerSampler(_FakeNVML(), None, interval=0.002)
    assert sampler.reading == "nvmlDeviceGetPowerUsage"
    with sampler:
        time.sleep(0.02)
        start = time.perf_counter()
        time.sleep(0.03)
        end = time.perf_counter()
        time.sleep(0.02)
    assert sampler.energy(start, end) == pytest.approx(150.0 * (end - start))
