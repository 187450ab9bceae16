"""The sharded train step on several CPU host devices (tests/conftest.py provides 4).

A step on a (data, fsdp, tensor) mesh must equal the single-device step, and under tensor
parallelism the compiled program must never all-gather an FFN weight.
"""

import dataclasses
import re

import jax
import numpy as np
import pytest

from jax_twell.models import PRESETS as MODEL_PRESETS
from jax_twell.train import config, data, optimizer, sharding
from jax_twell.train.state import setup_model
from jax_twell.train.step import make_train_step

pytestmark = [
    pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (XLA_FLAGS host device count)"),
    pytest.mark.slow,
]

D, F = 64, 192  # FFN weight shapes [64, 192] / [192, 64] occur nowhere else in the model
MODEL = dataclasses.replace(
    MODEL_PRESETS["tiny"], d_model=D, d_ff=F, n_layers=2, n_heads=4, head_dim=16, max_seq_len=32
)
CFG = dataclasses.replace(
    config.PRESETS["tiny"], model=MODEL, batch_size=8, seq_len=32, grad_accum=2, steps=10,
    dead_reinit=True, dead_window=1,
)


def _batches(num):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, 5000).astype(np.uint16)
    return [
        data.batch_at(tokens, k, seed=0, batch_size=CFG.batch_size, seq_len=CFG.seq_len).reshape(
            CFG.grad_accum, -1, CFG.seq_len + 1
        )
        for k in range(num)
    ]


def _run(mesh_cfg, devices, num_steps=3):
    """(final state on host, per-step metrics, compiled HLO text, final state on devices)."""
    mesh = sharding.make_mesh(mesh_cfg, devices)
    tx = optimizer.make_optimizer(CFG.optim, CFG.steps)
    with sharding.mesh_context(mesh):
        setup = setup_model(CFG.model, CFG.seed, tx, mesh)
        state = setup.init()
        step = make_train_step(CFG, setup, tx, optimizer.learning_rate_schedule(CFG.optim, CFG.steps))
        batches = [sharding.put_batch(b, sharding.batch_sharding(mesh, 3)) for b in _batches(num_steps)]
        compiled = step.lower(state, batches[0]).compile()
        history = []
        for batch in batches:
            state, metrics = compiled(state, batch)
            history.append(jax.device_get(metrics))
        return jax.device_get(state), history, compiled.as_text(), state


MESHES = {
    "single": (config.MeshConfig(data=1), 1),
    "data2-fsdp2": (config.MeshConfig(data=2, fsdp=2), 4),
    "fsdp2-tensor2": (config.MeshConfig(data=1, fsdp=2, tensor=2), 4),
    "tensor4": (config.MeshConfig(data=1, tensor=4), 4),
}


@pytest.fixture(scope="module")
def runs():
    """Lazily computed `_run` results per mesh name (each compiles once per module)."""
    cache = {}

    def get(name):
        if name not in cache:
            mesh_cfg, num_devices = MESHES[name]
            cache[name] = _run(mesh_cfg, jax.devices()[:num_devices])
        return cache[name]

    return get


@pytest.mark.parametrize("name", ["data2-fsdp2", "fsdp2-tensor2", "tensor4"])
def test_sharded_step_matches_single_device(runs, name):
    ref_state, ref_history, *_ = runs("single")
    state, history, *_ = runs(name)
    for ref, got in zip(ref_history, history):
        for key in ("loss", "ce", "l1", "grad_norm", "nnz_mean"):
            np.testing.assert_allclose(got[key], ref[key], rtol=2e-4, atol=1e-5, err_msg=key)
        np.testing.assert_array_equal(got["nnz_max"], ref["nnz_max"])
        np.testing.assert_allclose(got["fired_fraction"], ref["fired_fraction"], atol=0.02)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-5), state.params, ref_state.params)


def _collectives(hlo: str, op: str) -> list[str]:
    """Result shapes of every `op` instruction (e.g. all-gather) in an HLO text."""
    shapes = []
    for line in hlo.splitlines():
        match = re.search(r"=\s*(\S+)\s+" + re.escape(op) + r"(-start)?\(", line)
        if match:
            shapes.append(match.group(1))
    return shapes


def test_tensor_parallel_step_never_all_gathers_ffn_weights(runs):
    _, _, hlo, state = runs("tensor4")
    ffn_shapes = {f"[{D},{F}]", f"[{F},{D}]"}
    gathered = _collectives(hlo, "all-gather") + _collectives(hlo, "all-to-all") + _collectives(hlo, "collective-permute")
    assert not [s for s in gathered if any(shape in s for shape in ffn_shapes)], gathered
    # The FFN itself reduces its partial outputs instead (one all-reduce per layer, at least).
    assert _collectives(hlo, "all-reduce")
    # Sanity: the weights really are split over the tensor axis.
    w_gate = state.params["layers"][0]["ffn"]["w_gate"]
    assert w_gate.sharding.shard_shape(w_gate.shape) == (D, F // 4)


def test_union_probe_on_a_mesh_matches_single_device():
    """The loop's union probe (train/ffn_paths.py) on sharded parameters and tokens, as
    the loop calls it (one micro-batch of the step's sharded batch), measures what one
    device does."""
    from jax_twell.train import ffn_paths

    unions = {}
    for name in ("single", "data2-fsdp2", "fsdp2-tensor2"):
        mesh_cfg, num_devices = MESHES[name]
        mesh = sharding.make_mesh(mesh_cfg, jax.devices()[:num_devices])
        tx = optimizer.make_optimizer(CFG.optim, CFG.steps)
        with sharding.mesh_context(mesh):
            setup = setup_model(CFG.model, CFG.seed, tx, mesh)
            state = setup.init()
            batch = sharding.put_batch(_batches(1)[0], sharding.batch_sharding(mesh, 3))
            probe = ffn_paths.make_union_probe(setup)
            unions[name] = np.asarray(probe(state.params, batch[0]))
            # the register the loop writes keeps the state's sharding on every mesh
            rule = ffn_paths.PathRule(m=4096, d=2048, f=5632)  # a size where the kernels can win
            state, sides, _ = ffn_paths.update_sides(state, setup, rule, probe, batch[0], [0.1, 60.0])
            assert sides == (True, False), name  # 0.05% and 31% of the layer's neurons
            assert state.ffn_sparse.sharding.is_equivalent_to(setup.state_shardings.ffn_sparse, 1)
            np.testing.assert_array_equal(np.asarray(state.ffn_sparse), [True, False])
    assert unions["single"].shape == (CFG.model.n_layers,) and (unions["single"] > 0).all()
    for name in ("data2-fsdp2", "fsdp2-tensor2"):
        np.testing.assert_allclose(unions[name], unions["single"], rtol=1e-5, err_msg=name)
