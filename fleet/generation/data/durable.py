"""Writes that survive a crash: fsync a file or a directory; replace a file atomically."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

__all__ = ["atomic_write", "fsync", "write_json_atomic"]


def fsync(path: Path) -> None:
    """fsync a file, or a directory (its entries: a rename in it is then on disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync(path.parent)


def write_json_atomic(path: Path, data: Any, *, sync: bool = True) -> None:
    """Replace `path` with `data` as indented JSON: a reader sees the old file or the new, never half.

    `sync=False` skips the fsync, for a file rewritten every few seconds that is only a view
    (progress.json) or written as the process ends (exit.json). The temporary name is per
    process and thread (the controller's threads write the same files). A failed write names
    the file it was for (disk full at which file) and leaves no temporary behind."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, default=str)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        if not exc.filename:   # a failed write() names no file
            exc.filename = str(path)
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise
