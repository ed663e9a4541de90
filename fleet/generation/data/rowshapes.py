"""The three row shapes (OpenAI Batch, simple, ShareGPT) turned into chat messages and request
parameters, every check that can reject a row, and the config defaults. The rules are written
out in `fleet.generation.data.inputs`' docstring.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from fleet.generation.data.jsonl import loads
from fleet.generation.data.rows import Bad, strip_none, type_name
from fleet.generation.data.trainerrules import specforge_problem

if TYPE_CHECKING:
    from fleet.config import GenerationConfig

__all__ = ["KEY_ORDER", "KNOWN_PARAMS", "ROLES", "Shape", "apply_defaults", "param_defaults", "row_id", "shape"]

ROLES = frozenset({"system", "user", "assistant", "tool"})

# Top-level keys of a simple row that are request parameters. Anything else at the top
# level is metadata (source, category, ...) and must not reach the server.
KNOWN_PARAMS = frozenset({
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
    "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "response_format",
    "chat_template_kwargs", "reasoning_effort", "separate_reasoning", "skip_special_tokens",
    "min_tokens", "ignore_eos", "regex", "ebnf", "json_schema", "n", "model", "stream", "stream_options",
    "return_token_ids",
})
_DROPPED_PARAMS = ("model", "stream", "stream_options", "n")

_SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "model": "assistant", "chatgpt": "assistant",
    "bard": "assistant", "bing": "assistant",
    "system": "system",
    "tool": "tool", "observation": "tool", "function_response": "tool", "ipython": "tool",
    "function_call": "function_call",
}



def _maybe_json(v: Any, what: str) -> Any:
    """Parquet (and some JSONL dumps) carry nested objects as JSON strings: decode those."""
    if isinstance(v, str | bytes):
        head = v.lstrip()[:1]
        if head not in ("[", "{", b"[", b"{"):
            raise Bad(f"{what} must be a list or an object, got a plain string")
        try:
            return loads(v)
        except ValueError as exc:
            raise Bad(f"{what}: a string that is not valid JSON ({exc})") from None
    return v


def _check_content(content: Any, where: str) -> None:
    if isinstance(content, str):
        return
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("type"), str) for p in content):
        for j, p in enumerate(content):
            if None in p.values():
                content[j] = strip_none(p)
        return
    if isinstance(content, list):
        j = next(j for j, p in enumerate(content) if not (isinstance(p, dict) and isinstance(p.get("type"), str)))
        raise Bad(f"{where}: content is a list but item {j} is not a content part (an object with a string "
                  f"'type'; got {type_name(content[j])})")
    raise Bad(f"{where}: content must be a string or a list of content parts, got {type_name(content)}")


def _check_tool_calls(tcs: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(tcs, list):
        raise Bad(f"{where}: tool_calls must be a list, got {type_name(tcs)}")
    out = []
    for j, tc in enumerate(tcs):
        if not isinstance(tc, dict):
            raise Bad(f"{where}: tool_calls[{j}] is not an object")
        tc = strip_none(tc)
        fn = tc.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise Bad(f"{where}: tool_calls[{j}] needs function.name (a string)")
        fn = strip_none(fn)
        args = fn.get("arguments")
        if args is not None and not isinstance(args, str | dict):
            raise Bad(f"{where}: tool_calls[{j}].function.arguments must be a string or an object")
        tc["function"] = fn
        out.append(tc)
    return out


def _check_messages(msgs: Any, all_turns: bool = False) -> list[dict[str, Any]]:
    """Validate OpenAI chat messages in place (nulls removed); raise Bad with the first problem.

    `all_turns` (generation.regenerate = "all-turns"): every assistant turn is generated
    again, so the conversation may end with one, but each must answer a user or tool turn.
    """
    if not isinstance(msgs, list):
        raise Bad(f"messages must be a list, got {type_name(msgs)}")
    if not msgs:
        raise Bad("empty messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise Bad(f"messages[{i}] is not an object (got {type_name(m)})")
        if None in m.values():
            m = msgs[i] = strip_none(m)
        role = m.get("role")
        if role not in ROLES:
            raise Bad(f"messages[{i}]: bad role {role!r} (expected system, user, assistant or tool)")
        where = f"messages[{i}] ({role})"
        content = m.get("content")
        if role == "assistant":
            tcs = m.get("tool_calls")
            if tcs is not None:
                m["tool_calls"] = _check_tool_calls(tcs, where)
            if content is None and not tcs:
                raise Bad(f"{where}: neither content nor tool_calls")
        elif content is None:
            raise Bad(f"{where}: no content")
        if content is not None:
            _check_content(content, where)
        if role == "tool" and not isinstance(m.get("tool_call_id", ""), str):
            raise Bad(f"{where}: tool_call_id must be a string")
    if all_turns:
        _check_turn_order(msgs)
    elif msgs[-1]["role"] == "assistant":
        raise Bad("last message is from the assistant: nothing to generate")
    return msgs


def _check_turn_order(msgs: list[dict[str, Any]]) -> None:
    """All-turns mode: an assistant turn to regenerate needs a user/tool turn before it."""
    prev = None
    for i, m in enumerate(msgs):
        role = m["role"]
        if role == "assistant" and not m.get("tool_calls"):
            if prev is None or prev == "system":
                raise Bad(f"messages[{i}]: the conversation starts with an assistant turn (nothing to answer)")
            if prev == "assistant":
                raise Bad(f"messages[{i}]: two assistant turns in a row (turn order user, assistant, user, ...)")
        prev = role
    if msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls"):
        raise Bad("the conversation ends with an assistant tool call and no tool result: nothing to generate")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _number(k: str, v: Any) -> None:
    if not _is_num(v):
        raise Bad(f"{k} must be a number, got {v!r}")


def _string(k: str, v: Any) -> None:
    if not isinstance(v, str):
        raise Bad(f"{k} must be a string, got {type_name(v)}")


def _positive_int(k: str, v: Any) -> None:
    if not (_is_int(v) and v >= 1):
        raise Bad(f"{k} must be a positive integer, got {v!r}")


def _temperature(k: str, v: Any) -> None:
    if not (_is_num(v) and v >= 0):
        raise Bad(f"temperature must be a number >= 0, got {v!r}")


def _top_p(k: str, v: Any) -> None:
    if not (_is_num(v) and 0 < v <= 1):
        raise Bad(f"top_p must be a number in (0, 1], got {v!r}")


def _integer(k: str, v: Any) -> None:
    if not _is_int(v) or not -(1 << 63) <= v < (1 << 63):
        raise Bad(f"{k} must be a 64-bit integer, got {v!r}")


def _stop(k: str, v: Any) -> None:
    if not (isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))):
        raise Bad(f"stop must be a string or a list of strings, got {type_name(v)}")


def _tools(k: str, v: Any) -> None:
    if not (isinstance(v, list) and all(isinstance(t, dict) for t in v)):
        raise Bad(f"tools must be a list of objects, got {type_name(v)}")


def _object(k: str, v: Any) -> None:
    if not isinstance(v, dict):
        raise Bad(f"{k} must be an object, got {type_name(v)}")


def _n(k: str, v: Any) -> None:
    if v != 1:
        raise Bad(f"n={v!r} is not supported: one completion per id")


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
        p = strip_none(p)
    checks = _PARAM_CHECKS
    for k, v in p.items():
        chk = checks.get(k)
        if chk is not None:
            chk(k, v)
    if not _DROPPED.isdisjoint(p):
        for k in _DROPPED_PARAMS:
            p.pop(k, None)
    return p


def row_id(row: dict[str, Any], keys: tuple[str, ...]) -> str | None:
    for k in keys:
        v = row.get(k)
        if v is None:
            continue
        if isinstance(v, str):
            if not v:
                raise Bad(f"empty {k}")
            return v
        if _is_int(v):
            return str(v)
        raise Bad(f"{k} must be a string or an integer, got {type_name(v)}")
    return None


# ---------------------------------------------------------------------------- row shapes


Shape = tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any] | None]


# In `Request.extra` (split out into the result's `key_order` column, `work.RowWork.result`): the
# input row's top-level keys in their order, when an export that hands the row back (specforge)
# could not tell it from the default "id", "conversations", then the others.
KEY_ORDER = "_fleet_key_order"


def _extra(row: dict[str, Any], used: frozenset[str], keep_order: bool = False) -> dict[str, Any] | None:
    extra = {k: v for k, v in row.items() if k not in used}
    if keep_order and list(row) != ["id", "conversations", *extra]:
        extra[KEY_ORDER] = list(row)
    return extra or None


_BATCH_KEYS = frozenset({"custom_id", "id", "method", "url", "body"})
_SIMPLE_KEYS = frozenset({"custom_id", "id", "messages", "params"}) | KNOWN_PARAMS
_SHAREGPT_KEYS = frozenset({"custom_id", "id", "conversations", "params", "tools", "system"})


def _batch_row(row: dict[str, Any], all_turns: bool) -> Shape:
    url = row.get("url")
    if url is not None and url not in ("/v1/chat/completions", "/chat/completions", "v1/chat/completions"):
        raise Bad(f"unsupported url {url!r}: only /v1/chat/completions")
    method = row.get("method")
    if method is not None and str(method).upper() != "POST":
        raise Bad(f"unsupported method {method!r}: only POST")
    body = _maybe_json(row["body"], "body")
    if not isinstance(body, dict):
        raise Bad(f"body must be an object, got {type_name(body)}")
    if body.get("messages") is None:
        raise Bad("no messages in body")
    msgs = _maybe_json(body["messages"], "body.messages")
    params = {k: v for k, v in body.items() if k != "messages"}
    return _check_messages(msgs, all_turns), _check_params(params), _extra(row, _BATCH_KEYS)


def _row_params(row: dict[str, Any]) -> dict[str, Any]:
    extra = row.get("params")
    if extra is None:
        return {}
    extra = _maybe_json(extra, "params")
    if not isinstance(extra, dict):
        raise Bad(f"params must be an object, got {type_name(extra)}")
    return dict(extra)


def _simple_row(row: dict[str, Any], all_turns: bool) -> Shape:
    msgs = _maybe_json(row["messages"], "messages")
    params = {k: v for k, v in row.items() if k in KNOWN_PARAMS}
    params.update(_row_params(row))
    return _check_messages(msgs, all_turns), _check_params(params), _extra(row, _SIMPLE_KEYS)


def _function_calls(value: Any, where: str, turn: int) -> list[dict[str, Any]]:
    calls = _maybe_json(value, f"{where} (function_call)")
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not calls:
        raise Bad(f"{where}: a function_call value must be a JSON object or list of objects")
    out = []
    for k, c in enumerate(calls):
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            raise Bad(f"{where}: each function call needs a string 'name'")
        args = c.get("arguments", c.get("parameters", {}))
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        # Deterministic ids: the content id of the row must not change between runs.
        out.append({"id": f"call_{turn}_{k}", "type": "function", "function": {"name": c["name"], "arguments": args}})
    return out


# A turn's own keys in either ShareGPT spelling; every other key of a turn (tool_calls,
# tool_call_id, name, reasoning_content, a dataset's own: weight, lang, ...) goes into the message
# as it is, as it would under `messages`: nothing of a turn is dropped on the way in.
_TURN_KEYS = frozenset({"from", "value", "role", "content"})


def _sharegpt_turn(turn: dict[str, Any], where: str, i: int, pending: list[str]) -> dict[str, Any]:
    """One ShareGPT turn (from/value or role/content) as an OpenAI message; `pending`: the ids of
    the tool calls still waiting for their results, updated."""
    for a, b in (("from", "role"), ("value", "content")):
        if a in turn and b in turn and turn[a] != turn[b]:   # one of them would be lost
            raise Bad(f"{where}: both {a!r} and {b!r}, and they differ (one turn, one spelling: from/value "
                      f"or role/content)")
    src = turn.get("from", turn.get("role"))
    value = turn.get("value", turn.get("content"))
    role = _SHAREGPT_ROLES.get(src.lower()) if isinstance(src, str) else None
    if role is None:
        raise Bad(f"{where}: bad role {src!r} (expected human, gpt, system, tool, function_call or observation)")
    rest = {k: v for k, v in turn.items() if k not in _TURN_KEYS and v is not None}
    if role == "function_call":
        calls = _function_calls(value, where, i)
        pending[:] = [c["id"] for c in calls]
        return {**rest, "role": "assistant", "content": "", "tool_calls": calls}
    if not (isinstance(value, str | list) or (value is None and role == "assistant" and rest.get("tool_calls"))):
        raise Bad(f"{where} ({src}): the text must be a string or a list of content parts, got {type_name(value)}")
    msg: dict[str, Any] = {"role": role} if value is None else {"role": role, "content": value}
    msg.update(rest)
    tcs = rest.get("tool_calls")
    if role == "assistant" and isinstance(tcs, list) and tcs:
        pending[:] = [tc["id"] for tc in tcs if isinstance(tc, dict) and isinstance(tc.get("id"), str)]
    elif role == "tool":
        if "tool_call_id" in msg:
            if msg["tool_call_id"] in pending:
                pending.remove(msg["tool_call_id"])
        elif pending:
            msg["tool_call_id"] = pending.pop(0)
    return msg


def _sharegpt_row(row: dict[str, Any], all_turns: bool) -> Shape:
    conv = _maybe_json(row["conversations"], "conversations")
    if not isinstance(conv, list):
        raise Bad(f"conversations must be a list, got {type_name(conv)}")
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
            raise Bad(f"{where} is not an object (got {type_name(turn)})")
        msgs.append(_sharegpt_turn(turn, where, i, pending))
    if msgs and msgs[-1]["role"] == "assistant" and not all_turns:
        msgs.pop()  # the answer we regenerate
    if not msgs:
        raise Bad("empty conversations")
    return _check_messages(msgs, all_turns), _check_params(params), _extra(row, _SHAREGPT_KEYS, True)


def shape(row: dict[str, Any], all_turns: bool = False, rules: str = "openai") -> Shape:
    """The row's messages, params and extra fields; `rules` = "specforge" also refuses what
    SpecForge's conversation check would (`trainerrules`), so no request is spent on it."""
    out = _shape(row, all_turns)
    if rules == "specforge":
        problem = specforge_problem(out[0], check_assistant_text=not all_turns)
        if problem is not None:
            raise Bad(f"SpecForge would refuse it: {problem}")
    return out


def _shape(row: dict[str, Any], all_turns: bool) -> Shape:
    if row.get("body") is not None:
        return _batch_row(row, all_turns)
    if row.get("messages") is not None:
        return _simple_row(row, all_turns)
    if row.get("conversations") is not None:
        return _sharegpt_row(row, all_turns)
    raise Bad("no messages: expected 'messages', 'body.messages' or 'conversations'")


def param_defaults(cfg: GenerationConfig | None) -> dict[str, Any]:
    if cfg is None:
        from fleet.config import GenerationConfig

        cfg = GenerationConfig()
    d: dict[str, Any] = {"max_tokens": cfg.max_tokens, "temperature": cfg.temperature}
    if cfg.return_token_ids:
        d["return_token_ids"] = True
    for k in ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed",
              "stop", "chat_template_kwargs"):
        v = getattr(cfg, k)
        if v is not None:
            d[k] = v
    return d


def apply_defaults(defaults: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
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

