"""The work of one row: the requests it takes, in order, and the result row they make.

The dispatcher queues `RowWork`s, not bare `rows.Request`s. A worker sends the current
request (`messages`, `params`), hands the answer to `advance()`, and either puts the row
back in the queue for its next request or ends it with `result()`. So:

- **last-turn** (`generation.regenerate = "last-turn"`): one request, the conversation as
  given (a trailing assistant turn was dropped by the input reader).
- **all-turns**: a conversation with k assistant turns is k dependent requests. Request j
  holds the input up to assistant turn j, with turns 1..j-1 replaced by the answers already
  regenerated (their reasoning_content is kept in the stored conversation but not sent: chat
  templates drop the reasoning of earlier turns, and servers may refuse the field). An
  assistant turn that only calls tools is kept as given: the tool results that follow answer
  those exact calls. A conversation that ends with a user or tool turn gets one more answer.
- **quality gates** (`fleet.generation.data.gates`): a gate that asks for a retry sends the same
  turn again with another seed, up to `quality.retries` times per turn.

Each request goes back to the shared queue, so a conversation's turns go to whichever
server is free (work stealing still balances; see the README on stickiness). Failures are
charged per request by the dispatcher, as for a one-request row. The row is written only
when its last turn is done: a runner killed half-way through a conversation leaves nothing
of it, and resume regenerates the whole conversation — never a mix of old and new turns.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fleet.generation.data.gates import GATES, fired, reasoning_expected, verdict
from fleet.generation.data.rowshapes import KEY_ORDER

if TYPE_CHECKING:
    from fleet.config import GenerationConfig
    from fleet.generation.hotpath.client import Outcome
    from fleet.generation.data.rows import Request

__all__ = ["RowPlan", "RowWork", "GateStats"]

_U31 = (1 << 31) - 1


def _unit(*parts: str) -> float:
    """A number in [0, 1) from the parts, stable across processes (unlike hash())."""
    h = hashlib.blake2b("\x1f".join(parts).encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64


def _without(d: dict[str, Any] | None, key: str) -> dict[str, Any] | None:
    if not d or key not in d:
        return d
    return {k: v for k, v in d.items() if k != key} or None


@dataclass
class GateStats:
    """What the gates did in this run (the files hold the totals across runs)."""

    retries: dict[str, int] = field(default_factory=dict)   # gate -> retries it caused
    flagged: dict[str, int] = field(default_factory=dict)   # gate -> rows stored with its flag
    rejected: dict[str, int] = field(default_factory=dict)  # gate -> rows rejected for it

    @staticmethod
    def _bump(d: dict[str, int], keys: list[str]) -> None:
        for k in keys:
            d[k] = d.get(k, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return {"retries": dict(sorted(self.retries.items())), "flagged": dict(sorted(self.flagged.items())),
                "rejected": dict(sorted(self.rejected.items()))}


class RowPlan:
    """The job-wide part of every row's work: mode, gates, reasoning-effort draw."""

    def __init__(self, gen: GenerationConfig) -> None:
        self.gen = gen
        self.quality = gen.quality
        self.all_turns = gen.regenerate == "all-turns"
        self.stats = GateStats()
        self._gates_on = any(getattr(gen.quality, g) != "keep" for g in GATES)
        efforts = gen.reasoning_effort or {}
        total = float(sum(efforts.values()))
        self._efforts: list[tuple[float, str]] = []
        acc = 0.0
        for name, w in efforts.items():
            acc += w / total
            self._efforts.append((acc, name))
        self._seed = str(gen.seed if gen.seed is not None else 0)

    def effort(self, row_id: str) -> str | None:
        """The row's reasoning_effort draw: weighted, from the job seed and the row id (stable on resume)."""
        if not self._efforts:
            return None
        u = _unit("effort", self._seed, row_id)
        for edge, name in self._efforts:
            if u < edge:
                return name
        return self._efforts[-1][1]

    def work(self, req: Request) -> RowWork:
        return RowWork(req, self)


class RowWork:
    """One row in flight; quacks like an `rows.Request` for `client.chat` (id, line, messages, params)."""

    __slots__ = ("req", "plan", "id", "line", "messages", "params", "turn", "turns", "tries", "_conv", "_slots",
                 "_built", "_expect_reasoning", "flags", "reasons", "prompt_tokens", "completion_tokens",
                 "attempts", "latency_s", "started_at", "requests", "token_turns")

    def __init__(self, req: Request, plan: RowPlan) -> None:
        self.req = req
        self.plan = plan
        self.id = req.id
        self.line = req.line
        params = req.params
        if plan._efforts and "reasoning_effort" not in params:
            params = {**params, "reasoning_effort": plan.effort(req.id)}
        self.params = params
        conv = req.messages
        if plan.all_turns:
            # positions of the assistant turns to regenerate; one more at the end if the
            # conversation ends with a user or tool turn
            slots = [i for i, m in enumerate(conv) if m["role"] == "assistant" and not m.get("tool_calls")]
            if not conv or conv[-1]["role"] != "assistant" or conv[-1].get("tool_calls"):
                slots.append(len(conv))
        else:
            slots = [len(conv)]
        self._conv = conv
        self._slots = slots
        self.turns = len(slots)
        self.turn = 0
        self._built: list[dict[str, Any]] = list(conv[:slots[0]])
        self.messages = self._built if len(slots) == 1 and not plan.all_turns else self._request_messages()
        self.tries = 0                # gate retries of the current turn
        self._expect_reasoning = reasoning_expected(plan.quality, params)
        self.flags: list[str] = []
        self.reasons: list[str] = []
        self.prompt_tokens = self.completion_tokens = 0
        self.attempts = 0             # requests sent for this row, failures included
        self.latency_s = 0.0
        self.started_at: float | None = None
        self.requests = 0             # answers received (every turn, every gate retry)
        self.token_turns: list[dict[str, list[int]]] = []   # per kept turn: the ids the engine reported

    def _request_messages(self) -> list[dict[str, Any]]:
        return [({k: v for k, v in m.items() if k != "reasoning_content"}
                 if m["role"] == "assistant" and "reasoning_content" in m else m) for m in self._built]

    def _reseed(self) -> None:
        base = self.params.get("seed")
        seed = int(_unit("retry", str(base), self.id, str(self.turn), str(self.tries)) * _U31)
        self.params = {**self.params, "seed": seed}

    def advance(self, out: Outcome, attempts: int) -> bool:
        """Take a good answer (HTTP-wise) to the current request, sent `attempts` times.

        True: the row needs another request (a gate's retry, or the next turn), and
        `messages`/`params` now describe it. False: the row is done; call `result()`.
        """
        self.attempts += attempts
        self.requests += 1
        self.latency_s += out.latency_s
        if self.started_at is None:
            self.started_at = out.started_at
        self.prompt_tokens += out.prompt_tokens or 0
        self.completion_tokens += out.completion_tokens or 0
        plan = self.plan
        if plan._gates_on:
            v = verdict(fired(out, plan.quality, self._expect_reasoning), plan.quality,
                        plan.quality.retries - self.tries)
            if v.action == "retry":
                self.tries += 1
                GateStats._bump(plan.stats.retries, v.reasons)
                self._reseed()
                return True
            for g in v.flags:
                if g not in self.flags:
                    self.flags.append(g)
            if v.action == "reject":
                self.reasons = v.reasons
                return False   # no point generating the rest of a rejected conversation
        if out.token_ids is not None and out.prompt_token_ids is not None:
            self.token_turns.append({"prompt": out.prompt_token_ids, "completion": out.token_ids})
        if self.turn + 1 >= self.turns:
            return False
        msg: dict[str, Any] = {"role": "assistant", "content": out.completion}
        if out.reasoning_content is not None:
            msg["reasoning_content"] = out.reasoning_content
        if out.tool_calls:
            msg["tool_calls"] = out.tool_calls
        slot, nxt = self._slots[self.turn], self._slots[self.turn + 1]
        self._built.append(msg)
        self._built.extend(self._conv[slot + 1:nxt])
        self.turn += 1
        self.tries = 0
        self.messages = self._request_messages()
        return True

    def label_error(self, error: str) -> str:
        """An error of this row, saying which turn failed when the row has several."""
        return error if self.turns == 1 else f"turn {self.turn + 1} of {self.turns}: {error}"

    def result(self, out: Outcome, server: str) -> tuple[dict[str, Any], list[str]]:
        """The result row (store.RESULT_COLUMNS) from the last answer, and the reasons it is
        rejected (empty: it is kept)."""
        stats = self.plan.stats
        if self.reasons:
            GateStats._bump(stats.rejected, self.reasons)
        elif self.flags:
            GateStats._bump(stats.flagged, self.flags)
        row = {
            "id": self.id,
            "messages": self._built,
            "params": self.params or None,   # tools, template kwargs: to render it; seed and effort as sent
            "completion": out.completion,
            "reasoning_content": out.reasoning_content,
            "tool_calls": out.tool_calls or None,
            "finish_reason": out.finish_reason,
            "prompt_tokens": self.prompt_tokens if self.requests else out.prompt_tokens,
            "completion_tokens": self.completion_tokens if self.requests else out.completion_tokens,
            "server": server,
            "attempts": self.attempts,
            "latency_s": self.latency_s,
            "started_at": self.started_at if self.started_at is not None else out.started_at,
            "finished_at": out.finished_at,
            "flags": self.flags or None,
            "turns": self.turn + 1,
            "extra": _without(self.req.extra, KEY_ORDER),
            "key_order": (self.req.extra or {}).get(KEY_ORDER),
            # every turn's, or none: a conversation some of whose turns lack them cannot be tokenized
            "token_ids": self.token_turns if len(self.token_turns) == self.turn + 1 else None,
        }
        return row, list(self.reasons)
