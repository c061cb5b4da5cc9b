"""One writer per output folder: `kvarn run` holds an exclusive lock on a file in the folder it
writes while it runs, so a second run into the same folder is refused naming the first (its pid
and command) instead of both running and the last silently replacing the other's results.

The lock is `fcntl.flock` on `LOCK_NAME` in the folder: the kernel drops it when the holder
exits, however it exits (a killed run leaves no stale lock, only the file, emptied or with the
dead holder's line, which the next run overwrites). The file stays in a folder the run wrote; a
folder the run created and wrote nothing into (a run refused by a later check) is removed.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import sys
from contextlib import contextmanager
from pathlib import Path

LOCK_NAME = ".kvarn-run.lock"


class OutputBusy(RuntimeError):
    """Another process holds the output folder's lock; the message names it."""


@contextmanager
def hold_output(folder, command: list[str] | None = None):
    """Hold `folder`'s write lock (the folder created if needed) for the `with` block; raise
    OutputBusy at once, naming the holder's pid and command, if another process holds it."""
    folder = Path(folder)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "a process that has not yet named itself"
            raise OutputBusy(f"{folder} is being written by another run ({holder}); wait for it to finish, "
                             f"or give this run another output folder (lock: {path})") from None
        cmd = shlex.join(command if command is not None else [Path(sys.argv[0]).name, *sys.argv[1:]])
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}: {cmd}\n".encode(), 0)
        try:
            yield path
        finally:
            os.ftruncate(fd, 0)
            if created and [p.name for p in folder.iterdir()] == [LOCK_NAME]:
                path.unlink()  # a run refused before writing leaves no folder behind
                folder.rmdir()
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
