"""Checkpoints: exact round trip of the train state; interrupted saves are never picked up."""

import dataclasses
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_twell.models import PRESETS as MODEL_PRESETS
from jax_twell.train import config, optimizer, sharding
from jax_twell.train.checkpoint import ROTATED_DIR, Checkpointer, NonFiniteStateError, RestoreError
from jax_twell.train.state import setup_model

MODEL = dataclasses.replace(MODEL_PRESETS["tiny"], d_model=32, d_ff=64, n_layers=2, n_heads=2, head_dim=16, max_seq_len=32)


@pytest.fixture(scope="module")
def setup_state():
    mesh = sharding.make_mesh(config.MeshConfig(data=1), jax.devices()[:1])
    tx = optimizer.make_optimizer(config.OptimConfig(), 10)
    with sharding.mesh_context(mesh):
        setup = setup_model(MODEL, 0, tx, mesh)
        state = setup.init()
    # Non-trivial optimizer moments and counters, so the round trip has something to lose.
    state = state._replace(
        step=state.step + 7,
        opt_state=jax.tree.map(lambda x: x + 0.5 if x.dtype == np.float32 else x + 3, state.opt_state),
        since_fired=state.since_fired + 2,
        ffn_sparse=state.ffn_sparse.at[0].set(True),
    )
    return setup, state


@pytest.mark.slow
def test_round_trip_restores_state_exactly_with_shardings(tmp_path, setup_state):
    setup, state = setup_state
    ckpt = Checkpointer(tmp_path, keep=2)
    ckpt.save(7, state)
    ckpt.save(7, state)  # saving a step twice is a no-op
    ckpt.wait()
    restored = Checkpointer(tmp_path, keep=2, read_only=True).restore(setup.abstract_state)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(got, want)
        assert got.sharding == want.sharding
    ckpt.close()


def test_keeps_the_newest_checkpoints(tmp_path, setup_state):
    setup, state = setup_state
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, state)
    ckpt.wait()
    assert ckpt.latest_step() == 3
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [2, 3]
    ckpt.close()


def test_rotation_never_deletes_inside_a_listed_checkpoint(tmp_path, setup_state, monkeypatch):
    """A checkpoint rotated out leaves the listing in one rename before any file of it is
    deleted, so a kill at any moment of a rotation cannot leave a half-deleted checkpoint
    listed (it would be listed and fail to load)."""
    import os

    _, state = setup_state
    root = tmp_path / "checkpoints"
    in_place = []

    def recording(delete):
        def wrapper(path, *args, **kwargs):
            relative = Path(os.fspath(path)).absolute().relative_to(root) if root in Path(os.fspath(path)).absolute().parents else None
            if relative is not None and relative.parts[0].isdigit():
                in_place.append(str(relative))
            return delete(path, *args, **kwargs)
        return wrapper

    for module, name in ((os, "unlink"), (os, "remove"), (os, "rmdir"), (shutil, "rmtree")):
        monkeypatch.setattr(module, name, recording(getattr(module, name)))
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3, 4):
        ckpt.save(step, at_step(state, step))
        ckpt.wait()
    ckpt.close()
    assert ckpt.all_steps() == [3, 4]
    assert not in_place, f"deleted inside listed checkpoints: {in_place[:5]}"
    leftover = [p.name for p in (root / ROTATED_DIR).iterdir()] if (root / ROTATED_DIR).exists() else []
    assert leftover == [], "rotated checkpoints are deleted once out of the listing"


def at_step(state, step):
    return state._replace(step=jnp.asarray(step, state.step.dtype))


def test_interrupted_save_is_ignored_and_cleaned_up(tmp_path, setup_state):
    setup, state = setup_state
    state = at_step(state, 5)
    ckpt = Checkpointer(tmp_path, keep=3)
    ckpt.save(5, state)
    ckpt.wait()
    ckpt.close()
    # What a process killed mid-save leaves behind: a temporary folder, never a step folder.
    root = tmp_path / "checkpoints"
    partial = root / "10.orbax-checkpoint-tmp-1234567890"
    shutil.copytree(root / "5", partial)
    for marker in partial.rglob("commit_success.txt"):
        marker.unlink()
    (partial / "default" / "manifest.ocdbt").write_bytes(b"truncated")

    reader = Checkpointer(tmp_path, keep=3, read_only=True)
    assert reader.latest_step() == 5 and partial.exists(), "readers neither use nor delete it"
    reader.close()
    writer = Checkpointer(tmp_path, keep=3)  # a resumed run: restores 5, then saves again
    assert writer.latest_step() == 5
    restored = writer.restore(setup.abstract_state)
    np.testing.assert_array_equal(restored.since_fired, state.since_fired)
    np.testing.assert_array_equal(restored.ffn_sparse, state.ffn_sparse)
    writer.save(6, at_step(restored, 6))
    writer.wait()
    assert not partial.exists(), "the writer removes leftovers of interrupted saves"
    assert writer.latest_step() == 6
    writer.close()


def test_keep_zero_keeps_every_checkpoint(tmp_path, setup_state):
    _, state = setup_state
    ckpt = Checkpointer(tmp_path, keep=0)
    for step in (1, 2, 3, 4):
        ckpt.save(step, at_step(state, step))
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2, 3, 4]
    ckpt.close()


def test_the_first_save_rotates_out_what_killed_runs_left_past_keep(tmp_path, setup_state):
    """A kill between a save and its rotation leaves keep + 1 checkpoints; without a
    rotation at start, kills in that window again and again would pile them up."""
    setup, state = setup_state
    ckpt = Checkpointer(tmp_path, keep=0)  # what three such kills leave behind
    for step in (1, 2, 3, 4, 5):
        ckpt.save(step, at_step(state, step))
    ckpt.wait()
    ckpt.close()
    reader = Checkpointer(tmp_path, keep=2, read_only=True)
    assert reader.all_steps() == [1, 2, 3, 4, 5], "a reader next to a live run rotates nothing"
    reader.close()
    writer = Checkpointer(tmp_path, keep=2)
    assert writer.all_steps() == [1, 2, 3, 4, 5], "a run that never saves deletes nothing"
    assert int(writer.restore(setup.abstract_state).step) == 5
    writer.save(6, at_step(state, 6))  # its first save rotates the excess out before it writes
    writer.wait()
    assert writer.all_steps() == [5, 6]
    writer.close()
    assert [p.name for p in (tmp_path / "checkpoints" / ROTATED_DIR).iterdir()] == []


def test_a_non_finite_state_is_never_saved_so_never_rotates_good_ones_out(tmp_path, setup_state):
    _, state = setup_state
    ckpt = Checkpointer(tmp_path, keep=1)
    ckpt.save(1, at_step(state, 1))
    ckpt.wait()
    bad = at_step(state, 2)
    bad = bad._replace(params=jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.nan), bad.params))
    with pytest.raises(NonFiniteStateError, match="step 2 holds NaN or Inf"):
        ckpt.save(2, bad)
    ckpt.wait()
    assert ckpt.all_steps() == [1]
    ckpt.close()


def test_restore_verifies_and_falls_back_past_broken_checkpoints(tmp_path, setup_state):
    setup, state = setup_state
    ckpt = Checkpointer(tmp_path, keep=0)
    for step in (1, 2, 3):
        ckpt.save(step, at_step(state, step))
    ckpt.wait()
    root = tmp_path / "checkpoints"
    for path in (root / "3").rglob("*"):  # newest: garbage data files
        if path.is_file() and path.parent.name == "d":
            path.write_bytes(b"garbage")
    shutil.rmtree(root / "2" / "default")  # next: its arrays gone
    messages = []
    step, restored, failed = ckpt.restore_newest(setup.abstract_state, report=messages.append)
    assert (step, failed, int(restored.step)) == (1, [3, 2], 1)
    assert messages[0].startswith("checkpoint 3 does not load (") and messages[1].startswith("checkpoint 2 does not load")
    assert messages[-1] == "falling back to checkpoint 1, the newest that loads"
    with pytest.raises(RestoreError, match="no checkpoint of step 9 in .* \\(saved steps: 1, 2, 3\\)"):
        ckpt.restore(setup.abstract_state, 9)
    with pytest.raises(RestoreError, match="checkpoint 3 in .* does not load"):
        ckpt.restore(setup.abstract_state, 3)
    aside = ckpt.set_aside(failed)
    assert ckpt.all_steps() == [1] and sorted(p.name for p in aside.iterdir()) == ["2", "3"]
    ckpt.save(2, at_step(restored, 2))  # the set-aside step can be saved again
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2]
    ckpt.close()
    shutil.rmtree(root / "1")
    shutil.rmtree(root / "2" / "default")
    with pytest.raises(RestoreError, match="none of the checkpoints .* loads"):
        Checkpointer(tmp_path, keep=0, read_only=True).restore(setup.abstract_state)
