"""Quality gates per row: each gate fires on the answer it names, each action does what it says,
and the counts land in the manifest — against the sim's answer-quality faults, end to end.

What these protect: an empty answer, a leftover <think> marker or a looping answer stored
silently in a drafter's training set; a 'retry' that resends with the same seed (same bad
answer); a rejected row that is generated again on every resume or counted twice.
"""

from __future__ import annotations

import json
from pathlib import Path

from fleet.config import FleetConfig, QualityConfig
from fleet.generation.data.checks import account
from fleet.generation.hotpath.client import Outcome
from fleet.generation.data.gates import fired, repeated_tail, verdict
from fleet.generation.job.runner import ServerEntry, run_local
from fleet.generation.data.results import read_quality_rejects, read_results
from test_gen_dispatch import Sim, sims  # noqa: F401  (the fixture is re-used)


def answer(content: str = "a fine answer", reasoning: str | None = None, finish: str = "stop",
           tool_calls: list | None = None) -> Outcome:
    return Outcome("ok", status=200, completion=content, reasoning_content=reasoning, finish_reason=finish,
                   tool_calls=tool_calls)


def test_each_gate_fires_on_its_fault_and_only_there() -> None:
    """Each gate names one fault: an empty answer, missing reasoning, a <think> marker left in
    content or reasoning, a cut answer, a loop. A tool-call-only answer is not empty."""
    q = QualityConfig()
    assert fired(answer(), q, expect_reasoning=False) == []
    assert fired(answer("  \n"), q, False) == ["empty_content"]
    assert fired(answer("", tool_calls=[{"id": "c"}]), q, False) == []
    assert fired(answer("x", reasoning=None), q, True) == ["missing_reasoning"]
    assert fired(answer("x", reasoning=" "), q, True) == ["missing_reasoning"]
    assert fired(answer("x", reasoning="because"), q, True) == []
    assert fired(answer("<THINK>hm</think>x"), q, False) == ["think_markers"]
    assert fired(answer("x", reasoning="a </think> b"), q, False) == ["think_markers"]
    assert fired(answer("x", finish="length"), q, False) == ["truncated"]
    assert fired(answer("so " + "the end " * 8), q, False) == ["repetition"]
    assert fired(answer("so " + "the end " * 8), QualityConfig(repetition="keep"), False) == []


def test_the_gates_of_issue_33_fire_on_a_looping_reasoning_another_model_and_made_up_counts() -> None:
    """A 5 MB reasoning of one sentence repeated was stored unflagged (the repetition gate read the
    content only); an answer naming another model, and usage of 2^40 tokens, passed every gate."""
    q = QualityConfig()
    assert fired(answer("a fine answer", reasoning="I must check again. " * 250_000), q, False) == ["repetition"]
    assert fired(answer("a fine answer", reasoning="I must check again. " * 3), q, False) == []
    assert fired(Outcome("ok", completion="fine", model="x", model_mismatch=True), q, False) == ["model_mismatch"]
    assert fired(Outcome("ok", completion="fine", usage_problem="2^40"), q, False) == ["implausible_usage"]


def test_same_model_and_implausible_usage_read_what_engines_really_answer() -> None:
    from fleet.answer import implausible_usage, same_model

    for asked, answered in [("m", "m"), ("m", None), ("org/m", "org/m@main"), ("gpt-4o", "gpt-4o-2024-08-06"),
                            ("/dev/shm/fleet-0/t/tiny-chat", "tiny-chat")]:
        assert same_model(asked, answered), (asked, answered)
    for asked, answered in [("m", "other"), ("llama-8b", "llama-70b"), ("org/m", "org/n@main"), ("m", "")]:
        assert not same_model(asked, answered), (asked, answered)
    assert implausible_usage(5, 1 << 40, 30.0, 24) and implausible_usage(1 << 25, 3, 1.0, 24)
    assert implausible_usage(5, 100, 10.0, 24) and implausible_usage(5, 64, 10.0, 24) is None   # 2*24+16 = 64
    assert implausible_usage(5, 90_000, 0.01, None) is None   # within a second: at most 100,000
    assert implausible_usage(None, None, 0.0, 24) is None


def test_repeated_tail_needs_enough_repeats_of_one_span() -> None:
    """Degenerate repetition = one span of 1-64 words repeated at the end; ordinary text,
    a few repeats, or a repeat in the middle do not count."""
    assert repeated_tail("intro " + "a b c " * 8, 8)
    assert not repeated_tail("intro " + "a b c " * 7, 8)
    assert not repeated_tail("a b c " * 8 + "and then it ended normally", 8)
    assert repeated_tail("x " * 2 + " ".join(f"w{i}" for i in range(64)) * 1 + (" " + " ".join(f"w{i}" for i in range(64))) * 7, 8)
    assert not repeated_tail("the quick brown fox jumps over the lazy dog " * 3, 8)


def test_verdict_retry_first_then_reject_then_flag() -> None:
    """A retry is tried while tries are left (a new seed may fix every gate at once); out of
    tries it rejects; flag-only gates store the row with their names."""
    q = QualityConfig(empty_content="retry", think_markers="reject", truncated="flag")
    v = verdict(["empty_content", "think_markers", "truncated"], q, tries_left=1)
    assert (v.action, v.reasons, v.flags) == ("retry", ["empty_content"], ["truncated"])
    v = verdict(["empty_content", "think_markers", "truncated"], q, tries_left=0)
    assert (v.action, sorted(v.reasons), v.flags) == ("reject", ["empty_content", "think_markers"], ["truncated"])
    assert verdict(["truncated"], q, 0).action == "flag"
    assert verdict(["truncated"], QualityConfig(truncated="keep"), 0).action == "keep"


def _write(path: Path, n: int) -> None:
    path.write_text("".join(json.dumps({"id": f"r{i}", "source": "unit", "conversations": [
        {"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": "ORIGINAL"}]}) + "\n" for i in range(n)))


def test_gates_on_the_sim_flag_reject_retry_and_count(tmp_path: Path, sims) -> None:  # noqa: F811
    """End to end on a sim that answers badly on purpose (empty, <think> left in content,
    loops): empty answers are retried with a new seed and none is stored; leaked think
    markers are rejected into quality_rejects.jsonl with the reason; loops are stored
    with the flag; every id ends exactly once; the manifest's counts match the files."""
    s = sims("--empty-rate", "0.3", "--think-leak-rate", "0.15", "--loop-rate", "0.2", "--seed", "7")
    cfg = FleetConfig(name="t", engine={"kind": "sim"}, generation={
        "max_tokens": 40, "chat_template_kwargs": {"enable_thinking": True},
        "quality": {"empty_content": "retry", "retries": 3, "think_markers": "reject", "repetition": "flag",
                    "missing_reasoning": "keep", "truncated": "keep"}})
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    _write(inp, 120)
    rc = run_local(cfg, inp, out, [ServerEntry(node="local", index=0, url=s.url, model="sim-model")],
                   flush_interval_s=0.5, progress_interval_s=0.2)
    assert rc == 0
    acc = account(inp, out, cfg.generation)
    assert acc["ok"], acc
    rows = read_results(out).to_pylist()
    rejected = list(read_quality_rejects(out))
    assert len(rows) + len(rejected) == 120 == acc["completed"] + acc["quality_rejects"]
    assert all(r["completion"].strip() for r in rows), "an empty answer was stored"
    assert not any("<think>" in r["completion"] for r in rows)
    leaked = [r for r in rejected if "think_markers" in r["reasons"]]
    assert leaked and all(r["row"]["completion"].startswith("<think>") for r in leaked)
    # what else is rejected: an answer still empty after 1 + 3 tries (about 0.3**4 of rows)
    assert all(r["reasons"] == ["empty_content"] and r["attempts"] == 4 for r in rejected if r not in leaked)
    looped = [r for r in rows if r["flags"] and "repetition" in r["flags"]]
    assert looped and all(repeated_tail(r["completion"], 8) for r in looped)
    assert all(not repeated_tail(r["completion"], 8) for r in rows if not r["flags"])
    retried = [r for r in rows if r["attempts"] > 1]
    assert retried, "30% empty answers and no retry"
    seeds = {r["params"]["seed"] for r in retried}
    assert None not in seeds and len(seeds) == len(retried), "a retry must carry a new seed"
    m = json.loads((out / "manifest.json").read_text())
    q = m["quality"]
    assert q["rejected_rows"] == len(rejected) and q["rejected"]["think_markers"] == len(leaked)
    assert q["flagged"]["repetition"] == len(looped) == m["checks"]["flagged"]["repetition"]
    assert q["this_run"]["retries"]["empty_content"] >= len(retried)
    assert m["counts"]["quality_rejects"] == len(rejected)
    assert m["accounted"] == 120

    # resume: nothing is generated again (rejected rows count as done)
    rc = run_local(cfg, inp, out, [ServerEntry(node="local", index=0, url=s.url, model="sim-model")],
                   flush_interval_s=0.5, progress_interval_s=0.2)
    assert rc == 0
    m2 = json.loads((out / "manifest.json").read_text())
    assert m2["this_run"]["fed"] == 0 and len(list(read_quality_rejects(out))) == len(rejected)
    assert account(inp, out, cfg.generation)["ok"]
