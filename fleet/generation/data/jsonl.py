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

__all__ = ["dumps", "loads", "loads_utf8", "read_jsonl", "repair_jsonl"]

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


def stdlib_loads_utf8(data: bytes | str) -> Any:
    """json.loads, refusing what orjson refuses too: a `\\uD800`–`\\uDFFF` escape left unpaired (a
    lone surrogate). json.loads takes it, and the row then cannot be sent (UTF-8 cannot encode it) nor
    stored; only such an escape can make one, so only a line holding `\\ud` is checked (raises
    UnicodeEncodeError, a ValueError that names UTF-8)."""
    obj = json.loads(data)
    if (b"\\ud" in data.lower()) if isinstance(data, bytes) else ("\\ud" in data.lower()):
        json.dumps(obj, ensure_ascii=False).encode()
    return obj


# The input reader's codec: a line with a lone surrogate is a bad line (not UTF-8) with either codec.
loads_utf8: Callable[[bytes | str], Any] = loads if loads is not json.loads else stdlib_loads_utf8


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
