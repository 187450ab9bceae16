"""Checkpoints of the training state with orbax's CheckpointManager.

Each checkpoint is written into a temporary folder and renamed into place only once
complete (orbax's atomic finalize, with a commit marker on filesystems without atomic
rename), so killing the process at any moment, even with SIGKILL mid-write, leaves the
previous checkpoints intact; leftover temporary folders are removed on the next start.
Saves are asynchronous: training continues while the arrays are written.
"""

from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp

from jax_twell.train.state import TrainState

CHECKPOINT_DIR = "checkpoints"


class Checkpointer:
    """Periodic, atomic, asynchronous checkpoints of a `TrainState` under `workdir/checkpoints`."""

    def __init__(self, workdir: str | Path, keep: int, *, read_only: bool = False):
        # read_only: for readers (eval, generate) next to a live run; they must not clean up
        # the temporary folder of a save in progress.
        self.directory = Path(workdir).absolute() / CHECKPOINT_DIR
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=None if read_only else keep,
                save_interval_steps=0 if read_only else 1,
                enable_async_checkpointing=True,
                cleanup_tmp_directories=not read_only,
                create=not read_only,
                read_only=read_only,
            ),
        )

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint, or None."""
        return self._manager.latest_step()

    def save(self, step: int, state: TrainState) -> None:
        """Starts saving `state` as checkpoint `step` (no-op if that step is already saved)."""
        if step in self._manager.all_steps():
            return
        self._manager.save(step, args=ocp.args.StandardSave(state), force=True)

    def restore(self, abstract_state: TrainState, step: int | None = None) -> TrainState:
        """Restores checkpoint `step` (default newest) into the shardings of `abstract_state`."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        return TrainState(*self._manager.restore(step, args=ocp.args.StandardRestore(abstract_state)))

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the checkpoint manager."""
        self._manager.close()
