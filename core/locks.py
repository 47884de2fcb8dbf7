"""Locks on what a run writes, so that two runs never write, or delete, each other's files.

* `run_folder_lock(folder)`: a run's results folder is exclusive. A second run on it is refused at
  once, with an error that names the holder's pid (written into the lock file).
* `entry_lock(entry, exclusive)`: a cache entry (a trained checkpoint, shared by runs that point at
  the same checkpoints folder) is shared for reading and exclusive for writing; each waits for the other.

Both are `flock(2)` locks on a small file that stays in place (removing it would let two runs lock
two different files of one name). The kernel releases a lock when its holder exits, however it
exits, so a lock left by a killed run never blocks the next one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path

# The lock file a run holds in its results folder (run folders' checks ignore it).
RUN_LOCK_NAME = ".mergecompose.lock"


class FolderInUseError(OSError):
    """Another mergecompose run holds the lock on this results folder."""


def pid_running(pid: int) -> bool:
    """Whether a process `pid` exists on this machine (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def run_folder_lock(folder: str | os.PathLike, what: str = "`out_dir`") -> Iterator[Path]:
    """Hold the exclusive lock on the results folder `folder` (created if absent) for the block.

    Raises `FolderInUseError` at once, naming the holder's pid, when another run holds it; `what`
    names the folder's argument in that error.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{what} {str(folder)!r} exists and is not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    descriptor = _open_lock_file(folder / RUN_LOCK_NAME)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FolderInUseError(
                f"{what} {str(folder)!r} is in use by another mergecompose run ({_holder(descriptor)}); "
                "wait for it to finish or choose another folder"
            ) from None
        _record_holder(descriptor)
        yield folder
    finally:
        os.close(descriptor)


def entry_lock_path(entry: Path) -> Path:
    """The lock file of the cache entry `entry`: beside it, since the entry itself is renamed into place."""
    return entry.parent / f".{entry.name}.lock"


@contextlib.contextmanager
def entry_lock(
    entry: str | os.PathLike, exclusive: bool, notice: Callable[[str], None] | None = None
) -> Iterator[None]:
    """Hold the cache entry `entry` shared (reading) or exclusive (writing) for the block, waiting if needed.

    `notice` (e.g. `print`) gets one line when the lock is not free at once, so that a wait
    behind another run's training does not look like a hang.
    """
    entry = Path(entry)
    descriptor = _open_lock_file(entry_lock_path(entry))
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    try:
        try:
            fcntl.flock(descriptor, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            if notice is not None:
                # A writer records its pid; readers do not (they share the lock), so only a wait for a writer names one.
                writer = "" if exclusive else f" (pid {_recorded_pid(descriptor)})"
                notice(
                    f"waiting for another mergecompose run{writer} that is "
                    f"{'using' if exclusive else 'writing'} {entry}"
                )
            fcntl.flock(descriptor, mode)
        if exclusive:
            _record_holder(descriptor)
        yield
    finally:
        os.close(descriptor)


def _open_lock_file(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # the mode the user's umask allows


def _record_holder(descriptor: int) -> None:
    """Write this process's pid into the lock file it holds exclusively (for the errors of others)."""
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)


def _recorded_pid(descriptor: int) -> int | None:
    text = os.pread(descriptor, 32, 0).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None


def _holder(descriptor: int) -> str:
    """The pid recorded in a lock file held exclusively by someone else, described for an error message."""
    pid = _recorded_pid(descriptor)
    if pid is None:
        return "pid unknown"
    if not pid_running(pid):
        # flock locks pass to forked children: the recorded holder is gone, a child of it is not.
        return f"pid {pid}, which has exited; a process it started still holds the lock"
    return f"pid {pid}"
