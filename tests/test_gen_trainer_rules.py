"""Rows a drafter trainer would refuse are rejects at input (`generation.input_rules =
"specforge"`), before any request is spent on them (issue 24)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleet.config import GenerationConfig
from fleet.generation.data.inputs import iter_input
from fleet.generation.data.rows import Reject, Request
from fleet.generation.data.trainerrules import specforge_problem

U, A, S = "user", "assistant", "system"


def conv(*turns: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": r, "content": c} for r, c in turns]


REFUSED = [
    (conv((U, "a"), (U, "b")), "messages[1]: expected an assistant turn, got two user turns in a row"),
    (conv((U, "  "), (A, "x")), "messages[0] (user): empty content"),
    (conv((S, ""), (U, "q")), "messages[0] (system): empty content"),
    (conv((U, "q"), (A, "x"), (S, "late"), (U, "q2")), "messages[2]: a system turn after the first user turn"),
    (conv((A, "hello"), (U, "q")), "messages[0]: the conversation starts with an assistant turn"),
    (conv((S, "only")), "no user turn"),
]


@pytest.mark.parametrize(("messages", "reason"), REFUSED)
def test_specforge_problem_names_the_first_problem_in_plain_english(messages, reason):
    """The reasons read as sentences ("expected an assistant turn", not "a assistant")."""
    assert specforge_problem(messages) == reason


def _rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_input_rules_specforge_rejects_what_the_trainer_refuses_before_any_request(tmp_path):
    """issue 24: a conversation with two user turns in a row or an empty user message was
    generated (tokens spent) and dropped only at export. With input_rules = "specforge" it is a
    reject with SpecForge's reason, in both regeneration modes; the default ("openai") still
    sends what an OpenAI server takes."""
    good = conv((U, "q1"), (A, "a1"), (U, "q2"), (A, "a2"))
    rows = [{"id": f"bad{i}", "conversations": m} for i, (m, _) in enumerate(REFUSED)]
    rows += [{"id": "good", "conversations": good},
             {"id": "tool", "messages": [{"role": "user", "content": "w?"},
                                         {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                          "function": {"name": "f", "arguments": "{}"}}]},
                                         {"role": "tool", "tool_call_id": "c", "content": "{}"}]}]
    inp = _rows(tmp_path / "in.jsonl", rows)
    for mode in ("all-turns", "last-turn"):
        items = list(iter_input(inp, GenerationConfig(regenerate=mode, input_rules="specforge")))
        got = {i.id: i.reason for i in items if isinstance(i, Reject)}
        assert [i.id for i in items if isinstance(i, Request)] == ["good"], mode
        assert got["tool"].startswith("SpecForge would refuse it: messages[1] (assistant): tool calls"), mode
        if mode == "all-turns":  # (an opening assistant turn: the all-turns order check says it first)
            assert [got[f"bad{i}"].removeprefix("SpecForge would refuse it: ").removesuffix(" (nothing to answer)")
                    for i in range(len(REFUSED))] == [reason for _, reason in REFUSED]
    default = list(iter_input(inp, GenerationConfig(regenerate="all-turns")))
    assert {i.id for i in default if isinstance(i, Request)} >= {"bad0", "bad1", "good", "tool"}


def test_input_rules_specforge_last_turn_checks_the_kept_assistant_turns(tmp_path):
    """In last-turn mode the earlier assistant turns go to the trainer as given: an empty one
    is refused; in all-turns mode it is regenerated, so only its place in the order counts."""
    rows = [{"id": "e", "conversations": conv((U, "q1"), (A, ""), (U, "q2"), (A, "old"))}]
    inp = _rows(tmp_path / "in.jsonl", rows)
    (last,) = iter_input(inp, GenerationConfig(regenerate="last-turn", input_rules="specforge"))
    assert isinstance(last, Reject) and last.reason.endswith("messages[1] (assistant): empty content")
    (every,) = iter_input(inp, GenerationConfig(regenerate="all-turns", input_rules="specforge"))
    assert isinstance(every, Request)


def test_a_planned_resume_refuses_the_same_rows(tmp_path):
    """The planned resume path (ids first, then the planned lines) applies the same rules as
    the one-pass reader: the same lines are rejects, with the same reasons."""
    from fleet.generation.data.idset import IdSet

    rows = [{"id": f"r{i}", "conversations": conv((U, "a"), (U, "b")) if i % 3 == 0 else conv((U, f"q{i}"))}
            for i in range(12)] + [{"conversations": conv((U, ""), (A, "x"))}]
    inp = _rows(tmp_path / "in.jsonl", rows)
    gen = GenerationConfig(regenerate="all-turns", input_rules="specforge")
    done = IdSet()
    done.add("r1")
    one = [(i.line, i.reason) for i in iter_input(inp, gen) if isinstance(i, Reject)]
    planned = [(i.line, i.reason) for i in iter_input(inp, gen, skip_ids=done.__contains__) if isinstance(i, Reject)]
    assert one == planned and len(one) == 5
