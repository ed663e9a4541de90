"""The input row handed back, as SpecForge's `scripts/regenerate_train_data.py` writes it.

Its three files are: DEST (the input row with `conversations` replaced and `"status":
"success"`), DEST_error.jsonl (the input row with `"status": "error"` and `"error"`) and
DEST_skipped.jsonl (the input row with `"status": "skipped"` and `"error"`); every line keeps
the input row's key order. `fleet export --format specforge` writes the same set:

- `handed_back`: a result row's input fields (the `extra` column, in the input's key order
  kept in `key_order`) around the new conversation;
- `side_lines`: errors.jsonl and quality_rejects.jsonl as DEST_error.jsonl lines, and
  rejects.jsonl as DEST_skipped.jsonl lines, each the *input row* read back from the job's
  input (the manifest's `input.path`, at the line each record names). When the input cannot
  be read any more, the line holds what fleet kept: the id (errors), or the row's first
  2,000 characters (rejects, under `"data"` when they do not parse).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fleet.errors import InputError
from fleet.generation.data.jsonl import loads
from fleet.generation.data.manifest import read_manifest
from fleet.generation.data.results import read_errors, read_quality_rejects, read_rejects
from fleet.generation.data.rows import InputStats
from fleet.generation.data.rowshapes import KEY_ORDER
from fleet.generation.data.sources import input_lines, is_parquet, parquet_rows

__all__ = ["handed_back", "input_fields", "side_lines"]

_ID_KEYS = ("id", "custom_id")
_CONVERSATION_KEYS = ("conversations", "messages", "body")


def input_fields(row: dict[str, Any]) -> tuple[dict[str, Any], list[str] | None]:
    """A result row's input fields (the `extra` column, decoded) and the input's key order
    (`key_order`), if kept."""
    extra = row.get("extra")
    fields = dict(loads(extra) if isinstance(extra, str | bytes) else extra or {})
    fields.pop(KEY_ORDER, None)
    order = row.get("key_order")
    return fields, list(order) if order else None


def handed_back(fields: dict[str, Any], order: list[str] | None, rid: str, conv: list[dict[str, Any]],
                tools: Any) -> dict[str, Any]:
    """The input row with its conversation replaced, keys in the input's order (default: "id",
    "conversations", then the others); the row's id is always "id"; `tools` only when set."""
    out: dict[str, Any] = {}
    for k in order or ("id", "conversations"):
        if k in _ID_KEYS:
            out.setdefault("id", rid)
        elif k in _CONVERSATION_KEYS:
            out["conversations"] = conv
        elif k == "tools":
            if tools:
                out["tools"] = tools
        elif k in fields:
            out[k] = fields[k]
    for k, v in fields.items():
        if k not in _ID_KEYS:
            out.setdefault(k, v)
    out.setdefault("id", rid)
    out.setdefault("conversations", conv)
    if tools:
        out.setdefault("tools", tools)
    return out


def _input_path(out_dir: str | Path) -> Path | None:
    try:
        m = read_manifest(out_dir) or {}
    except (OSError, ValueError):
        return None
    p = (m.get("input") or {}).get("path")
    return Path(p) if isinstance(p, str) and Path(p).is_file() else None


def _input_rows(path: Path | None, want: set[int]) -> dict[int, Any]:
    """The parsed input rows at `want` (1-based lines, or row numbers for Parquet); {} when the
    input is gone or breaks (the caller falls back to what fleet kept)."""
    if path is None or not want:
        return {}
    got: dict[int, Any] = {}
    last = max(want)
    try:
        if is_parquet(path):
            for n, obj, _ in parquet_rows(path, InputStats()):
                if n in want:
                    got[n] = obj
                if n >= last:
                    break
            return got
        for n, line in enumerate(input_lines(path), 1):
            if n in want:
                try:
                    got[n] = loads(line[3:] if n == 1 and line.startswith(b"\xef\xbb\xbf") else line)
                except ValueError:
                    pass
            if n >= last:
                break
    except (OSError, InputError):
        return got
    return got


def _with_status(row: Any, status: str, error: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        return {"status": status, "error": error, "data": row}
    return {**row, "status": status, "error": error}


def _reject_row(rec: dict[str, Any], rows: dict[int, Any]) -> Any:
    if rec.get("line") in rows:
        return rows[rec["line"]]
    raw = rec.get("raw")
    try:
        return loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return raw


def side_lines(out_dir: str | Path) -> tuple[Iterator[dict[str, Any]], Iterator[dict[str, Any]]]:
    """(DEST_error.jsonl lines, DEST_skipped.jsonl lines) of the job in `out_dir`."""
    errors = list(read_errors(out_dir))
    quality = list(read_quality_rejects(out_dir))
    rejects = list(read_rejects(out_dir))
    want = {r["line"] for r in [*errors, *quality, *rejects] if isinstance(r.get("line"), int)}
    rows = _input_rows(_input_path(out_dir), want)

    def input_row(rec: dict[str, Any]) -> Any:
        line = rec.get("line")
        return rows[line] if line in rows else {"id": rec.get("id")}

    def error_lines() -> Iterator[dict[str, Any]]:
        for rec in errors:
            yield _with_status(input_row(rec), "error", str(rec.get("error")))
        for rec in quality:
            reasons = ", ".join(rec.get("reasons") or [])
            yield _with_status(input_row(rec), "error", f"rejected by the quality gate(s): {reasons}")

    def skipped_lines() -> Iterator[dict[str, Any]]:
        for rec in rejects:
            yield _with_status(_reject_row(rec, rows), "skipped", str(rec.get("reason")))

    return error_lines(), skipped_lines()
