"""The writer's lock of a directory that one process writes at a time (a training run, a data directory).

    DIR/.lock    an fcntl.flock lock held by the one process writing DIR, for as long as it writes; the kernel
                 releases it when that process dies, however it dies. The file holds the holder's pid, host and
                 start time, for the error a second writer gets

Readers never take the lock. The file is never deleted (deleting it could let two processes lock two different
files) and is updated in place through `fsio.open_in_place`, so a symlink there is refused, never written through.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dgemma.io import fsio
from dgemma.io.dirkind import LOCK


class BusyError(ValueError):
    """Another live process writes this directory (a run, a data directory). A ValueError, so `dgemma` prints it on one
    line (exit 2)."""




def _holder(path: Path) -> str:
    """What the lock file says about its holder (written right after it took the lock: retry a moment if empty)."""
    for _ in range(20):
        try:
            info = json.loads(path.read_text() or "null")
        except (OSError, json.JSONDecodeError):
            info = None
        if isinstance(info, dict):
            return f"pid {info.get('pid')} on host {info.get('host')} (since {info.get('since')})"
        time.sleep(0.05)
    return "another process (its pid is not recorded yet)"


def _busy(run: Path, path: Path) -> BusyError:
    return BusyError(f"{run} is being written by {_holder(path)}; wait for it to finish or stop it, then run "
                        "the same command again")


def check_unlocked(run: Path) -> None:
    """Raise BusyError if a live process holds `run`'s lock; touches nothing (a read-only probe)."""
    path = Path(run) / LOCK
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO there must not hang the probe
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _busy(Path(run), path) from None
    finally:
        os.close(fd)  # closing drops the probe's lock, if it got it


@contextmanager
def locked(run: Path) -> Iterator[None]:
    """Create `run` if needed and hold its writer lock for the block (BusyError if a live process holds it). The
    lock file is never deleted: deleting it could let two processes lock two different files. It is updated in place,
    so a symlink there is refused (UnsafeFileError), never written through."""
    run = Path(run)
    run.mkdir(parents=True, exist_ok=True)
    path = run / LOCK
    fd = fsio.open_in_place(path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _busy(run, path) from None
        since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since}).encode() + b"\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, info, 0)
        yield
    finally:
        os.close(fd)  # releases the lock (the kernel does the same when the process dies)
