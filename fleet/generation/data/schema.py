"""The Arrow schema of a result row (`RESULT_SCHEMA`), and the conversion of a row's values
to it (`CONVERTERS`, `message_to_arrow`, `params_to_arrow`) and back (`message_from_arrow`,
`params_from_arrow`).


Nested types, so pandas, Polars and `datasets` read conversations without json.loads.
What stays a JSON string, and why: a tool call's `arguments` (the OpenAI wire format is a
string, and arguments differ per tool), a tool's JSON-schema `parameters` (`params.tools`),
`chat_template_kwargs`, and anything without a fixed shape (`extra` fields, content
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa

from fleet.generation.data.jsonl import dumps, loads

__all__ = [
    "RESULT_COLUMNS", "RESULT_SCHEMA", "MESSAGE_TYPE", "TOOL_CALL_TYPE", "PARAMS_TYPE", "COLUMN_SET", "CONVERTERS",
    "STATS_COLUMNS",
    "DICT_COLUMNS", "NESTED_COLUMNS", "message_to_arrow", "message_from_arrow", "params_to_arrow",
    "params_from_arrow", "tool_call_to_arrow", "upgrade_column",
]

# parts): one Parquet column has one type, and these differ from row to row.
TOOL_CALL_TYPE = pa.struct([
    pa.field("id", pa.string()), pa.field("type", pa.string()),
    pa.field("function", pa.struct([pa.field("name", pa.string()), pa.field("arguments", pa.string())])),
])
MESSAGE_TYPE = pa.struct([
    pa.field("role", pa.string()),
    pa.field("content", pa.string()),            # null when the content is a list of parts
    pa.field("content_parts", pa.string()),      # JSON list of content parts (multimodal), else null
    pa.field("reasoning_content", pa.string()),  # regenerated earlier turns keep their reasoning
    pa.field("tool_calls", pa.list_(TOOL_CALL_TYPE)),
    pa.field("tool_call_id", pa.string()),
    pa.field("name", pa.string()),
    pa.field("extra", pa.string()),              # JSON object of any other keys of the message
])
_PARAM_FIELDS = [
    ("max_tokens", pa.int64()), ("max_completion_tokens", pa.int64()), ("temperature", pa.float64()),
    ("top_p", pa.float64()), ("top_k", pa.int64()), ("min_p", pa.float64()),
    ("presence_penalty", pa.float64()), ("frequency_penalty", pa.float64()), ("repetition_penalty", pa.float64()),
    ("seed", pa.int64()), ("stop", pa.list_(pa.string())), ("reasoning_effort", pa.string()),
]
TOKEN_TURN_TYPE = pa.struct([pa.field("prompt", pa.list_(pa.int32())), pa.field("completion", pa.list_(pa.int32()))])
PARAMS_TYPE = pa.struct([pa.field(k, t) for k, t in _PARAM_FIELDS] + [
    pa.field("chat_template_kwargs", pa.string()),  # JSON object
    pa.field("tools", pa.string()),                 # JSON list of tool definitions
    pa.field("extra", pa.string()),                 # JSON object of every other parameter
])

RESULT_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("messages", pa.list_(MESSAGE_TYPE)),  # the prompt of the last generated turn
    pa.field("completion", pa.string()),
    pa.field("reasoning_content", pa.string()),  # when the server separates reasoning
    pa.field("tool_calls", pa.list_(TOOL_CALL_TYPE)),  # null when none
    pa.field("finish_reason", pa.string()),
    pa.field("prompt_tokens", pa.int64()),
    pa.field("completion_tokens", pa.int64()),
    pa.field("server", pa.string()),
    pa.field("attempts", pa.int32()),
    pa.field("latency_s", pa.float64()),
    pa.field("started_at", pa.float64()),  # epoch seconds
    pa.field("finished_at", pa.float64()),
    # Optional (callers may omit it): the request params as sent. A training set of
    # tool-calling rows needs `tools` (and chat_template_kwargs) to render the chat template.
    pa.field("params", PARAMS_TYPE),
    pa.field("flags", pa.list_(pa.string())),  # quality gates with action "flag" that fired, null when none
    pa.field("turns", pa.int32()),  # assistant turns generated for this row (all-turns mode: every one)
    pa.field("extra", pa.string()),  # the input row's other top-level fields, JSON object
    # Per generated turn, the token ids the engine reported (`generation.return_token_ids`): the
    # prompt as it rendered it and the completion as it sampled it. Null when it sent none.
    pa.field("token_ids", pa.list_(TOKEN_TURN_TYPE)),
    # The input row's top-level keys in order, for exports that hand the row back (SpecForge
    # keeps the input's key order); null when it is "id", "conversations", then the others.
    pa.field("key_order", pa.list_(pa.string())),
])
RESULT_COLUMNS = RESULT_SCHEMA.names
COLUMN_SET = frozenset(RESULT_COLUMNS)
NESTED_COLUMNS = frozenset({"messages", "tool_calls", "params", "flags", "token_ids", "key_order"})
_INT_COLUMNS = frozenset({"prompt_tokens", "completion_tokens", "attempts", "turns"})
_FLOAT_COLUMNS = frozenset({"latency_s", "started_at", "finished_at"})
DICT_COLUMNS = ["finish_reason", "server", "params.tools", "params.chat_template_kwargs",
                 "params.reasoning_effort", "flags.list.element"]
# Columns with Parquet min/max statistics: the small ones a reader may filter on. Not the texts
# (messages, completion, reasoning, tool calls, params, extra): a statistic of a text column holds
# copies of its values while the shard is written (about 3x a row's size for a 30 MB answer,
# bench/bench_answer_memory.py), and nobody filters on them.
STATS_COLUMNS = ["id", "finish_reason", "prompt_tokens", "completion_tokens", "server", "attempts", "latency_s",
                 "started_at", "finished_at", "turns"]


def _json_str(v: Any) -> str | None:
    if v is None or isinstance(v, str):
        return v
    return dumps(v).decode()


def tool_call_to_arrow(tc: Any) -> dict[str, Any]:
    """One OpenAI tool call as TOOL_CALL_TYPE (arguments always a JSON string)."""
    if not isinstance(tc, dict):
        raise TypeError(f"a tool call must be an object, got {type(tc).__name__}")
    fn = tc.get("function") or {}
    # text columns: a value of another type (an integer id) as its JSON text; a message keeps the
    # call as given in `extra` too (message_to_arrow), so nothing is lost
    return {"id": _json_str(tc.get("id")), "type": _json_str(tc.get("type")) or "function",
            "function": {"name": _json_str(fn.get("name")), "arguments": _json_str(fn.get("arguments"))}}


def _tool_calls_to_arrow(tcs: Any) -> list[dict[str, Any]] | None:
    if not tcs:
        return None
    return [tool_call_to_arrow(tc) for tc in tcs]


_MESSAGE_KEYS = frozenset(MESSAGE_TYPE.names) - {"content_parts", "extra"}
_TEXT_KEYS = ("role", "reasoning_content", "tool_call_id", "name")


def _exact(tcs: list[Any]) -> bool:
    """Whether TOOL_CALL_TYPE gives these tool calls back as they are (no key beyond id, type,
    function.name and .arguments, each a string)."""
    for tc in tcs:
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not (isinstance(fn, dict) and set(tc) == {"id", "type", "function"} and set(fn) == {"name", "arguments"}
                and all(isinstance(v, str) for v in (tc["id"], tc["type"], fn["name"], fn["arguments"]))):
            return False
    return True


def message_to_arrow(m: dict[str, Any]) -> dict[str, Any]:
    """One chat message as MESSAGE_TYPE; `message_from_arrow` undoes it, every field kept: what
    the typed columns cannot hold as given (a non-text name, a tool call with keys of its own)
    goes into `extra`, as given."""
    content = m.get("content")
    other = {k: v for k, v in m.items() if k not in _MESSAGE_KEYS and v is not None}
    text: dict[str, str | None] = {}
    for k in _TEXT_KEYS:
        v = m.get(k)
        text[k] = v if isinstance(v, str) else None
        if v is not None and not isinstance(v, str):
            other[k] = v
    # The typed column shows every tool call (arguments as text, `type` "function" when absent), for
    # readers of the Parquet; one it does not give back as given is kept whole in `extra` too.
    tcs = m.get("tool_calls")
    if tcs is not None and (not isinstance(tcs, list) or not tcs or not _exact(tcs)):
        other["tool_calls"] = tcs
    if content is not None and not isinstance(content, str | list):
        other["content"] = content
    parts = isinstance(content, list)
    return {
        "role": text["role"],
        "content": content if isinstance(content, str) else None,
        "content_parts": _json_str(content) if parts else None,
        "reasoning_content": text["reasoning_content"],
        "tool_calls": _tool_calls_to_arrow(tcs) if isinstance(tcs, list) else None,
        "tool_call_id": text["tool_call_id"],
        "name": text["name"],
        "extra": _json_str(other) if other else None,
    }


def message_from_arrow(d: dict[str, Any]) -> dict[str, Any]:
    """A stored message back as an OpenAI chat message (absent fields left out; `extra` last: it
    holds what the typed fields could not, as given)."""
    m: dict[str, Any] = {"role": d.get("role")}
    if d.get("content_parts") is not None:
        m["content"] = loads(d["content_parts"])
    elif d.get("content") is not None:
        m["content"] = d["content"]
    for k in ("reasoning_content", "tool_call_id", "name"):
        if d.get(k) is not None:
            m[k] = d[k]
    if d.get("tool_calls"):
        m["tool_calls"] = d["tool_calls"]
    if d.get("extra"):
        m.update(loads(d["extra"]))
    return m


_PARAM_KEYS = frozenset(k for k, _ in _PARAM_FIELDS)
_PARAM_INTS = frozenset(k for k, t in _PARAM_FIELDS if t == pa.int64())
_PARAM_FLOATS = frozenset(k for k, t in _PARAM_FIELDS if t == pa.float64())


def _typed_param(k: str, v: Any) -> bool:
    """Whether `v` fits the typed column of param `k` (else it goes to `extra`, as given)."""
    if k in _PARAM_INTS:   # outside int64 (a seed of 2**70): kept, as given, in `extra`
        return isinstance(v, int) and not isinstance(v, bool) and -(1 << 63) <= v < (1 << 63)
    if k in _PARAM_FLOATS:
        return isinstance(v, int | float) and not isinstance(v, bool)
    if k == "stop":
        return isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))
    return isinstance(v, str)


def params_to_arrow(p: dict[str, Any]) -> dict[str, Any]:
    """Request params as PARAMS_TYPE; `params_from_arrow` undoes it."""
    out: dict[str, Any] = {}
    other: dict[str, Any] = {}
    for k, v in p.items():
        if v is None:
            continue
        if k in _PARAM_KEYS and _typed_param(k, v):
            out[k] = [v] if k == "stop" and isinstance(v, str) else v
        elif k in ("chat_template_kwargs", "tools"):
            out[k] = _json_str(v)
        else:
            other[k] = v
    out["extra"] = _json_str(other) if other else None
    return out


def params_from_arrow(d: dict[str, Any] | None) -> dict[str, Any] | None:
    """Stored params back as a request-params dict (absent fields left out)."""
    if d is None:
        return None
    p: dict[str, Any] = {}
    for k, v in d.items():
        if v is None or k == "extra":
            continue
        p[k] = loads(v) if k in ("chat_template_kwargs", "tools") else v
    if d.get("extra"):
        p.update(loads(d["extra"]))
    return p


def _decode(v: Any) -> Any:
    """A value given as JSON text (older callers, older shards) as the object it encodes."""
    return loads(v) if isinstance(v, str | bytes) else v


def _conv_messages(v: Any) -> list[dict[str, Any]] | None:
    v = _decode(v)
    return None if v is None else [message_to_arrow(m) for m in v]


def _conv_tool_calls(v: Any) -> list[dict[str, Any]] | None:
    return _tool_calls_to_arrow(_decode(v))


def _conv_params(v: Any) -> dict[str, Any] | None:
    v = _decode(v)
    return params_to_arrow(v) if v else None


def _conv_flags(v: Any) -> list[str] | None:
    return list(v) if v else None


def _conv_extra(v: Any) -> str | None:
    if v is None or isinstance(v, str):
        return v
    return dumps(v).decode() if v else None


def _conv_str(name: str) -> Callable[[Any], str | None]:
    def conv(v: Any) -> str | None:
        if v is None or isinstance(v, str):
            return v
        raise TypeError(f"result field {name!r} must be a string or None, got {type(v).__name__}")
    return conv


def _conv_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _conv_float(v: Any) -> float | None:
    return None if v is None else float(v)


def _conv_token_ids(v: Any) -> list[dict[str, Any]] | None:
    return list(v) if v else None


_SPECIAL = {"messages": _conv_messages, "tool_calls": _conv_tool_calls, "params": _conv_params,
            "flags": _conv_flags, "extra": _conv_extra, "token_ids": _conv_token_ids, "key_order": _conv_flags}
CONVERTERS = [
    _SPECIAL[c] if c in _SPECIAL else _conv_int if c in _INT_COLUMNS
    else _conv_float if c in _FLOAT_COLUMNS else _conv_str(c)
    for c in RESULT_COLUMNS
]


def upgrade_column(arr: pa.Array, name: str) -> pa.Array:
    """A column of a shard written before nested types (JSON strings) as today's type."""
    conv = _SPECIAL[name]
    return pa.array([conv(v) for v in arr.to_pylist()], type=RESULT_SCHEMA.field(name).type)
