"""A chat completion as a server sends it, judged: `parse_answer(body)` gives a typed `Answer`
or raises ValueError with the reason (the row's error, the server's count of invalid answers).
In the core because both sides read answers: bring-up's smoke test (`fleet.smoke`) and
generation's client (`fleet.generation.hotpath.client`).

The schema is strict and keeps only what it validated, so nothing a server sends reaches the
store, the quality gates or the counters with a type they do not expect. Strict means no
coercion: `"5"` is not a token count, `12345` not a content, `{}` not a reasoning, `true` not a
number. A server that sends those is broken (a proxy in the way, the wrong endpoint, a bug);
coercing would store its numbers as if they were true and hide it, and a lenient reading of
one field says nothing of the next. Read strictly, such a body is an invalid answer, and a
server that keeps sending them is taken out and relaunched like a crashing one
(`fleet.generation.hotpath.dispatch`). Extra fields are ignored (engines add their own:
`matched_stop`, `prompt_tokens_details`, `logprobs`, …), and what is kept is rebuilt from the
validated model (a tool call's extra keys are dropped), never the raw document.

Bytes are parsed and validated in one pass by pydantic-core (no intermediate dict of the whole
body: a 30 MB content is decoded once, into its own string). Pure: pydantic only; the smoke
test and the runner's client both use it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = ["Answer", "implausible_usage", "parse_answer", "same_model"]

# A token count above this is no count (it would overflow the store's int64 sums, and no context is near it).
_MAX_TOKENS = 1 << 40


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class _Usage(_Strict):
    prompt_tokens: int | None = Field(None, ge=0, le=_MAX_TOKENS)
    completion_tokens: int | None = Field(None, ge=0, le=_MAX_TOKENS)


class _Function(_Strict):
    name: str
    arguments: str   # the OpenAI schema: a JSON *string* (an object here could nest past any encoder's depth)


class _ToolCall(_Strict):
    id: str | None = None
    type: str | None = None
    function: _Function


class _Message(_Strict):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None   # vLLM's newer name
    tool_calls: list[_ToolCall] | None = None


_TokenIds = list[Annotated[int, Field(ge=0, lt=1 << 31)]]


class _Choice(_Strict):
    message: _Message
    finish_reason: str | None = Field(None, max_length=256)
    token_ids: _TokenIds | None = None          # with return_token_ids (vLLM, SGLang): the ids it sampled
    prompt_token_ids: _TokenIds | None = None   # SGLang puts the prompt's ids in the choice


class _Completion(_Strict):
    choices: list[_Choice] = Field(min_length=1)
    model: Any = None   # the model the server says answered: read (`same_model`), never trusted for its type
    usage: _Usage | None = None
    prompt_token_ids: _TokenIds | None = None   # vLLM puts them here: the prompt as it rendered it


@dataclass(frozen=True, slots=True)
class Answer:
    """What is kept of a valid chat completion (its first choice and the usage)."""

    content: str                       # "" when the server sent none (tool calls only, or null)
    reasoning_content: str | None
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    model: str | None = None           # the answer's own `model` (None: it named none)


# One request's tokens past these no engine produces (issue 33): a single stream decodes a few
# thousand tokens a second at most (speculative decoding included), so 100,000 a second of the
# row's time is a count made up; no model reads a prompt of 2^24 tokens. Such a row is flagged
# (`implausible_usage`), and its counts are left out of throughput and cost.
PLAUSIBLE_COMPLETION_TOK_S = 100_000
PLAUSIBLE_PROMPT_TOKENS = 1 << 24


def implausible_usage(prompt_tokens: int | None, completion_tokens: int | None, seconds: float,
                      max_tokens: int | None) -> str | None:
    """Why an answer's token counts are none an engine can give in `seconds` for a request of
    `max_tokens` (None: they are plausible)."""
    if prompt_tokens is not None and prompt_tokens > PLAUSIBLE_PROMPT_TOKENS:
        return f"usage.prompt_tokens {prompt_tokens:,} (no model reads over {PLAUSIBLE_PROMPT_TOKENS:,})"
    if completion_tokens is None:
        return None
    budget = PLAUSIBLE_COMPLETION_TOK_S * max(seconds, 1.0)
    if completion_tokens > budget:
        return (f"usage.completion_tokens {completion_tokens:,} in {seconds:.2f} s (over "
                f"{PLAUSIBLE_COMPLETION_TOK_S:,} tokens a second)")
    # an engine stops at max_tokens; a speculative step may pass it by a few draft tokens
    if max_tokens is not None and completion_tokens > 2 * max_tokens + 16:
        return f"usage.completion_tokens {completion_tokens:,} for max_tokens {max_tokens:,}"
    return None


def same_model(requested: str, answered: str | None) -> bool:
    """Does an answer's `model` name the model that was asked for? None (no name) is no claim.
    The spellings engines answer for the same model pass: `transformers serve` adds the Hub
    revision ("org/m" → "org/m@main"), OpenAI-style APIs a dated snapshot ("gpt-4o" →
    "gpt-4o-2024-08-06"); a path and its basename are one model."""
    if answered is None or answered == requested:
        return True
    if answered.startswith(requested + "@") or requested.startswith(answered + "@"):
        return True
    if _SNAPSHOT.fullmatch(answered[len(requested):]) and answered.startswith(requested):
        return True
    base = requested.rstrip("/").rsplit("/", 1)[-1]
    return bool(base) and answered.rstrip("/").rsplit("/", 1)[-1] == base and ("/" in requested or "/" in answered)


_SNAPSHOT = re.compile(r"-\d{4}-?\d{2}-?\d{2}")


def _why(exc: ValidationError) -> str:
    """The first problem of a body, without its value (it may be megabytes): `where: what (got TYPE)`."""
    problems = exc.errors(include_url=False, include_context=False)
    if not problems:
        return "not a chat completion"
    e = problems[0]
    where = ".".join(str(x) for x in e["loc"]) or "body"
    got = f" (got {_type_name(e.get('input'))})" if e["type"] != "json_invalid" and e["type"] != "missing" else ""
    more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"{where}: {e['msg']}{got}{more}"[:300]


def _type_name(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


def parse_answer(body: bytes | bytearray | str | dict[str, Any]) -> Answer:
    """The typed answer of a chat.completion body (raw bytes, or a decoded document); ValueError
    "not a chat completion: WHERE: WHAT" when it is not one."""
    try:
        if isinstance(body, dict):
            doc = _Completion.model_validate(body)
        else:
            doc = _Completion.model_validate_json(body)
    except ValidationError as exc:
        raise ValueError(f"not a chat completion: {_why(exc)}") from None
    except RecursionError:
        raise ValueError("not a chat completion: nested too deeply") from None
    choice = doc.choices[0]
    msg = choice.message
    usage = doc.usage
    return Answer(
        content=msg.content or "",
        reasoning_content=msg.reasoning_content or msg.reasoning or None,
        tool_calls=[tc.model_dump(exclude_none=True) for tc in msg.tool_calls] if msg.tool_calls else None,
        finish_reason=choice.finish_reason,
        prompt_tokens=usage.prompt_tokens if usage is not None else None,
        completion_tokens=usage.completion_tokens if usage is not None else None,
        prompt_token_ids=doc.prompt_token_ids if doc.prompt_token_ids is not None else choice.prompt_token_ids,
        token_ids=choice.token_ids,
        model=doc.model if isinstance(doc.model, str) and len(doc.model) <= 1024 else None,
    )
