"""Writes that survive a crash: fsync a file or a directory; replace a file atomically."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["atomic_write", "fsync"]


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
