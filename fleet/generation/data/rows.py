"""The row model of an input: `Request` (a row to generate), `Reject` (a row that cannot be,
and why), `InputStats` (what a pass saw), and the ids: `content_id` for a row without one,
`digest` for compact id sets. The rules that make rows out of input lines are in
`fleet.generation.data.inputs`' docstring; the shapes and their checks in `rowshapes`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

__all__ = ["Request", "Reject", "InputStats", "Bad", "content_id", "digest", "DIGEST_MASK", "DUPLICATE_REASON",
           "raw_text", "strip_none", "type_name"]

DUPLICATE_REASON = "duplicate id"  # every duplicate reject's reason starts with this
_RAW_MAX = 2000
DIGEST_MASK = (1 << 64) - 1


@dataclass(slots=True)
class Request:
    """One row to generate."""

    id: str  # custom_id / id / content_id(...)
    line: int  # 1-based line (JSONL) or row number (Parquet)
    messages: list[dict[str, Any]]  # OpenAI chat messages, nulls removed
    params: dict[str, Any]  # request body minus messages and model, config defaults applied
    # The row's other top-level fields (source, category, ...): kept for exports that
    # hand the input row back with the conversation replaced (SpecForge). None: none.
    extra: dict[str, Any] | None = None


@dataclass(slots=True)
class Reject:
    """One input row that cannot be generated, and why."""

    line: int
    id: str | None
    reason: str
    raw: str  # the row as read, first 2,000 characters


@dataclass(slots=True)
class InputStats:
    """What one pass over the input saw (pass one to `iter_input(stats=...)`)."""

    rows: int = 0  # non-blank lines / Parquet rows read
    blank: int = 0  # blank lines skipped (JSONL)
    requests: int = 0  # requests yielded
    skipped: int = 0  # requests not yielded because skip_ids said they are done
    rejects: int = 0  # rejects yielded (duplicates included)
    duplicates: int = 0  # rejects for a repeated id


def digest(id: str) -> int:
    """The 64-bit in-process digest of an id, for compact id sets.

    Python's string hash is SipHash-1-3 under a per-process random key: as collision-
    resistant as a truncated blake2b for 64 bits (about 3e-8 for any collision among a
    million ids), and 7x cheaper. These digests never leave the process, so the per-process
    key is no loss; nothing is ever persisted or compared across processes by digest.
    """
    return hash(id) & DIGEST_MASK



class Bad(Exception):
    """A row that cannot be generated; `args[0]` is the reason."""


def content_id(messages: list[dict[str, Any]], params: dict[str, Any]) -> str:
    """Stable id of a row without one: h-<24 hex of sha256(canonical JSON of messages + params)>."""
    blob = json.dumps({"messages": messages, "params": params}, sort_keys=True,
                      separators=(",", ":"), ensure_ascii=False)
    return "h-" + hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()[:24]



def type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def strip_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None} if None in d.values() else d



def raw_text(row: Any) -> str:
    if isinstance(row, bytes):
        return row.decode("utf-8", "replace").rstrip("\r\n")[:_RAW_MAX]
    try:
        return json.dumps(row, ensure_ascii=False, default=str)[:_RAW_MAX]
    except (TypeError, ValueError):
        return repr(row)[:_RAW_MAX]

