"""One training run per work directory: an advisory lock file.

`train` holds `workdir/train.lock` (an `fcntl.flock` lock, released by the kernel when its
holder exits, however it exits) for the whole run. The file records the holder's pid and
host, so a second run on the same directory refuses with a message naming them. A lock
file left behind by a process that died (kill -9, a crash, a lost node) holds no kernel
lock any more: the next run takes it over and says whose it was. A clean exit empties the
file, so only an interrupted holder is reported.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

LOCK_FILE = "train.lock"


class RunLockedError(RuntimeError):
    """Another live process holds the work directory's lock."""


def _holder(text: str) -> str:
    fields = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    if not fields:
        return "another process"
    return f"pid {fields.get('pid', '?')} on host {fields.get('host', '?')}"


class WorkdirLock:
    """Exclusive advisory lock on `workdir/train.lock`; a context manager.

    `acquire()` raises `RunLockedError` naming the holder's pid and host when another
    process holds the lock; `taken_over` is then the description of a dead holder whose
    stale lock was taken over (None when the lock was free).
    """

    def __init__(self, workdir: str | Path):
        self.path = Path(workdir) / LOCK_FILE
        self.taken_over: str | None = None
        self._fd: int | None = None

    def acquire(self) -> "WorkdirLock":
        """Takes the lock or raises `RunLockedError`; idempotent while held."""
        if self._fd is not None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise OSError(e.errno, f"cannot lock {self.path}: {e.strerror}") from None
            raise RunLockedError(
                f"{self.path.parent} is in use by another training run ({_holder(self._read())}); "
                "wait for it to finish or stop it, or choose another workdir=..."
            ) from None
        previous = os.pread(fd, 4096, 0).decode(errors="replace")
        self.taken_over = _holder(previous) if previous.strip() else None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid={os.getpid()}\nhost={socket.gethostname()}\n".encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def _read(self) -> str:
        try:
            return self.path.read_text(errors="replace")
        except OSError:
            return ""

    def release(self) -> None:
        """Empties the lock file (a clean exit) and releases the lock."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        finally:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def __enter__(self) -> "WorkdirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
