"""benchmarks/trained_activations.py on a briefly trained run (tiny preset, shrunk): the
files it writes, their activity against its summary, and its captured FFN inputs against
what the model's own training forward feeds each FFN."""

import json
import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import common  # noqa: E402
import trained_activations  # noqa: E402
from jax_twell.cli import main as cli_main  # noqa: E402
from jax_twell.modules import SparseFFN  # noqa: E402
from jax_twell.train import data, sharding, trainer  # noqa: E402

pytestmark = pytest.mark.slow  # trains a run first: a whole CLI run (CI runs it with -m slow)

MODEL = ["model.d_model=32", "model.n_layers=4", "model.n_heads=2", "model.head_dim=16", "model.d_ff=64",
         "model.max_seq_len=48"]
RUN = ["--preset", "tiny", "--sample-tokens", "0", *MODEL, "steps=4", "batch_size=8", "seq_len=32", "log_every=2",
       "eval_every=4", "checkpoint_every=2", "eval_batches=1", "data.eval_percent=20"]
M, D, F, LAYERS = 40, 32, 64, [0, 2, 3]  # 40 tokens: two sequences of 32, the second cut


@pytest.fixture(scope="module")
def extracted(tmp_path_factory, corpus):
    workdir = tmp_path_factory.mktemp("run")
    assert cli_main(["train", *RUN, f"data.source={corpus}", f"workdir={workdir}"]) == 0
    out = tmp_path_factory.mktemp("trained")
    summary = trained_activations.main(
        ["--workdir", str(workdir), "--tokens", str(M), "--batch", "1", "--out-dir", str(out)]
    )
    return workdir, out, summary


def _bf16(bits: np.ndarray) -> np.ndarray:
    return bits.view(ml_dtypes.bfloat16)


def test_files_and_summary(extracted):
    workdir, out, summary = extracted
    assert json.loads((out / f"trained_tiny_m{M}.json").read_text()) == summary
    assert summary["step"] == 4 and [r["layer"] for r in summary["layers"]] == LAYERS
    assert summary["run"] == workdir.name and summary["sequences"] == 2 and (summary["d"], summary["f"]) == (D, F)
    for row in summary["layers"]:
        path = out / f"trained_tiny_L{row['layer']}_m{M}.npz"
        assert row["file"] == path.name and row["step"] == 4
        with np.load(path) as z:
            assert sorted(z.files) == sorted(common.NPZ_KEYS)
            shapes = {k: z[k].shape for k in z.files}
            assert shapes == {"x_bf16": (M, D), "w_gate_bf16": (D, F), "w_up_bf16": (D, F), "w_down_bf16": (F, D)}
            assert all(z[k].dtype == np.uint16 for k in z.files)
            x, w_gate = _bf16(z["x_bf16"]), _bf16(z["w_gate_bf16"])
        # bits -> bf16 -> bits is the identity, and the values are a real hidden state
        np.testing.assert_array_equal(x.view(np.uint16), np.load(path)["x_bf16"])
        assert np.isfinite(x.astype(np.float32)).all() and np.abs(x.astype(np.float32)).max() > 0
        pre = np.maximum(x.astype(np.float32) @ w_gate.astype(np.float32), 0)
        counts = (pre > 0).sum(axis=1)
        assert row["density"] == pytest.approx(float((pre > 0).mean()), abs=1e-12)
        assert row["active_max"] == counts.max()
        assert [row["active_p50"], row["active_p90"], row["active_p99"]] == pytest.approx(
            np.percentile(counts, [50, 90, 99]).tolist())
        assert row["rows_over_10pct_fraction"] == pytest.approx(float((counts > 0.1 * F).mean()))


def test_inputs_and_weights_are_the_models(extracted, monkeypatch):
    """The npz x of each layer is what the model's training forward (``model(tokens)``, run
    eagerly here) hands that layer's SparseFFN, on the first M held-out tokens; the weights
    are the checkpoint's, rounded to bf16."""
    workdir, out, _ = extracted
    cfg = trainer.load_run_config(workdir)
    setup, state = trainer.restore_run(cfg, shard_tokens=False)
    corpus = data.load_corpus(cfg.data, cfg.workdir, cfg.model.vocab_size, save_tokenizer=False)
    tokens = data.eval_batch(corpus.eval, 0, num_batches=1, batch_size=2, seq_len=32)[:, :-1]
    np.testing.assert_array_equal(tokens[0], corpus.eval[:32])  # windows from the held-out split
    seen = []
    original = SparseFFN.forward_with_stats

    def spy(self, x):
        seen.append(np.asarray(x, np.float32).reshape(-1, x.shape[-1])[:M])
        return original(self, x)

    monkeypatch.setattr(SparseFFN, "forward_with_stats", spy)
    with sharding.mesh_context(setup.mesh):
        model = setup.bind(state.params)
        model(jnp.asarray(tokens))
    assert len(seen) == cfg.model.n_layers
    for layer in LAYERS:
        with np.load(out / f"trained_tiny_L{layer}_m{M}.npz") as z:
            x = _bf16(z["x_bf16"]).astype(np.float32)
            weights = [_bf16(z[k]) for k in ("w_gate_bf16", "w_up_bf16", "w_down_bf16")]
        np.testing.assert_allclose(x, seen[layer], rtol=2**-7, atol=1e-6, err_msg=f"layer {layer}")
        ffn = state.params["layers"][layer]["ffn"]
        for got, name in zip(weights, ("w_gate", "w_up", "w_down")):
            want = np.asarray(jax.device_get(ffn[name]).astype(jnp.bfloat16))
            np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16), err_msg=f"layer {layer} {name}")


def test_older_step_and_refusals(extracted, tmp_path):
    workdir, _, summary = extracted
    older = trained_activations.main(
        ["--workdir", str(workdir), "--step", "2", "--tokens", "8", "--out-dir", str(tmp_path)]
    )
    assert older["step"] == 2 and older["sequences"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "trained_tiny_L0_m8.npz", "trained_tiny_L2_m8.npz", "trained_tiny_L3_m8.npz", "trained_tiny_m8.json"]
    with pytest.raises(SystemExit):
        trained_activations.main(["--workdir", str(workdir), "--seq-len", "49", "--out-dir", str(tmp_path)])


def test_capture_layers():
    assert trained_activations.capture_layers(8) == [0, 4, 7]
    assert trained_activations.capture_layers(2) == [0, 1] and trained_activations.capture_layers(1) == [0]
