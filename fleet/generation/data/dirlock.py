"""The output directory's lock (DIR/.lock): one runner writes a directory at a time.

An fcntl lock on an open file: the kernel drops it when its holder dies, however it dies.
The file holds who took it (pid, host, since) for the message the next one gets.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from fleet.errors import FatalError, JobConflict

__all__ = ["lock_dir", "unlock_dir"]


def _lock_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"])) if "since" in info else "?"
        return f"pid {info.get('pid', '?')} on {info.get('host', '?')}, since {since}"
    except (OSError, ValueError, TypeError):
        return "pid unknown"


def lock_dir(out_dir: Path) -> int:
    """Take DIR/.lock without waiting; its fd (FatalError naming the holder when it is taken)."""
    path = out_dir / ".lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise FatalError(f"cannot open {path}: {exc.strerror}",
                         remedy="pass an --output directory you can write to") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _lock_holder(fd)
        os.close(fd)
        raise JobConflict(   # a second job into one directory: the CLI's exit 2, like decide()'s refusals
            f"output directory {out_dir} is in use by another generation runner ({holder})",
            remedy="wait for that runner to finish, or stop it first; two runners writing one "
                   "directory would duplicate rows. To run a second job, give it its own --output.",
        ) from None
    except OSError as exc:  # ENOLCK: a filesystem without locks (some network filesystems)
        os.close(fd)
        raise FatalError(f"cannot lock output directory {out_dir}: {exc.strerror}",
                         remedy="put --output on a local filesystem: results are fsync'd shard by "
                                "shard and the lock is what keeps a second runner out") from exc
    info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, info, 0)
    return fd


def unlock_dir(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
