"""JSON lines files of an output directory (errors, rejects, quality rejects): the codec, a
reader that skips what it cannot read, and the repair of a torn last line.

The codec (`dumps`, `loads`) is the package's one JSON codec: the input reader, the HTTP
client and the probes use it too. orjson when it is installed (several times faster than the
standard library on rows, completions and rejects; Prefect depends on it), else the standard
library; both give and take UTF-8 bytes.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["dumps", "loads", "read_jsonl", "repair_jsonl"]

log = logging.getLogger("fleet.generation.data.store")

try:
    import orjson

    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

    loads: Callable[[bytes | str], Any] = orjson.loads
except ImportError:  # pragma: no cover - depends on the environment
    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()

    loads = json.loads


def repair_jsonl(path: Path) -> int:
    """Cut a torn last line (a kill mid-append); return the bytes removed."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return 0
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        pos, keep = size, 0
        while pos > 0:
            step = min(65536, pos)
            pos -= step
            f.seek(pos)
            nl = f.read(step).rfind(b"\n")
            if nl >= 0:
                keep = pos + nl + 1
                break
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    log.warning("%s: removed a torn last line (%d bytes) left by a killed writer", path, size - keep)
    return size - keep


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = loads(line)
            except ValueError:
                log.warning("%s:%d: unreadable line skipped", path, n)
                continue
            if isinstance(rec, dict):
                yield rec
