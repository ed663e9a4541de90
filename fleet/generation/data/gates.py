"""Quality gates: what is wrong with one generated answer, decided per turn, cheaply.

Each gate is a pure test of one answer (`client.Outcome`); `generation.quality` says what to
do when it fires (keep / flag / reject / retry, see `fleet.config.QualityConfig`):

    empty_content       content empty after stripping whitespace, and no tool calls
    missing_reasoning   reasoning expected (enable_thinking, or quality.expect_reasoning) but
                        reasoning_content empty or absent
    think_markers       "<think>" or "</think>" (any case) left in the content or the reasoning:
                        the server's reasoning parser did not separate them
    truncated           finish_reason "length": cut at max_tokens
    repetition          the answer, or its reasoning, ends in one span of 1-64 words repeated
                        at least `repetition_min_repeats` times (a model stuck in a loop)
    model_mismatch      the answer names another model than the one asked for (`answer.same_model`):
                        a router or a colleague's server serving something else under the name
    implausible_usage   token counts no engine gives in the answer's time (`answer.implausible_usage`):
                        the counts are dropped (never in throughput or cost), the row is marked

`verdict()` turns the gates that fired into one decision: retry when a gate asks for it and
tries are left (a new seed may fix every gate at once), else reject when any gate rejects
(or asked for a retry and ran out), else flag, else keep.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleet.config import QualityConfig

__all__ = ["GATES", "Verdict", "fired", "repeated_tail", "reasoning_expected", "verdict"]

GATES = ("empty_content", "missing_reasoning", "think_markers", "truncated", "repetition", "model_mismatch",
         "implausible_usage")
_MAX_SPAN = 64  # words
_CHARS_PER_WORD = 24  # generous: the tail looked at holds every word a loop could span


def repeated_tail(text: str, min_repeats: int) -> bool:
    """Does `text` end with one span of 1-64 words repeated `min_repeats` times or more?"""
    words = text[-(_MAX_SPAN * min_repeats * _CHARS_PER_WORD):].split()  # only the end: bounded cost
    n = len(words)
    if n < min_repeats:
        return False
    last = words[-1]
    for span in range(1, min(_MAX_SPAN, n // min_repeats) + 1):
        if words[n - 1 - span] != last:   # cheap necessary condition: most spans stop here
            continue
        need = span * min_repeats
        # the last `need` words are one span repeated iff they equal themselves shifted by `span`
        if words[n - need:n - span] == words[n - need + span:]:
            return True
    return False


def _has_think(text: str | None) -> bool:
    if not text:
        return False
    low = text.lower()
    return "<think>" in low or "</think>" in low


def reasoning_expected(cfg: QualityConfig, params: dict[str, Any]) -> bool:
    if cfg.expect_reasoning is not None:
        return cfg.expect_reasoning
    kwargs = params.get("chat_template_kwargs")
    return isinstance(kwargs, dict) and kwargs.get("enable_thinking") is True


def fired(out: Any, cfg: QualityConfig, expect_reasoning: bool) -> list[str]:
    """The gates that fire on one answer (`client.Outcome`), in GATES order."""
    content = out.completion or ""
    reasoning = out.reasoning_content
    hits = []
    if not content.strip() and not out.tool_calls:
        hits.append("empty_content")
    if expect_reasoning and not (reasoning or "").strip():
        hits.append("missing_reasoning")
    if _has_think(content) or _has_think(reasoning):
        hits.append("think_markers")
    if out.finish_reason == "length":
        hits.append("truncated")
    if cfg.repetition != "keep" and ((content and repeated_tail(content, cfg.repetition_min_repeats))
                                     or (reasoning and repeated_tail(reasoning, cfg.repetition_min_repeats))):
        hits.append("repetition")
    if getattr(out, "model_mismatch", False):
        hits.append("model_mismatch")
    if getattr(out, "usage_problem", None):
        hits.append("implausible_usage")
    return hits


@dataclass(slots=True)
class Verdict:
    action: str                                   # keep | flag | reject | retry
    flags: list[str] = field(default_factory=list)    # gates whose action is flag
    reasons: list[str] = field(default_factory=list)  # gates that reject (or retried out)


def verdict(hits: list[str], cfg: QualityConfig, tries_left: int) -> Verdict:
    """One decision from the gates that fired (see the module docstring)."""
    if not hits:
        return Verdict("keep")
    actions = {g: getattr(cfg, g) for g in hits}
    flags = [g for g, a in actions.items() if a == "flag"]
    retry = [g for g, a in actions.items() if a == "retry"]
    if retry and tries_left > 0:
        return Verdict("retry", flags, retry)
    reasons = [g for g, a in actions.items() if a in ("reject", "retry")]
    if reasons:
        return Verdict("reject", flags, reasons)
    return Verdict("flag" if flags else "keep", flags)
