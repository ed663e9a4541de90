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
  the generated gpt turn]}``; every other field of a message (`reasoning_content`, `tool_calls`,
  `tool_call_id`, `name`, a dataset's own) stays in its turn, the generated turn keeps its
  `reasoning_content` and `tool_calls` when present; `tools` (from the stored params) goes at the
  top level. A row ShareGPT cannot carry whole — content parts (its value is one string), a
  message field named `from` or `value` — goes to ``<dest>_skipped.jsonl`` with the turn and the
  reason ("turn 3 (user): content parts are not supported by --format sharegpt …; use --format
  jsonl or speculators"), never trimmed.
- ``specforge``: what SpecForge's `scripts/regenerate_train_data.py` writes, so its training
  scripts take it as is: the input row (its other fields, in the input's key order) with
  ``"conversations"`` replaced by the regenerated ``role``/``content`` messages
  (``reasoning_content`` on every assistant turn that has one, and any other field a message
  had: nothing is dropped) and ``"status": "success"``;
  ``tools`` at the top level when the row had them. Beside it, as SpecForge does
  (`fleet.generation.data.trainerfiles`): ``<dest>_error.jsonl`` (the input row of every failed or
  quality-rejected row, ``"status": "error"``, ``"error"``) and ``<dest>_skipped.jsonl`` (the
  input row of every input reject, and the generated row SpecForge's conversation check would
  refuse — tool turns, content parts, an empty answer — ``"status": "skipped"``, ``"error"``).
- ``speculators``: the conversation file vLLM speculators reads (`speculators prepare-data
  --data`, `load_raw_dataset`): the input row's other fields, ``"id"``, ``"conversations":
  [{"role", "content", "reasoning_content"?, "tool_calls"?, "tool_call_id"?, …}, …]``, ``"tools"?``;
  content as given (text or content parts), every field of every message kept.

- ``speculators-tokens``: speculators' pre-tokenized rows, as its `regenerate-responses` writes
  them, from the token ids the engine returned (`generation.return_token_ids`, vLLM's
  `return_token_ids`): one line per generated turn, ``{"id": "<id>_gen<j>", "primary_id",
  "input_ids": prompt as rendered + completion as sampled, "loss_mask": 0 … 0 1 … 1,
  "metadata"}``. The drafter learns the tokens the target sampled, not a re-tokenization of
  their text (which can differ). A row without token ids goes to ``<dest>_skipped.jsonl``.

**Flagged conversations** (`specforge`, `speculators`, `speculators-tokens`: the formats a trainer
reads as they are):
a row whose `flags` column holds a quality flag (a turn cut at max_tokens, a looping answer,
see `fleet.generation.data.gates`) is left out and written to ``<dest>_flagged.jsonl`` — the same
line plus ``"flags"`` — unless `keep_flagged` keeps it (True: every flag; a set: those flags).
The other formats keep every row (their consumers read the `flags` column, or not).
Side files that would be empty are not written (an older one is removed). The summary
(`ExportSummary`) goes into the job's manifest under ``exports`` (keyed by the destination).

**An export that would be empty fails** (`InputError`, `fleet export` exits 2) with the reason and
what to do — every row without token ids for ``speculators-tokens``, every row flagged, refused by
the format or none completed — instead of handing a trainer an empty file. The side files (where
the reasons are) are written; DEST is not (an older one is removed: it described another export).

The destination is written to DEST.tmp, fsync'd and renamed: a reader never sees half a
file. A destination ending in ``.gz`` is gzip-compressed.
"""

from __future__ import annotations

import gzip
import hashlib
import os
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from fleet.errors import InputError
from fleet.generation.data.durable import fsync
from fleet.generation.data.gates import GATES
from fleet.generation.data.jsonl import dumps, loads
from fleet.generation.data.manifest import read_manifest, write_manifest
from fleet.generation.data.results import iter_results, read_errors
from fleet.generation.data.schema import message_from_arrow, params_from_arrow
from fleet.generation.data.trainerfiles import handed_back, input_fields, side_lines
from fleet.generation.data.trainerrules import specforge_problem

__all__ = ["export", "ExportSummary", "FORMATS", "TRAINER_FORMATS", "side_path"]

Format = Literal["openai-batch", "jsonl", "sharegpt", "specforge", "speculators", "speculators-tokens"]
FORMATS: tuple[str, ...] = ("openai-batch", "jsonl", "sharegpt", "specforge", "speculators", "speculators-tokens")

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
    out["extra"] = input_fields(row)[0] or None
    return out


_SHAREGPT_OWN = ("from", "value")


def _sharegpt_line(row: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    """The row as ShareGPT turns, every field of every message kept beside from/value; a row
    ShareGPT cannot carry whole (content parts, a field named like its own keys) is refused
    with the turn and the reason, never trimmed."""
    turns: list[dict[str, Any]] = []
    for i, m in enumerate(_messages(row), 1):
        role = m.get("role")
        problem = _sharegpt_problem(m)
        if problem is not None:
            return [{"id": row["id"], "status": "skipped",
                     "error": f"turn {i} ({role}): {problem}; use --format jsonl or speculators"}], False
        turn: dict[str, Any] = {"from": _SHAREGPT_FROM.get(role, role) if isinstance(role, str) else role,
                                "value": m.get("content") or ""}
        turn.update((k, v) for k, v in m.items() if k not in ("role", "content"))
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
    return [out], True


def _sharegpt_problem(m: dict[str, Any]) -> str | None:
    if isinstance(m.get("content"), list):
        return "content parts are not supported by --format sharegpt (its value is one string)"
    clash = [k for k in _SHAREGPT_OWN if k in m]
    if clash:
        return f"the message's own field {clash[0]!r} would collide with ShareGPT's {clash[0]!r}"
    return None


def _tools(row: dict[str, Any]) -> Any:
    p = row.get("params")
    return _json(p.get("tools")) if p else None


def _role_content(m: dict[str, Any]) -> dict[str, Any]:
    """A message as a role/content turn: content as given (text, or content parts), "" when it
    has none (a tool-call turn), then every other field of it (nothing is dropped)."""
    content = m.get("content")
    out: dict[str, Any] = {"role": m["role"], "content": "" if content is None else content}
    out.update((k, v) for k, v in m.items() if k not in ("role", "content") and v is not None)
    return out


def _conversation(row: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The whole conversation, generated answer last: as role/content turns, and as stored."""
    raw = _messages(row) + [_answer(row)]
    return [_role_content(m) for m in raw], raw


def _specforge_line(row: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    conv, raw = _conversation(row)
    fields, order = input_fields(row)
    out = handed_back(fields, order, row["id"], conv, _tools(row))
    problem = specforge_problem(raw)
    if problem is not None:
        out["status"] = "skipped"
        out["error"] = f"SpecForge would refuse it: {problem}"
        return [out], False
    out["status"] = "success"
    return [out], True


def _speculators_line(row: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    fields, order = input_fields(row)
    return [handed_back(fields, order, row["id"], _conversation(row)[0], _tools(row))], True


NO_TOKEN_IDS = ("no token ids stored for this row: the engine returned none (set generation.return_token_ids = "
                "true, on an engine that honours it, e.g. vLLM)")


def _speculators_token_lines(row: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    """speculators' pre-tokenized rows, as its `regenerate-responses` writes them: one per generated
    turn, the prompt as the engine rendered it (loss_mask 0), then the tokens it sampled (1)."""
    turns = row.get("token_ids")
    if not turns:
        return [{"id": row["id"], "status": "skipped", "error": NO_TOKEN_IDS}], False
    out = []
    for j, t in enumerate(turns):
        prompt, completion = t["prompt"] or [], t["completion"] or []
        out.append({"id": f"{row['id']}_gen{j}", "primary_id": row["id"],
                    "input_ids": [*prompt, *completion], "loss_mask": [0] * len(prompt) + [1] * len(completion),
                    "metadata": {"turn": j + 1, "turns": len(turns), "server": row.get("server")}})
    return out, True


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


TRAINER_FORMATS: tuple[str, ...] = ("specforge", "speculators", "speculators-tokens")


@dataclass
class ExportSummary:
    """What one export wrote and left out."""

    format: str
    dest: str
    rows: int = 0                                   # lines in DEST (errors included for openai-batch; one per
                                                    # turn for speculators-tokens)
    flagged_left_out: int = 0                       # rows in DEST_flagged.jsonl
    left_out_by_flag: dict[str, int] = field(default_factory=dict)   # flag -> rows left out carrying it
    flagged_kept: int = 0                           # rows in DEST that carry a flag (kept on request)
    skipped: int = 0                                # rows in DEST_skipped.jsonl (trainer formats)
    errors: int = 0                                 # lines in DEST_error.jsonl (specforge)
    files: dict[str, str] = field(default_factory=dict)   # side file kind -> path (those written)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _left_out(flags: list[str] | None, keep: bool | frozenset[str]) -> bool:
    if not flags or keep is True:
        return False
    return keep is False or not set(flags) <= keep


def export(out_dir: str | Path, fmt: Format, dest: str | Path, *,
           keep_flagged: bool | Collection[str] = False, named: str | None = None) -> ExportSummary:
    """Write the job in `out_dir` to `dest` as `fmt` (see the module docstring). Streams shard by
    shard; every file is written atomically. `named`: where DEST really goes when `dest` is a
    temporary file put there afterwards (an object-storage URL): the summary and the manifest's
    record name it and its side files there."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    dest = Path(dest)
    if not (Path(out_dir) / "shards").is_dir():
        raise FileNotFoundError(f"{out_dir} holds no generation results (no shards/ directory)")
    keep: bool | frozenset[str] = keep_flagged if isinstance(keep_flagged, bool) else frozenset(keep_flagged)
    if not isinstance(keep, bool) and not keep <= set(GATES):
        raise ValueError(f"--keep-flagged: unknown flag(s) {', '.join(sorted(keep - set(GATES)))}; "
                         f"the flags are the quality gates: {', '.join(GATES)}")
    if fmt not in TRAINER_FORMATS:
        keep = True
    model = _model_name(out_dir) if fmt == "openai-batch" else None
    convert: Callable[[dict[str, Any]], tuple[list[dict[str, Any]], bool]] = {
        "openai-batch": lambda r: ([_openai_line(r, model)], True),
        "jsonl": lambda r: ([_flat_line(r)], True),
        "sharegpt": _sharegpt_line,
        "specforge": _specforge_line,
        "speculators": _speculators_line,
        "speculators-tokens": _speculators_token_lines,
    }[fmt]
    summary = ExportSummary(fmt, str(dest))
    trainer, spec = fmt in TRAINER_FORMATS, fmt == "specforge"
    # the side files this format has (only those: a jsonl export leaves a specforge one's alone)
    sides = {k: _Atomic(side_path(dest, k) if on else None, keep_empty=False)
             for k, on in (("flagged", trainer), ("skipped", trainer or fmt == "sharegpt"), ("error", spec))}
    with _Atomic(dest, keep_empty=False) as f, sides["flagged"] as flagged, sides["skipped"] as skipped, sides["error"] as error:
        for batch in iter_results(out_dir):
            for r in batch.to_pylist():
                recs, ok = convert(r)
                lines = b"".join(dumps(rec) + b"\n" for rec in recs)
                if not ok:
                    skipped.write(lines)
                    summary.skipped += 1
                elif _left_out(r.get("flags"), keep):
                    flagged.write(b"".join(dumps({**rec, "flags": r["flags"]}) + b"\n" for rec in recs))
                    summary.flagged_left_out += 1
                    for g in r["flags"]:
                        summary.left_out_by_flag[g] = summary.left_out_by_flag.get(g, 0) + 1
                else:
                    f.write(lines)
                    summary.rows += len(recs)
                    summary.flagged_kept += bool(r.get("flags")) and fmt in TRAINER_FORMATS
        _trailers(out_dir, fmt, f, error, skipped, summary)
    summary.files = {k: str(a.dest) for k, a in sides.items() if a.dest is not None and a.used}
    if named is not None:
        summary.dest = named
        summary.files = {k: f"{named.rpartition('/')[0]}/{Path(v).name}" for k, v in summary.files.items()}
    if summary.rows == 0:
        raise _empty(out_dir, fmt, summary)
    _record(out_dir, summary)
    return summary


def _empty(out_dir: str | Path, fmt: str, s: ExportSummary) -> InputError:
    """Why this export would write nothing, and what to do about it (one line)."""
    what = f"--format {fmt} of {out_dir} would write an empty file"
    skipped = f" -> {s.files['skipped']}" if "skipped" in s.files else ""
    if fmt == "speculators-tokens" and s.skipped:
        try:
            gen = ((read_manifest(out_dir) or {}).get("config") or {}).get("generation") or {}
        except (OSError, ValueError):
            gen = {}
        if gen.get("return_token_ids"):
            return InputError(f"{what}: the engine returned no token ids for any of its {s.skipped} row(s), although "
                              f"generation.return_token_ids was set{skipped}",
                              remedy="generate again with an engine that returns them (vLLM's return_token_ids), "
                                     "into a new --output; or export --format speculators (conversations, no ids)")
        # Completed rows are never sent again: --retry-errors re-sends only failed rows, and the same
        # --output refuses a changed generation setting (validate.decide), so only a new job has the ids.
        return InputError(f"{what}: its {s.skipped} row(s) have no token ids (the job ran without "
                          f"generation.return_token_ids){skipped}",
                          remedy="set generation.return_token_ids = true (an engine that honours it, e.g. vLLM) "
                                 "and generate into a new --output: this one's rows are done and keep no ids "
                                 "(--retry-errors re-sends failed rows only); or export --format speculators")
    if s.flagged_left_out and not s.skipped:
        return InputError(f"{what}: all {s.flagged_left_out} row(s) carry a quality flag "
                          f"({', '.join(sorted(s.left_out_by_flag))}) -> {s.files.get('flagged')}",
                          remedy="--keep-flagged [FLAG,...] keeps them, if they are fit to train on")
    if s.skipped or s.flagged_left_out:
        return InputError(f"{what}: {s.skipped} row(s) refused by the format{skipped}, "
                          f"{s.flagged_left_out} flagged", remedy=f"read the reasons in the skipped file; "
                          "--format jsonl keeps every field of every row")
    return InputError(f"{what}: the job holds no completed row", remedy="run the job (fleet generate) until rows "
                      "complete; errors.jsonl says why rows failed, and --retry-errors sends them again")


def _trailers(out_dir: str | Path, fmt: str, f: Any, error: Any, skipped: Any, summary: ExportSummary) -> None:
    """What follows the completed rows: openai-batch's error lines; specforge's error and skipped files."""
    if fmt == "openai-batch":
        for rec in read_errors(out_dir):
            f.write(dumps(_openai_error_line(rec)) + b"\n")
            summary.rows += 1
    elif fmt == "specforge":
        errors, rejects = side_lines(out_dir)
        for line in errors:
            error.write(dumps(line) + b"\n")
            summary.errors += 1
        for line in rejects:
            skipped.write(dumps(line) + b"\n")
            summary.skipped += 1


def _record(out_dir: str | Path, summary: ExportSummary) -> None:
    """Note the export in the job's manifest (`exports`, keyed by destination): what it left out."""
    try:
        m = read_manifest(out_dir)
    except (OSError, ValueError):
        return
    if m is None:
        return
    m.setdefault("exports", {})[summary.dest] = summary.as_dict()
    write_manifest(out_dir, m)


def side_path(dest: str | Path, kind: str) -> Path:
    """A side file of an export: DEST's name with `_KIND` before `.jsonl` (`train_flagged.jsonl`)."""
    dest = Path(dest)
    name = dest.name
    for suffix in (".jsonl.gz", ".jsonl", ".gz"):
        if name.endswith(suffix):
            return dest.with_name(name[: -len(suffix)] + f"_{kind}" + suffix)
    return dest.with_name(name + f"_{kind}")


class _Atomic:
    """A file written to DEST.tmp (gzip when DEST ends in .gz), fsync'd and renamed on success,
    removed on failure. `None` as DEST: writes go nowhere. Without `keep_empty`, a file that
    got nothing is not written (and an older one is removed: it would describe another export)."""

    def __init__(self, dest: Path | None, keep_empty: bool = True) -> None:
        self.dest = dest
        self.keep_empty = keep_empty
        self.used = False

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
