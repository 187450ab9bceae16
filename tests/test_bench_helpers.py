"""The benchmarks' helpers: the training benchmark's memory count (benchmarks/bench_training.py,
residual_bytes: what jax.vjp keeps for the backward, the operands themselves left out once
each), its rule fit, the inference rule's fit, the interleaved timer's batch size (benchmarks/common.py),
and the runner of another checkout's scripts (benchmarks/run_tree.py)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_training  # noqa: E402
import common  # noqa: E402
from jax_twell.ops import layout
from jax_twell.ops.costs import DenseCrossover
from jax_twell.ops.costs import TrainCrossover

M, D, F = 64, 32, 48
ARGS = tuple(jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((M, D), (D, F), (D, F), (F, D)))


def _matmuls(x, wg, wu, wd):
    # The backward of a chain of matmuls keeps the operands and the intermediate product.
    return ((x @ wg) @ wd, jnp.float32(0.0))


def test_operands_alone_count_zero():
    assert bench_training.residual_bytes(lambda x, wg, wu, wd: (x @ wg, jnp.float32(0.0)), ARGS) == 0


def test_intermediates_count():
    assert bench_training.residual_bytes(_matmuls, ARGS) == M * F * 2  # x @ wg, bf16


def test_a_residual_shaped_like_an_operand_counts():
    """A weight-shaped residual (here sin(wd)'s cosine) is not mistaken for the operand."""

    def with_copy(x, wg, wu, wd):
        y, l1 = _matmuls(x, wg, wu, wd)
        return y + jnp.sin(wd).sum().astype(y.dtype), l1

    assert bench_training.residual_bytes(with_copy, ARGS) == bench_training.residual_bytes(_matmuls, ARGS) + F * D * 2


def test_the_training_rule_fit_recovers_its_constants():
    """benchmarks/fit_train_rule.py on rows that a known rule generates (the bench's
    fields: forced-kernel step = rule's sparse cost + a ninth of XLA's value_and_grad step)
    gives that rule back, its matmul rate too; a rule that differs in one fitted constant is
    told apart; rows of jax.grad alone (eight dense matmuls) price the gate at an eighth."""
    import dataclasses

    import numpy as np

    import fit_train_rule

    truth = dataclasses.replace(TrainCrossover(), fixed_overhead=0.3e-3, pair_rate=2.5e13,
                                grad_stream_spill=5e8, union_bandwidth=7e12, matmul_rate=7.5e14)
    rows = []
    for m in (4096, 16384, 65536):
        for p, union in ((0.0025, 0.146), (0.005, 0.27), (0.005, 0.18), (0.01, 0.47), (0.01, 0.27)):
            d, f = 2048, 5632
            dense_ms = 1e3 * 9 / 8 * truth.dense_cost(m, d, f)
            kernels_ms = 1e3 * float(truth.sparse_cost(p * m * f, 0, m, d, f, 2, union=union))
            rows.append(dict(m=m, d=d, f=f, measured_active_fraction=p, measured_union_fraction=union,
                             dense_step_ms=dense_ms, mma_step_ms=kernels_ms + dense_ms / 9, dense_matmuls=9))
    fitted = fit_train_rule.fit(rows, TrainCrossover())
    for name in (*fit_train_rule.FITTED, "matmul_rate"):
        np.testing.assert_allclose(getattr(fitted, name), getattr(truth, name), rtol=1e-3, err_msg=name)
    assert fit_train_rule.dense_matmuls({"step": "value_and_grad"}) == 9 and fit_train_rule.dense_matmuls({}) == 8
    # The same kernels timed with jax.grad alone: XLA's step has one matmul fewer, the gate
    # is an eighth of it; the kernels' constants come out the same, the matmul rate kept.
    grad_only = [dict(r, dense_step_ms=r["dense_step_ms"] * 8 / 9, dense_matmuls=8) for r in rows]
    refit = fit_train_rule.fit(grad_only, TrainCrossover())
    for name in fit_train_rule.FITTED:
        np.testing.assert_allclose(getattr(refit, name), getattr(truth, name), rtol=1e-3, err_msg=name)
    assert refit.matmul_rate == TrainCrossover().matmul_rate
    slower = [dict(r, mma_step_ms=r["mma_step_ms"] + 1e3 * (r["m"] // 64) * r["measured_union_fraction"] * r["f"]
                   * 5 * r["d"] * 2 * (1 / 5e12 - 1 / 7e12)) for r in rows]  # union rows at 5e12 B/s
    np.testing.assert_allclose(fit_train_rule.fit(slower, TrainCrossover()).union_bandwidth, 5e12, rtol=1e-3)


@pytest.mark.parametrize("model", ["union", "stationary"])
def test_the_inference_rule_fit_recovers_its_constants(model):
    """benchmarks/fit_inference_rule.py on rows that a known rule generates (the bench's
    fields: forced call = the model's price + a third of XLA's call, without and with
    w_up_t, the down step each ran recorded) gives that rule back for each of its two
    models, leaves out the points the model must not read, and refuses rows that cannot be
    timings."""
    import dataclasses

    import numpy as np

    import fit_inference_rule

    truth = dataclasses.replace(
        DenseCrossover(), union_row_bandwidth=4.8e12, union_fixed_overhead=0.1e-3, union_transpose_bandwidth=2.5e12,
        stationary_up_bandwidth=5e12, stationary_pair_seconds=4e-10, stationary_pair_seconds_8=3e-10,
        stationary_token_seconds=5e-9, stationary_fixed_overhead=0.12e-3, stationary_transpose_bandwidth=2e12)
    price = truth._stationary_seconds if model == "stationary" else truth._union_model_seconds
    shapes = [(2048, 2048, 5632), (4096, 2048, 5632), (16384, 2048, 5632), (16384, 1024, 2816), (4096, 4096, 5632),
              (16384, 2048, 8192), (4096, 4096, 11008)]  # the last two: 8 columns a CTA
    ran = model == "stationary"
    rows = []
    for m, d, f in shapes:
        for p in (0.0025, 0.005, 0.01):
            dense_ms = 1.5e3 * truth.dense_cost(m, d, f, 2)
            cost = lambda t: 1e3 * float(price(p * m * f, m, d, f, 2, layout.uniform_union(p), t)) + dense_ms / 3
            rows.append(dict(m=m, d=d, f=f, pattern="uniform", kernel="blocked_union", measured_active_fraction=p,
                             dense_call_ms=dense_ms, sparse_call_ms=cost(False), pret_call_ms=cost(True),
                             down_stationary=ran, down_stationary_pret=ran))
    # points the model must not read: another pattern, kernel or size; the other down step
    others = [dict(rows[0], pattern="heavy"), dict(rows[0], kernel="row"), dict(rows[0], m=512),
              dict(rows[0], down_stationary=not ran, down_stationary_pret=not ran)]
    base = DenseCrossover()
    points = fit_inference_rule.usable(rows + others, base, model)
    assert points == [(r, t) for r in rows for t in (False, True)]
    # without the record: "blocked_union" ran the stationary step where the shape takes it,
    # except in results measured before it existed; "blocked_union_nostat" never
    bare = {k: v for k, v in rows[0].items() if not k.startswith("down_stationary")}
    assert fit_inference_rule.ran_stationary(bare, base, False)
    assert not fit_inference_rule.ran_stationary(bare, base, False, before_stationary=True)
    assert not fit_inference_rule.ran_stationary(dict(bare, kernel="blocked_union_nostat"), base, True)
    fitted = fit_inference_rule.fit(points, base, model)
    for name in fit_inference_rule.UNION if model == "union" else fit_inference_rule.STATIONARY:
        np.testing.assert_allclose(getattr(fitted, name), getattr(truth, name), rtol=1e-3, err_msg=name)
    if model == "stationary":  # no 8-column point: that constant keeps its value
        sixteen = [(r, t) for r, t in points if r["f"] <= 7264]
        kept = fit_inference_rule.fit(sixteen, base, model)
        assert kept.stationary_pair_seconds_8 == base.stationary_pair_seconds_8
        np.testing.assert_allclose(kept.stationary_pair_seconds, truth.stationary_pair_seconds, rtol=1e-3)
    with pytest.raises(ValueError, match="third of the dense call"):
        fit_inference_rule.fit([(dict(rows[0], pret_call_ms=0.0), True)] + points[1:], base, model)


def test_a_slow_first_call_does_not_shrink_the_batch():
    # A function whose first calls after the warm-up are slow (as a command buffer's
    # capture makes them) must still be timed in batches sized by its steady speed.
    import time

    calls = []

    def fn(x):
        calls.append(None)
        if len(calls) == 2:  # the first call after the warm-up
            time.sleep(0.05)
        return x

    common.time_interleaved({"f": fn}, (jnp.zeros(()),), min_seconds=0.01, max_reps=50, rounds=1)
    # warm-up + three single calls + one batch: the batch must hold many calls, not
    # min_seconds / 0.05 s = 0 -> 1 of them
    assert len(calls) - 4 > 10


def test_time_interleaved_rotates_the_order():
    """Each round starts one function later: every function leads one of n rounds, so
    none always follows the same one."""
    seen = []

    def make(name):
        def fn(x):
            seen.append(name)
            return x
        return fn

    fns = {name: make(name) for name in "abc"}
    common.time_interleaved(fns, (jnp.zeros(()),), min_seconds=0.0, max_reps=1, rounds=3)
    batches = seen[3 * 4:]  # after each function's warm-up and three single calls
    assert [batches[i * 3] for i in range(3)] == ["a", "b", "c"]
    assert all(sorted(batches[i * 3: i * 3 + 3]) == ["a", "b", "c"] for i in range(3))


def test_time_paired_ratio_holds_through_a_drift(monkeypatch):
    """The paired ratio is the median of each round's own ratio: when the machine's speed
    changes between rounds (here by up to 4x), each function's times spread widely but
    the per-round ratios do not, and the ratio is the true 2.0."""
    import random

    rng = random.Random(0)
    clock = {"now": 0.0, "calls": 0, "speed": 1.0}
    monkeypatch.setattr(common.time, "perf_counter", lambda: clock["now"])
    warmup_calls = 2 * 4  # each function's warm-up and three single calls

    def make(cost):
        def fn(x):
            if clock["calls"] >= warmup_calls and (clock["calls"] - warmup_calls) % 2 == 0:
                clock["speed"] = rng.uniform(0.5, 2.0)  # a new round, a new speed
            clock["calls"] += 1
            clock["now"] += cost * clock["speed"]
            return x
        return fn

    fns = {"dense": make(2.0), "fast": make(1.0)}
    timed = common.time_paired(fns, (jnp.zeros(()),), baseline="dense", min_seconds=0.0, max_reps=1, rounds=9)
    assert timed["dense"][2] == 1.0
    assert abs(timed["fast"][2] - 2.0) < 1e-9 and timed["fast"][3] < 1e-9, timed
    assert timed["fast"][1] > 0.3, "the times themselves spread (else the test shows nothing)"


RUN_TREE = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "run_tree.py")


def test_run_tree_imports_the_other_checkouts_package(tmp_path):
    """An A/B baseline runs from its own tree: run_tree.py imports that tree's jax_twell (not
    the installed one, whose editable import hook comes first), finds the script's own
    helpers beside it, and passes the arguments on."""
    (tmp_path / "jax_twell").mkdir()
    (tmp_path / "jax_twell" / "__init__.py").write_text("WHO = 'baseline'\n")
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "helper.py").write_text("VALUE = 7\n")
    (tmp_path / "benchmarks" / "bench.py").write_text(
        "import sys, helper, jax_twell\nprint(jax_twell.WHO, helper.VALUE, sys.argv[1:], __name__)\n")
    out = subprocess.run([sys.executable, RUN_TREE, str(tmp_path), "benchmarks/bench.py", "--out", "x.json"],
                         capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "baseline 7 ['--out', 'x.json'] __main__"
    bad = subprocess.run([sys.executable, RUN_TREE, str(tmp_path / "benchmarks"), "bench.py"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "holds no jax_twell package" in bad.stderr


def test_bench_patterns_reads_back_the_npz_it_writes(tmp_path, capsys):
    """bench_patterns' --npz inputs: load_npz gives back exactly the bf16 operands save_npz
    wrote (f32 operands rounded to bf16 on the way); files that are not an FFN's operands
    are refused, and so is a command line with neither --configs nor --npz."""
    import numpy as np

    import bench_patterns

    keys = jax.random.split(jax.random.key(3), 4)
    operands = [jax.random.normal(k, s, jnp.float32).astype(jnp.bfloat16)
                for k, s in zip(keys, ((M, D), (D, F), (D, F), (F, D)))]
    path = tmp_path / "ops.npz"
    bench_patterns.save_npz(path, *operands)
    loaded = bench_patterns.load_npz(path)
    for got, want in zip(loaded, operands):
        assert got.dtype == jnp.bfloat16 and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(got, jnp.uint16)),
                                      np.asarray(jax.lax.bitcast_convert_type(want, jnp.uint16)))
    bench_patterns.save_npz(path, operands[0].astype(jnp.float32), *operands[1:])
    np.testing.assert_array_equal(np.asarray(bench_patterns.load_npz(path)[0], np.float32),
                                  np.asarray(operands[0], np.float32))
    bench_patterns.save_npz(path, operands[0], operands[1], operands[2], operands[3].T)
    with pytest.raises(ValueError, match="not x"):
        bench_patterns.load_npz(path)
    np.savez(path, x=np.zeros((2, 2)))
    with pytest.raises(ValueError, match="no x_bf16"):
        bench_patterns.load_npz(path)
    with pytest.raises(SystemExit):
        bench_patterns.main([])
    assert "give --configs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_patterns.main(["--npz", str(tmp_path / "absent.npz")])
    assert "no such file" in capsys.readouterr().err


def test_bench_floor_sweeps_reports_and_gates(tmp_path, capsys, monkeypatch):
    """bench_floor: its configurations are parsed and checked (mode infer by default, bad
    items refused with the format named); a run writes a row per configuration with both
    times, the ratio and the error; a row below the floor makes the exit status 1 and is
    listed, and one above it does not."""
    import json

    import bench_floor

    assert bench_floor.parse_configs("64:32:48:0.05:tail") == [(64, 32, 48, 0.05, "tail", "infer")]
    assert bench_floor.parse_configs("8:8:16:1.0:full16:train")[0][5] == "train"
    for bad, says in (("64:32:48:tail", "M:d:f:density"), ("64:32:48:0.1:zipf", "family"),
                      ("64:32:48:0.1:tail:serve", "mode"), ("0:32:48:0.1:tail", "positive"),
                      ("64:32:48:1.5:tail", "positive")):
        with pytest.raises(SystemExit, match=says):
            bench_floor.parse_configs(bad)
    assert all(c in bench_floor.FAMILIES for c in {c[4] for c in bench_floor.parse_configs(bench_floor.GRID)})
    out = tmp_path / "floor.json"
    args = ["--configs", "32:16:48:0.1:tail,16:8:16:0.5:uniform:train", "--min-seconds", "0.001", "--out", str(out)]
    assert bench_floor.main([*args, "--floor", "0"]) == 0
    result = json.loads(out.read_text())
    assert [r["mode"] for r in result["rows"]] == ["infer", "train"] and not result["failed"]
    for r in result["rows"]:
        assert r["ms"]["xla"] > 0 and r["ms"]["default"] > 0 and r["holds"]
        assert r["ratio"] == pytest.approx(r["ms"]["xla"] / r["ms"]["default"])
        assert r["rel_error"] < 1e-2
    assert bench_floor.main([*args, "--floor", "1e9"]) == 1
    assert "below: infer M=32" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_floor.main(["--modes", "serve"])


def test_bench_floor_runs_files_and_the_published_kernels(tmp_path, capsys, monkeypatch):
    """bench_floor --npz: a row per file and mode on the file's operands; --anchor: the
    published kernels' script runs on each row's operands in the row's mode (a stand-in
    script here that checks it was given the same operands), its figures land in the
    row with ``vs_public`` = their time over the default's, shapes their inference kernel
    does not take are skipped with the reason, and a script that gives no result is
    reported, not fatal. Without that folder the option is refused."""
    import json

    import bench_floor
    from common import save_npz

    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    operands = bench_floor.family_inputs(jax.random.key(3), 256, 2048, 16, 0.1, "tail")
    save_npz(tmp_path / "layer0.npz", *operands)
    save_npz(tmp_path / "odd.npz", *bench_floor.family_inputs(jax.random.key(4), 24, 16, 40, 0.1, "uniform"))
    anchor = tmp_path / "anchor"
    anchor.mkdir()
    (anchor / "bench_public.py").write_text(
        "import json, sys\n"
        "import numpy as np\n"
        "z = np.load(sys.argv[1]); mode = sys.argv[3]\n"
        "m, d = z['x_bf16'].shape\n"
        "if d == 16: print('no result'); sys.exit(3)\n"
        "print('compiling...')\n"
        "print(json.dumps({'M': m, mode: {'public_ms': 2.5, 'dense_ms': 4.0, 'checksum': int(z['x_bf16'].sum())}}))\n"
    )
    out = tmp_path / "floor.json"
    status = bench_floor.main(["--configs", "", "--npz", str(tmp_path / "layer0.npz"), str(tmp_path / "odd.npz"),
                               "--anchor", str(anchor), "--anchor-python", sys.executable,
                               "--min-seconds", "0.001", "--floor", "0", "--out", str(out)])
    assert status == 0
    result = json.loads(out.read_text())
    rows = {(r["name"], r["mode"]): r for r in result["rows"]}
    assert sorted(rows) == [("layer0", "infer"), ("layer0", "train"), ("odd", "infer"), ("odd", "train")]
    bits = int(np.asarray(jax.lax.bitcast_convert_type(operands[0], jnp.uint16)).sum())
    for mode in ("infer", "train"):
        row = rows["layer0", mode]
        assert (row["m"], row["d"], row["f"], row["family"], row["source"]) == (256, 2048, 16, "npz", "layer0.npz")
        assert row["public"]["checksum"] == bits
        assert row["public"]["vs_public"] == pytest.approx(2.5 / row["ms"]["default"])
    assert "d = 2048" in rows["odd", "infer"]["public"]["skipped"]
    assert "exit status 3" in rows["odd", "train"]["public"]["error"]
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    with pytest.raises(SystemExit):
        bench_floor.main(["--configs", "", "--npz", str(tmp_path / "odd.npz"), "--anchor", str(tmp_path)])
    assert "no bench_public.py" in capsys.readouterr().err
