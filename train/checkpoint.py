"""Checkpoints of the training state with orbax's CheckpointManager.

Each checkpoint is written into a temporary folder and renamed into place only once
complete (orbax's atomic finalize, with a commit marker on filesystems without atomic
rename), so killing the process at any moment, even with SIGKILL mid-write, leaves the
previous checkpoints intact; leftover temporary folders are removed on the next start.
Rotation is atomic too: a checkpoint that falls out of the `keep` newest is first renamed
out of the listing (into `checkpoints/.rotated`) and only then deleted, so a kill during a
deletion never leaves a half-deleted checkpoint among the listed ones. A kill between a
save and its rotation leaves `keep` + 1 listed; the next run's first save rotates the
oldest out before it writes.
Saves are asynchronous: training continues while the arrays are written.

A state with a NaN or Inf anywhere is never saved (`save` raises instead), so rotation
(`keep` newest) can only ever drop a good checkpoint for a newer good one. Restoring
verifies what it read (it loads, holds the step it is named after, and is finite);
`restore_newest` falls back from a checkpoint that fails to the next older one.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jax_twell.train.state import TrainState

CHECKPOINT_DIR = "checkpoints"
BROKEN_DIR = "broken_checkpoints"  # checkpoints that failed to restore, set aside by a resume
ROTATED_DIR = ".rotated"  # under CHECKPOINT_DIR: rotated-out checkpoints awaiting deletion


class NonFiniteStateError(ValueError):
    """A training state holding NaN or Inf was about to be checkpointed."""


class RestoreError(RuntimeError):
    """No checkpoint (or not the requested one) could be restored; the message says why."""


@jax.jit
def _all_finite(tree) -> jax.Array:
    leaves = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.stack(leaves).all() if leaves else jnp.bool_(True)


def is_finite(state: TrainState) -> bool:
    """Whether every floating-point value of `state` (parameters, optimizer moments) is finite."""
    return bool(_all_finite(state))


class Checkpointer:
    """Periodic, atomic, asynchronous checkpoints of a `TrainState` under `workdir/checkpoints`.

    keep: how many of the newest checkpoints to keep; 0 keeps them all.
    """

    def __init__(self, workdir: str | Path, keep: int, *, read_only: bool = False):
        # read_only: for readers (eval, generate) next to a live run; they must not clean up
        # the temporary folder of a save in progress.
        self.directory = Path(workdir).absolute() / CHECKPOINT_DIR
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=None if read_only or keep == 0 else keep,
                save_interval_steps=0 if read_only else 1,
                enable_async_checkpointing=True,
                cleanup_tmp_directories=not read_only,
                create=not read_only,
                read_only=read_only,
                # Rotation renames a step out of the listing (atomic) instead of deleting it
                # in place; `_empty_rotated` deletes what lies there, outside the listing.
                todelete_subdir=None if read_only else ROTATED_DIR,
            ),
        )
        self._writer = not read_only and jax.process_index() == 0
        self._keep = 0 if read_only else keep
        self._excess_checked = False
        self._empty_rotated()

    def _rotate_excess(self) -> None:
        """Rotates out the oldest checkpoints past `keep`, as the save that a kill cut short
        would have: so a run killed between a save and its rotation, again and again, never
        piles up more than `keep` + 1 checkpoints. Done at this process's first save, not at
        start: a run that stops before it saves (a diverged step) deletes nothing."""
        if not self._writer or self._keep == 0:
            return
        excess = self.all_steps()[: -self._keep]
        if not excess:
            return
        rotated = self.directory / ROTATED_DIR
        rotated.mkdir(exist_ok=True)
        for step in excess:  # a rename takes it out of the listing atomically
            (self.directory / str(step)).rename(rotated / f"{step}.excess")
        self._manager.reload()  # save() empties the rotated folder next

    def _empty_rotated(self) -> None:
        """Deletes the checkpoints rotated out so far (a kill mid-way loses nothing listed)."""
        if not self._writer:
            return
        rotated = self.directory / ROTATED_DIR
        if rotated.is_dir():
            for entry in rotated.iterdir():  # orbax's deleter may rename more in meanwhile
                shutil.rmtree(entry, ignore_errors=True)

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: TrainState) -> None:
        """Starts saving `state` as checkpoint `step` (no-op if that step is already saved).

        Raises NonFiniteStateError, saving nothing, when `state` holds NaN or Inf.
        """
        if step in self._manager.all_steps():
            return
        if not is_finite(state):
            raise NonFiniteStateError(f"the state of step {step} holds NaN or Inf values; it was not checkpointed")
        if not self._excess_checked:
            self._rotate_excess()
            self._excess_checked = True
        self._empty_rotated()
        self._manager.save(step, args=ocp.args.StandardSave(state), force=True)

    def _restore_checked(self, abstract_state: TrainState, step: int) -> TrainState:
        state = TrainState(*self._manager.restore(step, args=ocp.args.StandardRestore(abstract_state)))
        if int(state.step) != step:
            raise ValueError(f"it holds the state of step {int(state.step)}")
        if not is_finite(state):
            raise ValueError("it holds NaN or Inf values")
        return state

    def restore(self, abstract_state: TrainState, step: int | None = None) -> TrainState:
        """Restores checkpoint `step` (default newest) into the shardings of `abstract_state`.

        An explicit `step` must exist and load; with `step=None` a newest checkpoint that
        fails falls back to older ones (see `restore_newest`). Raises RestoreError.
        """
        if step is None:
            return self.restore_newest(abstract_state)[1]
        if step not in self.all_steps():
            saved = ", ".join(map(str, self.all_steps())) or "none"
            raise RestoreError(f"no checkpoint of step {step} in {self.directory} (saved steps: {saved})")
        try:
            return self._restore_checked(abstract_state, step)
        except Exception as e:  # noqa: BLE001  (orbax and tensorstore raise many kinds)
            raise RestoreError(f"checkpoint {step} in {self.directory} does not load: {_reason(e)}") from e

    def restore_newest(self, abstract_state: TrainState, report=None) -> tuple[int, TrainState, list[int]]:
        """(step, state, failed steps) of the newest checkpoint that restores and verifies.

        Every newer checkpoint that fails is reported through `report(message)` (when
        given) by step and reason. Raises RestoreError when none restores.
        """
        steps = self.all_steps()
        if not steps:
            raise RestoreError(f"no checkpoint in {self.directory}")
        failed = []
        for step in reversed(steps):
            try:
                state = self._restore_checked(abstract_state, step)
            except Exception as e:  # noqa: BLE001
                failed.append(step)
                if report is not None:
                    report(f"checkpoint {step} does not load ({_reason(e)})")
                continue
            if failed and report is not None:
                report(f"falling back to checkpoint {step}, the newest that loads")
            return step, state, failed
        raise RestoreError(
            f"none of the checkpoints in {self.directory} loads (steps {', '.join(map(str, steps))}); "
            "they may not match the configuration, or be damaged"
        )

    def set_aside(self, steps: list[int]) -> Path:
        """Moves the checkpoints `steps` (ones that failed to restore) to `workdir/broken_checkpoints`,
        so that the run can save those steps again; returns that folder."""
        target = self.directory.parent / BROKEN_DIR
        target.mkdir(exist_ok=True)
        for step in steps:
            destination = target / str(step)
            if destination.exists():
                shutil.rmtree(destination)
            shutil.move(str(self.directory / str(step)), destination)
        self._manager.reload()
        return target

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the checkpoint manager."""
        self._manager.close()
        self._empty_rotated()


def _reason(error: Exception) -> str:
    """A one-line account of why a restore failed (tensorstore appends long specs: cut)."""
    text = " ".join(str(error).split()).split(" See full TensorStore details")[0]
    return f"{type(error).__name__}: {text[:240]}"
