"""What a drafter trainer refuses in a conversation, as one pure check used twice: on the input
(`generation.input_rules = "specforge"`: the row is a reject before any request is spent on
it) and on the export (`fleet export --format specforge`: the row goes to DEST_skipped.jsonl).

SpecForge's conversation check (its `scripts/conversation_validation.py`, which both its
regeneration script and its validator call) takes a list of role/content messages where:
system turns come only before the first user turn; then user and assistant alternate,
starting with user; every content is a non-empty string; there is at least one user turn.
Tool turns, tool calls and content parts have no place in that format.
"""

from __future__ import annotations

from typing import Any

__all__ = ["specforge_problem"]


def _a(role: str) -> str:
    return f"an {role}" if role[:1] in "aeiou" else f"a {role}"


def _message_problem(i: int, m: dict[str, Any], check_assistant_text: bool) -> str | None:
    role, content = m.get("role"), m.get("content")
    if role == "tool" or m.get("tool_calls"):
        return f"messages[{i}] ({role}): tool calls and tool turns are not part of SpecForge's conversation format"
    if content is not None and not isinstance(content, str):
        return f"messages[{i}] ({role}): content parts (not plain text) are not part of SpecForge's conversation format"
    if (role != "assistant" or check_assistant_text) and not (content or "").strip():
        return f"messages[{i}] ({role}): empty content"
    return None


def specforge_problem(messages: list[dict[str, Any]], *, check_assistant_text: bool = True) -> str | None:
    """Why SpecForge would refuse this conversation, or None.

    `check_assistant_text=False`: the assistant turns are about to be regenerated (all-turns
    input), so their text does not matter yet; their place in the turn order does.
    """
    expected, saw_user = "user", False
    for i, m in enumerate(messages):
        problem = _message_problem(i, m, check_assistant_text)
        if problem is not None:
            return problem
        role = m.get("role")
        if role == "system":
            if saw_user:
                return f"messages[{i}]: a system turn after the first user turn"
            continue
        if role != expected:
            if not saw_user:
                return f"messages[{i}]: the conversation starts with {_a(str(role))} turn"
            return f"messages[{i}]: expected {_a(expected)} turn, got two {role} turns in a row"
        saw_user = True
        expected = "assistant" if role == "user" else "user"
    return None if saw_user else "no user turn"
