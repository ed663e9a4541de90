"""`fleet export DIR --format ...`: results in the usual interchange formats, streamed.

- ``openai-batch``: the output lines of an OpenAI / vLLM batch job, one per row, completed
  rows first, then the rows in errors.jsonl::

      {"id": "batch_req_…", "custom_id": ID, "response": {"status_code": 200, "request_id": "req_…",
       "body": {chat.completion: choices[0].message{role, content, reasoning_content?, tool_calls?},
                finish_reason, usage}}, "error": null}
      {"id": "batch_req_…", "custom_id": ID, "response": null, "error": {"code": "500", "message": …}}

  The ids derive from the row id, so exporting twice gives identical files. `model` comes
  from the job manifest ("model", else the one model its servers served; null otherwise).
- ``jsonl``: one flat object per completed row, the result columns, with `messages` and
  `params` as the OpenAI request had them and `extra` (the input's other fields) decoded.
- ``sharegpt``: ``{"id", "conversations": [{"from": "system"|"human"|"gpt"|"tool", "value"}, …,
  the generated gpt turn]}``; an assistant turn keeps its `reasoning_content` and
  `tool_calls`, a tool turn its `tool_call_id`, the generated turn its `reasoning_content`
  and `tool_calls` when present;
  `tools` (from the stored params) goes at the top level.
- ``specforge``: what SpecForge's `scripts/regenerate_train_data.py` writes, so its training
  scripts take it as is: the input row's other fields, then ``"id"``, ``"conversations"``
  (``role``/``content`` messages, the generated answer last, ``reasoning_content`` on every
  assistant turn that has one) and ``"status": "success"``; ``tools`` at the top level when
  the row had them. SpecForge's conversation check takes only system (first), then user and
  assistant turns alternating, with non-empty text: a row with tool turns or content parts
  goes to ``<dest>_skipped.jsonl`` with ``"status": "skipped"`` and the ``"error"``, as
  SpecForge does with rows it cannot take.
- ``speculators``: the conversation file vLLM's speculators reads (`--train-data-path` of
  its `preprocess_data.py` / `data_generation_offline.py`): ``{"id", "conversations":
  [{"role", "content", "reasoning_content"?, "tool_calls"?, "tool_call_id"?}, …], "tools"?}``.

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

from fleet.generation.durable import fsync
from fleet.generation.jsonl import dumps, loads
from fleet.generation.manifest import read_manifest
from fleet.generation.results import iter_results, read_errors
from fleet.generation.schema import message_from_arrow, params_from_arrow

__all__ = ["export", "FORMATS"]

Format = Literal["openai-batch", "jsonl", "sharegpt", "specforge", "speculators"]
FORMATS: tuple[str, ...] = ("openai-batch", "jsonl", "sharegpt", "specforge", "speculators")

_SHAREGPT_FROM = {"system": "system", "user": "human", "assistant": "gpt", "tool": "tool"}


def _json(v: Any) -> Any:
    return loads(v) if isinstance(v, str | bytes) else v


def _messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    return [message_from_arrow(m) for m in row.get("messages") or []]


def _answer(row: dict[str, Any]) -> dict[str, Any]:
    """The generated turn as an OpenAI assistant message."""
    message: dict[str, Any] = {"role": "assistant", "content": row["completion"]}
    if row["reasoning_content"] is not None:
        message["reasoning_content"] = row["reasoning_content"]
    if row.get("tool_calls"):
        message["tool_calls"] = row["tool_calls"]
    return message


def _short(id: str) -> str:
    return hashlib.sha256(id.encode()).hexdigest()[:24]


def _openai_line(row: dict[str, Any], model: str | None) -> dict[str, Any]:
    message = _answer(row)
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
    out["messages"] = _messages(row)
    out["params"] = params_from_arrow(row.get("params"))
    out["extra"] = _json(row.get("extra"))
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
    for m in _messages(row):
        role = m.get("role")
        turn: dict[str, Any] = {"from": _SHAREGPT_FROM.get(role, role) if isinstance(role, str) else role,
                                "value": _text(m.get("content"))}
        if m.get("reasoning_content") is not None:   # earlier turns regenerated in all-turns mode
            turn["reasoning_content"] = m["reasoning_content"]
        if m.get("tool_calls"):
            turn["tool_calls"] = m["tool_calls"]
        if role == "tool" and m.get("tool_call_id"):
            turn["tool_call_id"] = m["tool_call_id"]
        turns.append(turn)
    gen: dict[str, Any] = {"from": "gpt", "value": row["completion"] or ""}
    if row["reasoning_content"] is not None:
        gen["reasoning_content"] = row["reasoning_content"]
    if row.get("tool_calls"):
        gen["tool_calls"] = row["tool_calls"]
    turns.append(gen)
    out: dict[str, Any] = {"id": row["id"], "conversations": turns}
    tools = _tools(row)
    if tools:
        out["tools"] = tools
    return out


def _tools(row: dict[str, Any]) -> Any:
    p = row.get("params")
    return _json(p.get("tools")) if p else None


def _role_content(m: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m["role"], "content": _text(m.get("content"))}
    for k in ("reasoning_content", "tool_calls", "tool_call_id"):
        if m.get(k):
            out[k] = m[k]
    return out


def _specforge_problem(conv: list[dict[str, Any]], raw: list[dict[str, Any]]) -> str | None:
    """Why SpecForge's conversation check would refuse `conv`, or None (its documented rules:
    system only before the first user turn, then user and assistant alternating, user and
    system text non-empty, assistant content a string)."""
    expected, saw_user = "user", False
    for i, (m, r) in enumerate(zip(conv, raw)):
        role = m["role"]
        if not isinstance(r.get("content", ""), str) and r.get("content") is not None:
            return f"message {i}: content parts (not text) cannot be expressed for SpecForge"
        if m.get("tool_calls") or role == "tool":
            return f"message {i}: tool calls and tool turns are not part of SpecForge's conversation format"
        if role != "assistant" and not m["content"].strip():
            return f"message {i} ({role}): empty content"
        if role == "system" and not saw_user:
            continue
        if role != expected:
            return f"message {i}: expected a {expected} turn, got {role}"
        saw_user = True
        expected = "assistant" if role == "user" else "user"
    return None if saw_user else "no user turn"


def _specforge_line(row: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    raw = _messages(row) + [_answer(row)]
    conv = [_role_content(m) for m in raw]
    out: dict[str, Any] = dict(_json(row.get("extra")) or {})
    out["id"] = row["id"]
    tools = _tools(row)
    if tools:
        out["tools"] = tools
    out["conversations"] = conv
    problem = _specforge_problem(conv, raw)
    if problem is not None:
        out["status"] = "skipped"
        out["error"] = problem
        return out, False
    out["status"] = "success"
    return out, True


def _speculators_line(row: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"id": row["id"],
                           "conversations": [_role_content(m) for m in _messages(row) + [_answer(row)]]}
    tools = _tools(row)
    if tools:
        out["tools"] = tools
    return out


def _model_name(out_dir: str | Path) -> str | None:
    """The served model, as the runner's manifest records it (top-level "model", else the servers')."""
    try:
        m = read_manifest(out_dir) or {}
    except (OSError, ValueError):
        return None
    model = m.get("model")
    if isinstance(model, str):
        return model
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
    convert: Callable[[dict[str, Any]], Any] = {
        "openai-batch": lambda r: _openai_line(r, model),
        "jsonl": _flat_line,
        "sharegpt": _sharegpt_line,
        "specforge": _specforge_line,
        "speculators": _speculators_line,
    }[fmt]
    with _Atomic(dest) as f, _Atomic(skipped_path(dest) if fmt == "specforge" else None, keep_empty=False) as skipped:
        n = 0
        for batch in iter_results(out_dir):
            lines, side = [], []
            for r in batch.to_pylist():
                rec = convert(r)
                if fmt == "specforge":
                    rec, ok = rec
                    if not ok:
                        side.append(dumps(rec) + b"\n")
                        continue
                lines.append(dumps(rec) + b"\n")
            f.write(b"".join(lines))
            n += len(lines)
            if side:
                skipped.write(b"".join(side))
        if fmt == "openai-batch":
            for rec in read_errors(out_dir):
                f.write(dumps(_openai_error_line(rec)) + b"\n")
                n += 1
    return n


def skipped_path(dest: str | Path) -> Path:
    """Where `specforge` puts rows SpecForge cannot take: DEST's name with `_skipped` before `.jsonl`."""
    dest = Path(dest)
    name = dest.name
    for suffix in (".jsonl.gz", ".jsonl", ".gz"):
        if name.endswith(suffix):
            return dest.with_name(name[: -len(suffix)] + "_skipped" + suffix)
    return dest.with_name(name + "_skipped")


class _Atomic:
    """A file written to DEST.tmp (gzip when DEST ends in .gz), fsync'd and renamed on success,
    removed on failure. `None` as DEST: writes go nowhere. Without `keep_empty`, a file that
    got nothing is not written (and an older one is removed: it would describe another export)."""

    def __init__(self, dest: Path | None, keep_empty: bool = True) -> None:
        self.dest = dest
        self.keep_empty = keep_empty

    def __enter__(self) -> Any:
        if self.dest is None:
            return self
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.dest.with_name(self.dest.name + ".tmp")
        self.raw = open(self.tmp, "wb")
        self.f = gzip.GzipFile(fileobj=self.raw, mode="wb", compresslevel=6) if self.dest.suffix == ".gz" else self.raw
        self.used = False
        return self

    def write(self, data: bytes) -> None:
        if self.dest is not None:
            self.used = True
            self.f.write(data)

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if self.dest is None:
            return
        try:
            if self.f is not self.raw:
                self.f.close()
            self.raw.close()
            if exc_type is None and (self.used or self.keep_empty):
                fsync(self.tmp)
                os.replace(self.tmp, self.dest)
                fsync(self.dest.parent)
            elif exc_type is None:
                self.dest.unlink(missing_ok=True)
        finally:
            self.tmp.unlink(missing_ok=True)
