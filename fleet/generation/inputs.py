"""Input rows for generation: stream JSONL (plain or gzip) or Parquet into `Request`s and `Reject`s.

One row per line (JSONL) or per table row (Parquet), in any of three shapes, chosen per row:

    OpenAI Batch   {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": [...], "max_tokens": 512, ...}}
    simple         {"id": "r1", "messages": [...], "temperature": 0.7}      # params at top level
                   {"id": "r1", "messages": [...], "params": {"tools": [...]}}  # or under "params"
    ShareGPT       {"id": "r1", "conversations": [{"from": "human", "value": "..."},
                                                  {"from": "gpt", "value": "..."}]}

Rules (each one documented here because it decides what ends up generated):

- **Params.** Batch rows: everything in `body` except `messages`. Simple rows: the keys under
  `params`, plus known sampling/tool keys at the top level (`KNOWN_PARAMS`); any other
  top-level key is the caller's metadata and is ignored. ShareGPT rows: `params`, and a
  top-level `tools` (list or JSON string, LLaMA-Factory style) and `system`. `model`,
  `stream` and `stream_options` are always dropped (the dispatcher sets them); `n` must be
  1 (one completion per id). A null value means "not given". Then the config defaults
  (`max_tokens`, `temperature`, `top_p`, `seed`, `stop`, `chat_template_kwargs`) fill what the
  row does not set; `chat_template_kwargs` merge key by key, the row winning;
  `max_completion_tokens` in a row replaces the default `max_tokens`.
- **ShareGPT.** `from` maps human/user -> user, gpt/assistant/model/chatgpt -> assistant,
  system -> system, tool/observation/function_response -> tool, and function_call -> an
  assistant message with `tool_calls` (value: JSON `{"name", "arguments"}` or a list of them).
  A trailing assistant turn is dropped: it is the answer being regenerated (with
  `generation.regenerate = "all-turns"` it is kept: every assistant turn is regenerated,
  see `fleet.generation.work`, and the turn order is checked: the conversation may not open
  with an assistant turn nor hold two in a row).
- **Extra fields.** A row's other top-level keys (source, category, ...) are kept in
  `Request.extra` (the `extra` column), for exports that hand the input row back.
- **Limit.** `generation.limit = N` reads only the first N rows (blank lines not counted).
- **Ids.** `custom_id`, else `id` (a string, or an integer turned into its decimal string).
  A row without one gets `content_id(messages, row params)`: "h-" + the first 24 hex digits
  of the SHA-256 of the canonical JSON (sorted keys, no spaces, UTF-8) of the normalized
  messages and the row's *own* params (not the config defaults, so changing a default does
  not rename every row and break resume). Key order and input format do not change it.
- **Duplicates.** The first row with an id is the request; every later row with that id is
  a `Reject` "duplicate id (first at line N)". This holds even when the first row was
  itself rejected (the id stays taken) and even when the id is skipped as done: a duplicate
  is always reported, so nothing is dropped silently.
- **Rejects** (the job goes on): bad JSON or UTF-8, a row that is not an object, no/empty
  messages, a bad role, content of the wrong type, the last message from the assistant
  (nothing to generate), an id that is not a string/integer, a bad parameter type, an
  unsupported batch `url`/`method`. Each carries the 1-based line (JSONL, blank lines
  included in the numbering) or row number (Parquet) and the raw row (first 2,000 chars).
- **Blank lines** are skipped and counted (`InputStats.blank`), not rejected.
- **skip_ids** (resume): a request whose id it accepts is not yielded. Rejects are yielded on
  every pass (they are few and deterministic); `ResultStore.add_reject` ignores a line it
  already holds. Rows with an explicit id are checked before they are validated, so a done
  row is never validated again.
- **Planned resume.** When `skip_ids` is the store's done set (a `DigestSet`), a JSONL input is
  first *planned* (`plan_resume`): one pass reads only each row's id into flat arrays, then
  duplicates and done ids are found in bulk (pyarrow compute); a second pass reads and validates only
  the planned lines. Same output, decided by the same rules; at 902,087 rows half done the
  plan is known in about a second of CPU instead of after the whole one-pass read.

Memory: ids seen so far are kept as 8-byte digests in an open-addressing table with the
first line of each (`_SeenIds`, about 24 MB per million ids), never as strings; a planned
resume holds 12 bytes per row (digest and line) plus pyarrow's sort scratch while it plans.
"""

from __future__ import annotations

import gzip
import hashlib
import heapq
import json
import zlib
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, cast

from fleet.errors import InputError

if TYPE_CHECKING:
    from fleet.config import GenerationConfig

_loads: Callable[[bytes | str], Any]
try:  # several times faster than the stdlib on the read path; Prefect depends on it
    import orjson

    _loads = orjson.loads
except ImportError:  # pragma: no cover - depends on the environment
    _loads = json.loads

__all__ = [
    "Request", "Reject", "InputStats", "iter_input", "input_fingerprint", "count_rows", "content_id",
    "digest", "DUPLICATE_REASON", "KNOWN_PARAMS", "ROLES", "DigestSet", "ResumePlan", "plan_resume", "iter_planned",
]

ROLES = frozenset({"system", "user", "assistant", "tool"})

# Top-level keys of a simple row that are request parameters. Anything else at the top
# level is metadata (source, category, ...) and must not reach the server.
KNOWN_PARAMS = frozenset({
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
    "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "response_format",
    "chat_template_kwargs", "reasoning_effort", "separate_reasoning", "skip_special_tokens",
    "min_tokens", "ignore_eos", "regex", "ebnf", "json_schema", "n", "model", "stream", "stream_options",
})
_DROPPED_PARAMS = ("model", "stream", "stream_options", "n")
DUPLICATE_REASON = "duplicate id"  # every duplicate reject's reason starts with this
_RAW_MAX = 2000
_U64 = (1 << 64) - 1

_SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "model": "assistant", "chatgpt": "assistant",
    "bard": "assistant", "bing": "assistant",
    "system": "system",
    "tool": "tool", "observation": "tool", "function_response": "tool", "ipython": "tool",
    "function_call": "function_call",
}


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
    return hash(id) & _U64


class _SeenIds:
    """Ids seen so far -> the first line of each: open addressing over two flat arrays.

    About 24 bytes per id at the 50 % load ceiling (8-byte digest + 4-byte line, table
    doubled), against ~70 bytes per id for a Python set of ints and ~120 for a dict.
    """

    __slots__ = ("_keys", "_lines", "_mask", "_n")

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._keys = array("Q", bytes(8 * capacity))
        self._lines = array("I", bytes(4 * capacity))
        self._mask = capacity - 1
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def first_line(self, d: int, line: int) -> int:
        """Record digest `d` at `line` if new (returns 0), else return the line it was first seen at."""
        d = d or 1  # 0 marks an empty slot
        keys, mask = self._keys, self._mask
        i = d & mask
        while True:
            k = keys[i]
            if k == d:
                return self._lines[i]
            if k == 0:
                keys[i] = d
                self._lines[i] = line
                self._n += 1
                if self._n * 2 > mask:
                    self._grow()
                return 0
            i = (i + 1) & mask

    def _grow(self) -> None:
        old_keys, old_lines = self._keys, self._lines
        cap = (self._mask + 1) * 2
        keys = array("Q", bytes(8 * cap))
        lines = array("I", bytes(4 * cap))
        mask = cap - 1
        for k, ln in zip(old_keys, old_lines):
            if k:
                i = k & mask
                while keys[i]:
                    i = (i + 1) & mask
                keys[i] = k
                lines[i] = ln
        self._keys, self._lines, self._mask = keys, lines, mask


class _Bad(Exception):
    """A row that cannot be generated; `args[0]` is the reason."""


def content_id(messages: list[dict[str, Any]], params: dict[str, Any]) -> str:
    """Stable id of a row without one: h-<24 hex of sha256(canonical JSON of messages + params)>."""
    blob = json.dumps({"messages": messages, "params": params}, sort_keys=True,
                      separators=(",", ":"), ensure_ascii=False)
    return "h-" + hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()[:24]


# ---------------------------------------------------------------------------- validation


def _type(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _strip_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None} if None in d.values() else d


def _maybe_json(v: Any, what: str) -> Any:
    """Parquet (and some JSONL dumps) carry nested objects as JSON strings: decode those."""
    if isinstance(v, str | bytes):
        head = v.lstrip()[:1]
        if head not in ("[", "{", b"[", b"{"):
            raise _Bad(f"{what} must be a list or an object, got a plain string")
        try:
            return _loads(v)
        except ValueError as exc:
            raise _Bad(f"{what}: a string that is not valid JSON ({exc})") from None
    return v


def _check_content(content: Any, where: str) -> None:
    if isinstance(content, str):
        return
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("type"), str) for p in content):
        for j, p in enumerate(content):
            if None in p.values():
                content[j] = _strip_none(p)
        return
    raise _Bad(f"{where}: content must be a string or a list of content parts, got {_type(content)}")


def _check_tool_calls(tcs: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(tcs, list):
        raise _Bad(f"{where}: tool_calls must be a list, got {_type(tcs)}")
    out = []
    for j, tc in enumerate(tcs):
        if not isinstance(tc, dict):
            raise _Bad(f"{where}: tool_calls[{j}] is not an object")
        tc = _strip_none(tc)
        fn = tc.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _Bad(f"{where}: tool_calls[{j}] needs function.name (a string)")
        fn = _strip_none(fn)
        args = fn.get("arguments")
        if args is not None and not isinstance(args, str | dict):
            raise _Bad(f"{where}: tool_calls[{j}].function.arguments must be a string or an object")
        tc["function"] = fn
        out.append(tc)
    return out


def _check_messages(msgs: Any, all_turns: bool = False) -> list[dict[str, Any]]:
    """Validate OpenAI chat messages in place (nulls removed); raise _Bad with the first problem.

    `all_turns` (generation.regenerate = "all-turns"): every assistant turn is generated
    again, so the conversation may end with one, but each must answer a user or tool turn.
    """
    if not isinstance(msgs, list):
        raise _Bad(f"messages must be a list, got {_type(msgs)}")
    if not msgs:
        raise _Bad("empty messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _Bad(f"messages[{i}] is not an object (got {_type(m)})")
        if None in m.values():
            m = msgs[i] = _strip_none(m)
        role = m.get("role")
        if role not in ROLES:
            raise _Bad(f"messages[{i}]: bad role {role!r} (expected system, user, assistant or tool)")
        where = f"messages[{i}] ({role})"
        content = m.get("content")
        if role == "assistant":
            tcs = m.get("tool_calls")
            if tcs is not None:
                m["tool_calls"] = _check_tool_calls(tcs, where)
            if content is None and not tcs:
                raise _Bad(f"{where}: neither content nor tool_calls")
        elif content is None:
            raise _Bad(f"{where}: no content")
        if content is not None:
            _check_content(content, where)
        if role == "tool" and not isinstance(m.get("tool_call_id", ""), str):
            raise _Bad(f"{where}: tool_call_id must be a string")
    if all_turns:
        _check_turn_order(msgs)
    elif msgs[-1]["role"] == "assistant":
        raise _Bad("last message is from the assistant: nothing to generate")
    return msgs


def _check_turn_order(msgs: list[dict[str, Any]]) -> None:
    """All-turns mode: an assistant turn to regenerate needs a user/tool turn before it."""
    prev = None
    for i, m in enumerate(msgs):
        role = m["role"]
        if role == "assistant" and not m.get("tool_calls"):
            if prev is None or prev == "system":
                raise _Bad(f"messages[{i}]: the conversation starts with an assistant turn (nothing to answer)")
            if prev == "assistant":
                raise _Bad(f"messages[{i}]: two assistant turns in a row (turn order user, assistant, user, ...)")
        prev = role
    if msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls"):
        raise _Bad("the conversation ends with an assistant tool call and no tool result: nothing to generate")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _number(k: str, v: Any) -> None:
    if not _is_num(v):
        raise _Bad(f"{k} must be a number, got {v!r}")


def _string(k: str, v: Any) -> None:
    if not isinstance(v, str):
        raise _Bad(f"{k} must be a string, got {_type(v)}")


def _positive_int(k: str, v: Any) -> None:
    if not (_is_int(v) and v >= 1):
        raise _Bad(f"{k} must be a positive integer, got {v!r}")


def _temperature(k: str, v: Any) -> None:
    if not (_is_num(v) and v >= 0):
        raise _Bad(f"temperature must be a number >= 0, got {v!r}")


def _top_p(k: str, v: Any) -> None:
    if not (_is_num(v) and 0 < v <= 1):
        raise _Bad(f"top_p must be a number in (0, 1], got {v!r}")


def _integer(k: str, v: Any) -> None:
    if not _is_int(v) or not -(1 << 63) <= v < (1 << 63):
        raise _Bad(f"{k} must be a 64-bit integer, got {v!r}")


def _stop(k: str, v: Any) -> None:
    if not (isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))):
        raise _Bad(f"stop must be a string or a list of strings, got {_type(v)}")


def _tools(k: str, v: Any) -> None:
    if not (isinstance(v, list) and all(isinstance(t, dict) for t in v)):
        raise _Bad(f"tools must be a list of objects, got {_type(v)}")


def _object(k: str, v: Any) -> None:
    if not isinstance(v, dict):
        raise _Bad(f"{k} must be an object, got {_type(v)}")


def _n(k: str, v: Any) -> None:
    if v != 1:
        raise _Bad(f"n={v!r} is not supported: one completion per id")


# Types a server would refuse anyway: refusing them here puts the row in rejects with its
# line, instead of costing a request and landing in errors.
_PARAM_CHECKS = {
    "max_tokens": _positive_int, "max_completion_tokens": _positive_int, "temperature": _temperature,
    "top_p": _top_p, "seed": _integer, "stop": _stop, "tools": _tools, "chat_template_kwargs": _object, "n": _n,
    "top_k": _integer, "min_p": _number, "presence_penalty": _number, "frequency_penalty": _number,
    "repetition_penalty": _number, "reasoning_effort": _string,
}
_DROPPED = frozenset(_DROPPED_PARAMS)


def _check_params(p: dict[str, Any]) -> dict[str, Any]:
    """Drop what the dispatcher owns (model, stream, n) and check the types of known params."""
    if not p:
        return p
    if None in p.values():
        p = _strip_none(p)
    checks = _PARAM_CHECKS
    for k, v in p.items():
        chk = checks.get(k)
        if chk is not None:
            chk(k, v)
    if not _DROPPED.isdisjoint(p):
        for k in _DROPPED_PARAMS:
            p.pop(k, None)
    return p


def _row_id(row: dict[str, Any], keys: tuple[str, ...]) -> str | None:
    for k in keys:
        v = row.get(k)
        if v is None:
            continue
        if isinstance(v, str):
            if not v:
                raise _Bad(f"empty {k}")
            return v
        if _is_int(v):
            return str(v)
        raise _Bad(f"{k} must be a string or an integer, got {_type(v)}")
    return None


# ---------------------------------------------------------------------------- row shapes


_Shape = tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any] | None]


def _extra(row: dict[str, Any], used: frozenset[str]) -> dict[str, Any] | None:
    extra = {k: v for k, v in row.items() if k not in used}
    return extra or None


_BATCH_KEYS = frozenset({"custom_id", "id", "method", "url", "body"})
_SIMPLE_KEYS = frozenset({"custom_id", "id", "messages", "params"}) | KNOWN_PARAMS
_SHAREGPT_KEYS = frozenset({"custom_id", "id", "conversations", "params", "tools", "system"})


def _batch_row(row: dict[str, Any], all_turns: bool) -> _Shape:
    url = row.get("url")
    if url is not None and url not in ("/v1/chat/completions", "/chat/completions", "v1/chat/completions"):
        raise _Bad(f"unsupported url {url!r}: only /v1/chat/completions")
    method = row.get("method")
    if method is not None and str(method).upper() != "POST":
        raise _Bad(f"unsupported method {method!r}: only POST")
    body = _maybe_json(row["body"], "body")
    if not isinstance(body, dict):
        raise _Bad(f"body must be an object, got {_type(body)}")
    if body.get("messages") is None:
        raise _Bad("no messages in body")
    msgs = _maybe_json(body["messages"], "body.messages")
    params = {k: v for k, v in body.items() if k != "messages"}
    return _check_messages(msgs, all_turns), _check_params(params), _extra(row, _BATCH_KEYS)


def _row_params(row: dict[str, Any]) -> dict[str, Any]:
    extra = row.get("params")
    if extra is None:
        return {}
    extra = _maybe_json(extra, "params")
    if not isinstance(extra, dict):
        raise _Bad(f"params must be an object, got {_type(extra)}")
    return dict(extra)


def _simple_row(row: dict[str, Any], all_turns: bool) -> _Shape:
    msgs = _maybe_json(row["messages"], "messages")
    params = {k: v for k, v in row.items() if k in KNOWN_PARAMS}
    params.update(_row_params(row))
    return _check_messages(msgs, all_turns), _check_params(params), _extra(row, _SIMPLE_KEYS)


def _function_calls(value: Any, where: str, turn: int) -> list[dict[str, Any]]:
    calls = _maybe_json(value, f"{where} (function_call)")
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not calls:
        raise _Bad(f"{where}: a function_call value must be a JSON object or list of objects")
    out = []
    for k, c in enumerate(calls):
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            raise _Bad(f"{where}: each function call needs a string 'name'")
        args = c.get("arguments", c.get("parameters", {}))
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        # Deterministic ids: the content id of the row must not change between runs.
        out.append({"id": f"call_{turn}_{k}", "type": "function", "function": {"name": c["name"], "arguments": args}})
    return out


def _sharegpt_row(row: dict[str, Any], all_turns: bool) -> _Shape:
    conv = _maybe_json(row["conversations"], "conversations")
    if not isinstance(conv, list):
        raise _Bad(f"conversations must be a list, got {_type(conv)}")
    params = _row_params(row)
    tools = row.get("tools")
    if tools is not None and tools != "" and "tools" not in params:
        params["tools"] = _maybe_json(tools, "tools")
    msgs: list[dict[str, Any]] = []
    system = row.get("system")
    if isinstance(system, str) and system:
        msgs.append({"role": "system", "content": system})
    pending: list[str] = []  # tool call ids waiting for their observations
    for i, turn in enumerate(conv):
        where = f"conversations[{i}]"
        if not isinstance(turn, dict):
            raise _Bad(f"{where} is not an object (got {_type(turn)})")
        src = turn.get("from", turn.get("role"))
        value = turn.get("value", turn.get("content"))
        role = _SHAREGPT_ROLES.get(src.lower()) if isinstance(src, str) else None
        if role is None:
            raise _Bad(f"{where}: bad role {src!r} (expected human, gpt, system, tool, function_call or observation)")
        if role == "function_call":
            calls = _function_calls(value, where, i)
            pending = [c["id"] for c in calls]
            msgs.append({"role": "assistant", "content": "", "tool_calls": calls})
            continue
        if not isinstance(value, str):
            raise _Bad(f"{where} ({src}): value must be a string, got {_type(value)}")
        msg: dict[str, Any] = {"role": role, "content": value}
        if role == "tool" and pending:
            msg["tool_call_id"] = pending.pop(0)
        msgs.append(msg)
    if msgs and msgs[-1]["role"] == "assistant" and not all_turns:
        msgs.pop()  # the answer we regenerate
    if not msgs:
        raise _Bad("empty conversations")
    return _check_messages(msgs, all_turns), _check_params(params), _extra(row, _SHAREGPT_KEYS)


def _shape(row: dict[str, Any], all_turns: bool = False) -> _Shape:
    if row.get("body") is not None:
        return _batch_row(row, all_turns)
    if row.get("messages") is not None:
        return _simple_row(row, all_turns)
    if row.get("conversations") is not None:
        return _sharegpt_row(row, all_turns)
    raise _Bad("no messages: expected 'messages', 'body.messages' or 'conversations'")


def _defaults(cfg: GenerationConfig | None) -> dict[str, Any]:
    if cfg is None:
        from fleet.config import GenerationConfig

        cfg = GenerationConfig()
    d: dict[str, Any] = {"max_tokens": cfg.max_tokens, "temperature": cfg.temperature}
    for k in ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed",
              "stop", "chat_template_kwargs"):
        v = getattr(cfg, k)
        if v is not None:
            d[k] = v
    return d


def _apply_defaults(defaults: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    params = dict(defaults)
    if "max_completion_tokens" in own:
        params.pop("max_tokens", None)
    for k in ("stop", "chat_template_kwargs"):  # never share a mutable default between rows
        if k in params:
            params[k] = type(params[k])(params[k])
    params.update(own)
    dct, oct_ = defaults.get("chat_template_kwargs"), own.get("chat_template_kwargs")
    if dct and oct_ is not None:
        params["chat_template_kwargs"] = {**dct, **oct_}
    return params


# ---------------------------------------------------------------------------- sources


_INPUT_REMEDY = "pass an existing --input file (JSONL, JSONL.gz or Parquet)"


def _magic(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(4)
    except FileNotFoundError:
        raise InputError(f"input file {path} not found", remedy=_INPUT_REMEDY) from None
    except IsADirectoryError:
        raise InputError(f"input {path} is a directory",
                         remedy="pass one file (JSONL, JSONL.gz or Parquet); concatenate several first") from None
    except PermissionError:
        raise InputError(f"input {path} is not readable (permission denied)",
                         remedy="make it readable by the user fleet runs as, or copy it somewhere readable") from None
    except OSError as exc:
        raise InputError(f"input {path} cannot be opened: {exc.strerror or exc}", remedy=_INPUT_REMEDY) from None


def _is_parquet(path: Path) -> bool:
    return path.suffix.lower() in (".parquet", ".pq") or _magic(path) == b"PAR1"


def _open_text(path: Path) -> gzip.GzipFile | BinaryIO:
    if _magic(path)[:2] == b"\x1f\x8b":
        return gzip.open(path, "rb")
    return open(path, "rb", buffering=1 << 20)


# A truncated or corrupt .gz fails mid-stream with these; a disk/NFS read error with OSError.
_READ_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile, OSError)


def _corrupt(path: Path, exc: BaseException, line: int, offset: int, raw_pos: int | None) -> InputError:
    gz = raw_pos is not None
    at = (f"after line {line:,} (reading stopped at byte {offset:,} of the decompressed text, about byte "
          f"{raw_pos:,} of the file)" if gz else f"after line {line:,} (reading stopped at byte {offset:,})")
    what = "is corrupt or truncated" if isinstance(exc, (EOFError, zlib.error, gzip.BadGzipFile)) else "could not be read"
    return InputError(f"input {path} {what} {at}: {type(exc).__name__}: {exc}",
                      remedy="the rows before that point are kept; replace the file with a complete copy "
                             "(`gzip -t` checks one), then run the same command: the rows done are skipped")


def _lines(path: Path) -> Iterator[bytes]:
    """The file's lines (gzip transparently); a corrupt/truncated stream raises InputError with its offset."""
    f = _open_text(path)
    raw = getattr(f, "fileobj", None)   # GzipFile: the compressed file, for the byte position
    n = 0
    with f:
        try:
            for line in f:   # one try around the loop: no per-line cost on the hot path
                n += 1
                yield line
        except _READ_ERRORS as exc:
            pos = None
            if raw is not None:
                try:
                    pos = raw.tell()
                except (OSError, ValueError):
                    pos = 0
            try:
                offset = f.tell()   # the logical (decompressed) position reached
            except (OSError, ValueError):
                offset = 0
            raise _corrupt(path, exc, n, offset, pos) from exc


def _raw(row: Any) -> str:
    if isinstance(row, bytes):
        return row.decode("utf-8", "replace").rstrip("\r\n")[:_RAW_MAX]
    try:
        return json.dumps(row, ensure_ascii=False, default=str)[:_RAW_MAX]
    except (TypeError, ValueError):
        return repr(row)[:_RAW_MAX]


def _jsonl_rows(path: Path, stats: InputStats) -> Iterator[tuple[int, Any, bytes | None]]:
    """(line, parsed object or _Bad, raw bytes); blank lines counted, not yielded."""
    for n, line in enumerate(_lines(path), 1):
        if n == 1 and line.startswith(b"\xef\xbb\xbf"):
            line = line[3:]
        try:
            obj = _loads(line)
        except ValueError as exc:
            if not line.strip():
                stats.blank += 1
                continue
            reason = "not UTF-8" if isinstance(exc, UnicodeDecodeError) or "utf-8" in str(exc).lower() \
                else f"bad JSON: {exc}"
            yield n, _Bad(reason), line
            continue
        yield n, obj, line


def _parquet_file(path: Path) -> Any:
    import pyarrow.parquet as pq

    _magic(path)   # missing / directory / unreadable: the same clear errors as JSONL
    try:
        return pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a corrupt or truncated footer
        raise InputError(f"input {path} is not a readable Parquet file (corrupt or truncated footer): "
                         f"{type(exc).__name__}: {exc}",
                         remedy="replace it with a complete copy (pyarrow.parquet.ParquetFile must open it), "
                                "or give JSONL") from exc


def _parquet_rows(path: Path, stats: InputStats, batch_rows: int = 2048) -> Iterator[tuple[int, Any, None]]:
    pf = _parquet_file(path)
    n = 0
    batches = pf.iter_batches(batch_size=batch_rows)
    while True:
        try:
            batch = next(batches, None)
            rows = batch.to_pylist() if batch is not None else None
        except Exception as exc:  # a corrupt page: ArrowInvalid / OSError from pyarrow
            raise InputError(f"input {path} is corrupt after row {n:,} (of {pf.metadata.num_rows:,} in its footer): "
                             f"{type(exc).__name__}: {exc}",
                             remedy="the rows before it are kept; replace the file with a complete copy, then "
                                    "run the same command: the rows done are skipped") from exc
        if rows is None:
            return
        for row in rows:
            n += 1
            yield n, _strip_none(row), None


def iter_input(
    path: str | Path,
    defaults: GenerationConfig | None,
    *,
    skip_ids: Callable[[str], bool] | None = None,
    stats: InputStats | None = None,
    plan: bool = True,
) -> Iterator[Request | Reject]:
    """Stream `path` (JSONL, JSONL.gz or Parquet) as Requests and Rejects, in input order.

    Never holds more than one Parquet batch or one line of text; see the module docstring for
    every rule. `stats`, when given, is filled in as the rows go by.

    A resume of a JSONL input whose `skip_ids` is a non-empty `DigestSet`'s `__contains__` (the
    store's `done_ids()`) is planned first (`plan_resume`: the ids only, then the planned lines
    are read again and validated); `plan=False` keeps the one-pass reader. Both yield the same.
    """
    path = Path(path)
    st = stats if stats is not None else InputStats()
    done = _digest_set(skip_ids)
    if plan and done is not None and len(done) and not _is_parquet(path):
        yield from iter_planned(path, defaults, plan_resume(path, defaults, done), st)
        return
    dflt = _defaults(defaults)
    all_turns = defaults is not None and defaults.regenerate == "all-turns"
    limit = defaults.limit if defaults is not None else None
    seen = _SeenIds()
    rows = _parquet_rows(path, st) if _is_parquet(path) else _jsonl_rows(path, st)  # InputError: no such file, a directory
    for line, obj, raw in rows:
        if limit is not None and st.rows >= limit:
            break
        st.rows += 1
        rid: str | None = None
        try:
            if isinstance(obj, _Bad):
                raise obj
            if not isinstance(obj, dict):
                raise _Bad(f"row is not a JSON object (got {_type(obj)})")
            rid = _row_id(obj, ("custom_id", "id"))
            if rid is not None:
                first = seen.first_line(digest(rid), line)
                if first:
                    st.duplicates += 1
                    raise _Bad(f"{DUPLICATE_REASON} (first at line {first})")
                if skip_ids is not None and skip_ids(rid):
                    st.skipped += 1
                    continue
            msgs, own, extra = _shape(obj, all_turns)
            if rid is None:
                rid = content_id(msgs, own)
                first = seen.first_line(digest(rid), line)
                if first:
                    st.duplicates += 1
                    raise _Bad(f"{DUPLICATE_REASON} (first at line {first})")
                if skip_ids is not None and skip_ids(rid):
                    st.skipped += 1
                    continue
        except _Bad as bad:
            st.rejects += 1
            yield Reject(line=line, id=rid, reason=str(bad.args[0]), raw=_raw(raw if raw is not None else obj))
            continue
        except RecursionError:
            st.rejects += 1
            yield Reject(line=line, id=rid, reason="row nested too deeply", raw=_raw(raw if raw is not None else obj))
            continue
        st.requests += 1
        yield Request(id=rid, line=line, messages=msgs, params=_apply_defaults(dflt, own), extra=extra)



# ---------------------------------------------------------------------------- resume planning


class DigestSet(Protocol):
    """A set of done ids that answers for many digests at once (`store.IdSet`)."""

    def __len__(self) -> int: ...

    def __contains__(self, id: object) -> bool: ...

    def has_digests(self, digests: Any, memory_pool: Any = None) -> Any:
        """A pyarrow UInt64Array of digests -> a BooleanArray: which are in the set."""


def _digest_set(skip_ids: Callable[[str], bool] | None) -> DigestSet | None:
    """The done set behind `skip_ids` when it is exactly a DigestSet's `__contains__`, else None."""
    owner = getattr(skip_ids, "__self__", None)
    if owner is None or not hasattr(owner, "has_digests"):
        return None
    if getattr(skip_ids, "__func__", None) is not getattr(type(owner), "__contains__", None):
        return None
    return cast(DigestSet, owner)


@dataclass(slots=True)
class ResumePlan:
    """What a resume still has to read, decided from the ids alone (`plan_resume`)."""

    rows: int                       # non-blank rows planned (after generation.limit)
    blank: int
    skipped: int                    # rows whose id is done: never read again
    duplicates: int                 # later rows with an id seen before
    visit: array[int]               # lines to read again, ascending: rows to run and rows to reject
    rejects: dict[int, str]         # line -> reason, decided without validation (bad JSON, bad id, ...)
    first_at: dict[int, int]        # line of a duplicate -> the line its id was first seen at
    error: InputError | None = None  # the input breaks after the planned lines: raised after them

    @property
    def remaining(self) -> int:
        """Lines still to read: requests to run plus rejects to record."""
        return len(self.visit)


def _bad_json_reason(exc: ValueError) -> str:
    return "not UTF-8" if isinstance(exc, UnicodeDecodeError) or "utf-8" in str(exc).lower() else f"bad JSON: {exc}"


def plan_resume(path: str | Path, defaults: GenerationConfig | None, done: DigestSet) -> ResumePlan:
    """Plan a resume of a JSONL input: which lines are still to run, from each row's id only.

    One pass that parses each line but reads only its id (`custom_id`/`id`; a row without one
    gets its content id, which needs the row validated): the ids' 64-bit digests and lines go
    into two flat arrays (12 bytes per row), then duplicates (first line wins) and the done ids
    are found in bulk, in C (pyarrow compute: hash lookups; a stable sort by digest only when an
    id repeats). Every rule of `iter_input` holds: a duplicate of a
    done id is still a reject, a done row is never validated, a bad line is a reject on every
    pass. A corrupt or truncated input plans the rows before the break and keeps the error.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    path = Path(path)
    all_turns = defaults is not None and defaults.regenerate == "all-turns"
    limit = defaults.limit if defaults is not None else None
    digests, where = array("Q"), array("I")
    rejects: dict[int, str] = {}
    loads, add_digest, add_line = _loads, digests.append, where.append
    n = blank = 0
    error: InputError | None = None
    try:
        for n, line in enumerate(_lines(path), 1):
            try:
                obj = loads(line)
            except ValueError:
                obj = None
            if type(obj) is dict:   # the hot path: a row with a string id
                rid = obj.get("custom_id")
                if rid is None:
                    rid = obj.get("id")
                if type(rid) is str and rid:
                    if limit is not None and n - blank > limit:
                        n -= 1
                        break
                    add_digest(hash(rid) & _U64)   # = digest(rid), inlined
                    add_line(n)
                    continue
            if n == 1 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]
            try:
                obj = loads(line)
            except ValueError as exc:
                if not line.strip():
                    blank += 1
                    continue
                obj = _Bad(_bad_json_reason(exc))
            if limit is not None and n - blank > limit:
                n -= 1
                break
            try:
                if isinstance(obj, _Bad):
                    raise obj
                if not isinstance(obj, dict):
                    raise _Bad(f"row is not a JSON object (got {_type(obj)})")
                rid = _row_id(obj, ("custom_id", "id"))
                if rid is None:
                    rid = content_id(*_shape(obj, all_turns)[:2])
            except _Bad as bad:
                rejects[n] = str(bad.args[0])
                continue
            except RecursionError:
                rejects[n] = "row nested too deeply"
                continue
            add_digest(digest(rid))
            add_line(n)
    except InputError as exc:
        error = exc
    rows = n - blank
    first_at: dict[int, int] = {}
    pool = pa.system_memory_pool()   # freed at once (the default pool keeps its scratch for the process)
    d = pa.Array.from_buffers(pa.uint64(), len(digests), [None, pa.py_buffer(digests)])
    w = pa.Array.from_buffers(pa.uint32(), len(where), [None, pa.py_buffer(where)])
    if len(d) > 1:   # duplicates, each with its first line: neighbours after a sort by digest
        # (a sort, not count_distinct: its hash table peaks at ~120 MB per million ids)
        order = pc.sort_indices(d, memory_pool=pool)   # a stable sort: within one id, lines stay ascending
        sd = pc.take(d, order, memory_pool=pool)
        same = pc.equal(sd.slice(1), sd.slice(0, len(sd) - 1), memory_pool=pool)
        if pc.any(same).as_py():
            sw = pc.take(w, order, memory_pool=pool)
            for pos in pc.indices_nonzero(same).to_pylist():   # few: walked in Python
                first = pos
                while first > 0 and same[first - 1].as_py():
                    first -= 1
                first_at[sw[pos + 1].as_py()] = sw[first].as_py()
    skipped = 0
    todo = w
    if len(done) and len(d):
        skip = done.has_digests(d, pool)
        if first_at:   # a duplicate of a done id is still a reject
            skip = pc.and_(skip, pc.invert(pc.is_in(w, value_set=pa.array(list(first_at), pa.uint32()), memory_pool=pool),
                                               memory_pool=pool), memory_pool=pool)
        skipped = int(pc.sum(skip).as_py() or 0)
        todo = pc.filter(w, pc.invert(skip, memory_pool=pool), memory_pool=pool)   # still in input order
    visit = array("I")
    if len(todo):
        visit.frombytes(memoryview(todo.buffers()[1])[4 * todo.offset: 4 * (todo.offset + len(todo))])
    if rejects:
        visit = array("I", heapq.merge(visit, sorted(rejects)))
    return ResumePlan(rows=rows, blank=blank, skipped=skipped, duplicates=len(first_at), visit=visit,
                      rejects=rejects, first_at=first_at, error=error)


def iter_planned(path: Path, defaults: GenerationConfig | None, plan: ResumePlan,
                  st: InputStats) -> Iterator[Request | Reject]:
    """The second pass of a planned resume: read only the planned lines, in order."""
    dflt = _defaults(defaults)
    all_turns = defaults is not None and defaults.regenerate == "all-turns"
    st.rows += plan.rows
    st.blank += plan.blank
    st.skipped += plan.skipped
    st.duplicates += plan.duplicates
    todo = iter(plan.visit.tolist())
    want = next(todo, 0)
    if want:
        for n, line in enumerate(_lines(path), 1):
            if n != want:
                continue
            want = next(todo, 0)
            if n == 1 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]
            reason = plan.rejects.get(n)
            if reason is not None:
                st.rejects += 1
                yield Reject(line=n, id=None, reason=reason, raw=_raw(line))
            else:
                item = _planned_row(n, line, plan.first_at.get(n), dflt, all_turns)
                if isinstance(item, Reject):
                    st.rejects += 1
                else:
                    st.requests += 1
                yield item
            if not want:
                break
    if plan.error is not None:
        raise plan.error


def _planned_row(n: int, line: bytes, first: int | None, dflt: dict[str, Any], all_turns: bool) -> Request | Reject:
    """One planned line: a request, a reject from validation, or a duplicate (`first`: its first line)."""
    rid: str | None = None
    try:
        obj = _loads(line)
        rid = _row_id(obj, ("custom_id", "id"))
        if rid is not None and first is not None:
            raise _Bad(f"{DUPLICATE_REASON} (first at line {first})")
        msgs, own, extra = _shape(obj, all_turns)
        if rid is None:
            rid = content_id(msgs, own)
            if first is not None:
                raise _Bad(f"{DUPLICATE_REASON} (first at line {first})")
    except _Bad as bad:
        return Reject(line=n, id=rid, reason=str(bad.args[0]), raw=_raw(line))
    except RecursionError:
        return Reject(line=n, id=rid, reason="row nested too deeply", raw=_raw(line))
    return Request(id=rid, line=n, messages=msgs, params=_apply_defaults(dflt, own), extra=extra)


def input_fingerprint(path: str | Path) -> str:
    """SHA-256 (hex) of the file's bytes, streamed: the identity of an input in job.json and the manifest."""
    h = hashlib.sha256()
    _magic(Path(path))  # a clear error for a missing file
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def count_rows(path: str | Path) -> int:
    """Rows in the input: non-blank lines (JSONL) or the row count in the Parquet footer.

    A corrupt or truncated file raises InputError naming the line and byte where it breaks."""
    path = Path(path)
    if _is_parquet(path):
        return int(_parquet_file(path).metadata.num_rows)
    n = 0
    for line in _lines(path):
        if not line.isspace():
            n += 1
    return n
