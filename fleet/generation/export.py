"""`fleet export DIR --format ...`: results in the usual interchange formats, streamed.

- ``openai-batch``: the output lines of an OpenAI / vLLM batch job, one per row, completed
  rows first, then the rows in errors.jsonl::

      {"id": "batch_req_…", "custom_id": ID, "response": {"status_code": 200, "request_id": "req_…",
       "body": {chat.completion: choices[0].message{role, content, reasoning_content?, tool_calls?},
                finish_reason, usage}}, "error": null}
      {"id": "batch_req_…", "custom_id": ID, "response": null, "error": {"code": "500", "message": …}}

  The ids derive from the row id, so exporting twice gives identical files. `model` comes
  from the job manifest ("model", else the one model its servers served; null otherwise).
- ``jsonl``: one flat object per completed row, the result columns, with `messages`,
  `tool_calls` and `params` decoded from JSON.
- ``sharegpt``: ``{"id", "conversations": [{"from": "system"|"human"|"gpt"|"tool", "value"}, …,
  the generated gpt turn]}``; an assistant turn keeps its `tool_calls`, a tool turn its
  `tool_call_id`, the generated turn its `reasoning_content` and `tool_calls` when present;
  `tools` (from the stored params) goes at the top level.

The destination is written to DEST.tmp, fsync'd and renamed: a reader never sees half a
file. A destination ending in ``.gz`` is gzip-compressed.
"""

from __future__ import annotations

import gzip
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from fleet.generation.store import _dumps, _fsync_dir, _fsync_file, _loads, iter_results, read_errors, read_manifest

__all__ = ["export", "FORMATS"]

Format = Literal["openai-batch", "jsonl", "sharegpt"]
FORMATS: tuple[str, ...] = ("openai-batch", "jsonl", "sharegpt")

_SHAREGPT_FROM = {"system": "system", "user": "human", "assistant": "gpt", "tool": "tool"}


def _json(v: str | None) -> Any:
    return None if v is None else _loads(v)


def _short(id: str) -> str:
    return hashlib.sha256(id.encode()).hexdigest()[:24]


def _openai_line(row: dict[str, Any], model: str | None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": row["completion"]}
    if row["reasoning_content"] is not None:
        message["reasoning_content"] = row["reasoning_content"]
    tool_calls = _json(row["tool_calls"])
    if tool_calls:
        message["tool_calls"] = tool_calls
    pt, ct = row["prompt_tokens"], row["completion_tokens"]
    short = _short(row["id"])
    return {
        "id": f"batch_req_{short}",
        "custom_id": row["id"],
        "response": {
            "status_code": 200,
            "request_id": f"req_{short}",
            "body": {
                "id": f"chatcmpl-{short}",
                "object": "chat.completion",
                "created": int(row["finished_at"] or 0),
                "model": model,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": row["finish_reason"]}],
                "usage": {"prompt_tokens": pt, "completion_tokens": ct,
                          "total_tokens": (pt or 0) + (ct or 0) if pt is not None or ct is not None else None},
            },
        },
        "error": None,
    }


def _openai_error_line(rec: dict[str, Any]) -> dict[str, Any]:
    status = rec.get("status")
    return {
        "id": f"batch_req_{_short(str(rec['id']))}",
        "custom_id": rec["id"],
        "response": None,
        "error": {"code": str(status) if status is not None else None, "message": rec.get("error"),
                  "attempts": rec.get("attempts"), "server": rec.get("server")},
    }


def _flat_line(row: dict[str, Any]) -> dict[str, Any]:
    out = dict(row)
    for k in ("messages", "tool_calls", "params"):
        out[k] = _json(out[k])
    return out


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def _sharegpt_line(row: dict[str, Any]) -> dict[str, Any]:
    turns: list[dict[str, Any]] = []
    for m in _json(row["messages"]) or []:
        role = m.get("role")
        turn: dict[str, Any] = {"from": _SHAREGPT_FROM.get(role, role), "value": _text(m.get("content"))}
        if m.get("tool_calls"):
            turn["tool_calls"] = m["tool_calls"]
        if role == "tool" and m.get("tool_call_id"):
            turn["tool_call_id"] = m["tool_call_id"]
        turns.append(turn)
    gen: dict[str, Any] = {"from": "gpt", "value": row["completion"] or ""}
    if row["reasoning_content"] is not None:
        gen["reasoning_content"] = row["reasoning_content"]
    tool_calls = _json(row["tool_calls"])
    if tool_calls:
        gen["tool_calls"] = tool_calls
    turns.append(gen)
    out: dict[str, Any] = {"id": row["id"], "conversations": turns}
    params = _json(row.get("params"))
    if params and params.get("tools"):
        out["tools"] = params["tools"]
    return out


def _model_name(out_dir: str | Path) -> str | None:
    """The served model, as the runner's manifest records it (top-level "model", else the servers')."""
    try:
        m = read_manifest(out_dir) or {}
    except (OSError, ValueError):
        return None
    if isinstance(m.get("model"), str):
        return m["model"]
    names = {s.get("model") for s in m.get("servers") or [] if isinstance(s, dict) and s.get("model")}
    return names.pop() if len(names) == 1 else None


def export(out_dir: str | Path, fmt: Format, dest: str | Path) -> int:
    """Write the job in `out_dir` to `dest` as `fmt`; return the rows written (errors included
    for openai-batch). Streams shard by shard; the write is atomic."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    dest = Path(dest)
    if not (Path(out_dir) / "shards").is_dir():
        raise FileNotFoundError(f"{out_dir} holds no generation results (no shards/ directory)")
    model = _model_name(out_dir) if fmt == "openai-batch" else None
    convert: Callable[[dict[str, Any]], dict[str, Any]] = {
        "openai-batch": lambda r: _openai_line(r, model),
        "jsonl": _flat_line,
        "sharegpt": _sharegpt_line,
    }[fmt]
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    n = 0
    try:
        raw = open(tmp, "wb")
        f = gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6) if dest.suffix == ".gz" else raw
        try:
            for batch in iter_results(out_dir):
                f.write(b"".join(_dumps(convert(r)) + b"\n" for r in batch.to_pylist()))
                n += batch.num_rows
            if fmt == "openai-batch":
                for rec in read_errors(out_dir):
                    f.write(_dumps(_openai_error_line(rec)) + b"\n")
                    n += 1
        finally:
            if f is not raw:
                f.close()
            raw.close()
        _fsync_file(tmp)
        os.replace(tmp, dest)
        _fsync_dir(dest.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return n
