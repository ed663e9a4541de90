"""Regeneration modes: `generation.regenerate = "all-turns"` regenerates every assistant turn in
order, each request holding the regenerated earlier turns; `"last-turn"` keeps the old contract.

What these protect: a multi-turn training row that mixes the target's text with another
model's ("ORIGINAL" turns kept); a turn generated without the regenerated history; a
conversation half-regenerated when the runner is killed that ends up mixing old and new
turns or written twice; turns pinned to one server (no balance).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

from fleet.config import FleetConfig, GenerationConfig
from fleet.generation.data.checks import account
from fleet.generation.hotpath.client import Outcome
from fleet.generation.data.inputs import iter_input
from fleet.generation.data.rows import Reject, Request
from fleet.generation.job.runner import ServerEntry, run_local
from fleet.generation.data.results import read_quality_rejects, read_results
from fleet.generation.data.schema import message_from_arrow
from fleet.generation.hotpath.work import RowPlan
from test_gen_dispatch import Sim, sims  # noqa: F401  (the fixture is re-used)
from test_gen_runner import job_file, progress, result_ids, start_runner, wait_for

CONV = [
    {"from": "system", "value": "be nice"},
    {"from": "human", "value": "first question"}, {"from": "gpt", "value": "ORIGINAL one"},
    {"from": "human", "value": "second question"}, {"from": "gpt", "value": "ORIGINAL two"},
    {"from": "human", "value": "third question"}, {"from": "gpt", "value": "ORIGINAL three"},
]


def ok(text: str, reasoning: str | None = None) -> Outcome:
    return Outcome("ok", status=200, completion=text, reasoning_content=reasoning, finish_reason="stop",
                   prompt_tokens=10, completion_tokens=5, latency_s=0.1, started_at=100.0, finished_at=100.1)


def one_request(tmp: Path, row: dict[str, Any], **gen: Any) -> Request | Reject:
    p = tmp / "one.jsonl"
    p.write_text(json.dumps(row) + "\n")
    return next(iter(iter_input(p, GenerationConfig(**gen))))


def test_all_turns_sends_each_turn_with_the_regenerated_history(tmp_path: Path) -> None:
    """k assistant turns = k requests in order; request j holds turns 1..j-1 as regenerated
    (their reasoning kept in the stored row, not sent); the original answers never appear."""
    req = one_request(tmp_path, {"id": "c1", "conversations": CONV}, regenerate="all-turns")
    assert isinstance(req, Request)
    w = RowPlan(GenerationConfig(regenerate="all-turns", quality={"missing_reasoning": "keep"})).work(req)
    assert w.turns == 3
    sent = []
    for j in range(3):
        sent.append([dict(m) for m in w.messages])
        more = w.advance(ok(f"NEW {j}", reasoning=f"why {j}"), attempts=1 + j)
        assert more == (j < 2)
    assert [m["content"] for m in sent[0]] == ["be nice", "first question"]
    assert [m["content"] for m in sent[1]] == ["be nice", "first question", "NEW 0", "second question"]
    assert [m["content"] for m in sent[2]] == ["be nice", "first question", "NEW 0", "second question", "NEW 1",
                                               "third question"]
    assert all("reasoning_content" not in m for msgs in sent for m in msgs), "reasoning is not sent back"
    row, reasons = w.result(ok("NEW 2", reasoning="why 2"), "s/0")
    assert reasons == []
    assert [m.get("reasoning_content") for m in row["messages"] if m["role"] == "assistant"] == ["why 0", "why 1"]
    assert row["completion"] == "NEW 2" and row["turns"] == 3
    assert row["attempts"] == 1 + 2 + 3 and row["completion_tokens"] == 15 and row["prompt_tokens"] == 30
    assert "ORIGINAL" not in json.dumps(row)


def test_last_turn_mode_keeps_the_old_contract(tmp_path: Path) -> None:
    """Default mode: the trailing assistant turn is dropped and the earlier ones are context."""
    req = one_request(tmp_path, {"id": "c1", "conversations": CONV})
    assert isinstance(req, Request) and req.messages[-1]["content"] == "third question"
    w = RowPlan(GenerationConfig()).work(req)
    assert w.turns == 1 and w.messages[2]["content"] == "ORIGINAL one"
    assert w.advance(ok("NEW"), 1) is False


def test_all_turns_turn_order_and_tool_turns(tmp_path: Path) -> None:
    """A conversation that opens with the assistant, or has two assistant turns in a row, is
    rejected with the reason (the skipped-rows file); a tool-calling assistant turn is kept as
    given (its tool results answer those exact calls) and a trailing user turn gets an answer."""
    bad = one_request(tmp_path, {"id": "b", "conversations": [{"from": "gpt", "value": "hi"},
                                                              {"from": "human", "value": "q"}]},
                      regenerate="all-turns")
    assert isinstance(bad, Reject) and "starts with an assistant turn" in bad.reason
    bad = one_request(tmp_path, {"id": "b", "messages": [{"role": "user", "content": "q"},
                                                         {"role": "assistant", "content": "a"},
                                                         {"role": "assistant", "content": "b"}]},
                      regenerate="all-turns")
    assert isinstance(bad, Reject) and "two assistant turns in a row" in bad.reason
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    bad = one_request(tmp_path, {"id": "b", "messages": [{"role": "user", "content": "q"},
                                                         {"role": "assistant", "content": "", "tool_calls": [call]}]},
                      regenerate="all-turns")
    assert isinstance(bad, Reject) and "ends with an assistant tool call" in bad.reason
    req = one_request(tmp_path, {"id": "t", "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "42"}, {"role": "assistant", "content": "ORIGINAL"},
        {"role": "user", "content": "and?"}]}, regenerate="all-turns")
    assert isinstance(req, Request)
    w = RowPlan(GenerationConfig(regenerate="all-turns")).work(req)
    assert w.turns == 2
    assert [m["role"] for m in w.messages] == ["user", "assistant", "tool"]
    assert w.advance(ok("NEW"), 1) is True
    assert [m.get("content") for m in w.messages][-2:] == ["NEW", "and?"]


def test_a_rejected_turn_ends_the_conversation(tmp_path: Path) -> None:
    """A gate that rejects turn 1 rejects the row at once: the later turns are not generated."""
    req = one_request(tmp_path, {"id": "c1", "conversations": CONV}, regenerate="all-turns")
    w = RowPlan(GenerationConfig(regenerate="all-turns", quality={"think_markers": "reject"})).work(req)
    assert w.advance(ok("<think>x</think>y"), 1) is False
    row, reasons = w.result(ok("<think>x</think>y"), "s/0")
    assert reasons == ["think_markers"] and row["turns"] == 1


def _write(path: Path, n: int) -> None:
    path.write_text("".join(json.dumps({"id": f"c{i}", "topic": i % 3, "conversations": [
        {**t, "value": t["value"] + f" #{i}"} if t["from"] == "human" else t for t in CONV]}) + "\n"
        for i in range(n)))


def _check_conversations(out: Path, n: int) -> list[dict[str, Any]]:
    rows = read_results(out).to_pylist()
    assert len(rows) == n and len({r["id"] for r in rows}) == n
    for r in rows:
        msgs = [message_from_arrow(m) for m in r["messages"]]
        i = r["id"][1:]
        assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
        assert [m["content"] for m in msgs if m["role"] == "user"] == [
            f"first question #{i}", f"second question #{i}", f"third question #{i}"]
        assert all("ORIGINAL" not in (m["content"] or "") for m in msgs), r["id"]
        assert all(m["content"] for m in msgs if m["role"] == "assistant")
        assert r["turns"] == 3 and r["completion"] and json.loads(r["extra"]) == {"topic": int(i) % 3}
        assert r["key_order"] == ["id", "topic", "conversations"]
    return rows


def test_all_turns_end_to_end_on_two_sims_spreads_turns(tmp_path: Path, sims) -> None:  # noqa: F811
    """Every conversation comes back whole (3 regenerated turns, no original text, user turns
    in place); the two servers share the requests (turns are not pinned to one server); the
    exactly-once accounting holds per conversation."""
    a, b = sims("--tokens-per-s", "3000"), sims("--tokens-per-s", "3000")
    cfg = FleetConfig(name="t", engine={"kind": "sim"}, generation={"max_tokens": 24, "regenerate": "all-turns"})
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    _write(inp, 60)
    servers = [ServerEntry(node="local", index=i, url=s.url, model="sim-model") for i, s in enumerate((a, b))]
    assert run_local(cfg, inp, out, servers, flush_interval_s=0.5, progress_interval_s=0.2) == 0
    _check_conversations(out, 60)
    m = json.loads((out / "manifest.json").read_text())
    per_server = [s["requests"] for s in m["servers"]]
    assert all(n > 0 for n in per_server), per_server
    assert m["checks"]["multi_turn_rows"] == 60
    assert account(inp, out, cfg.generation)["ok"]


def test_all_turns_kill_mid_conversation_then_resume_is_whole(tmp_path: Path, sims) -> None:  # noqa: F811
    """The runner SIGKILLed while conversations are half-regenerated: after resume every
    conversation is complete and consistent (3 new turns, never a mix of old and new), each
    id exactly once, nothing in errors or quality rejects."""
    # slow while the first runner works (about 240 requests of 1-24 tokens at 40 tok/s over 8
    # slots: far longer than the few commits the kill waits for, even on a loaded machine),
    # fast for the resume
    s = sims("--tokens-per-s", "40", "--max-running-requests", "8")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    _write(inp, 80)
    job = job_file(tmp_path, inp, out, [s], config={"generation": {"max_tokens": 24, "max_attempts": 3,
                                                                   "regenerate": "all-turns"}})
    log = tmp_path / "runner.log"
    p = start_runner(job, log)
    try:
        wait_for(lambda: len(result_ids(out)) >= 10, 60, "some conversations committed")
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    finally:
        if p.poll() is None:
            p.kill()
    committed = result_ids(out)
    assert 10 <= len(committed) < 80, "killed too late to test a half-done job"
    s.kill()
    s.start("--tokens-per-s", "4000", "--max-running-requests", "8")
    p = start_runner(job, log)
    assert p.wait(120) == 0, log.read_text()[-2000:]
    _check_conversations(out, 80)
    assert not list(read_quality_rejects(out)) and not (out / "errors.jsonl").read_text().strip()
    cfg = FleetConfig(name="t", engine={"kind": "sim"}, generation={"max_tokens": 24, "regenerate": "all-turns"})
    assert account(inp, out, cfg.generation)["ok"]
    assert progress(out)["state"] == "done"


def test_the_drafter_example_config_and_sample_give_a_specforge_file(tmp_path: Path, sims) -> None:  # noqa: F811
    """README "Regenerating a drafter's training set": deployments/configs/drafter-sim.toml and
    tests/data/drafter-sharegpt.jsonl, run on sims with the config's own fault flags, end in a
    SpecForge file every line of which its validator accepts, with the gates' findings counted."""
    from fleet.config import load_config
    from fleet.generation.data.export import export
    from test_gen_export import read_lines, specforge_problem

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "deployments" / "configs" / "drafter-sim.toml")
    servers = [sims(*cfg.engine.extra_args, "--seed", str(i)) for i in range(cfg.servers.count)]
    inp, out = root / "tests" / "data" / "drafter-sharegpt.jsonl", tmp_path / "out"
    entries = [ServerEntry(node="local", index=i, url=s.url, model="sim-model") for i, s in enumerate(servers)]
    assert run_local(cfg, inp, out, entries, flush_interval_s=0.5, progress_interval_s=0.2) == 0
    acc = account(inp, out, cfg.generation)
    assert acc["ok"] and acc["rejects"] == 2 and acc["completed"] + acc["quality_rejects"] == 20, acc
    s = export(out, "specforge", tmp_path / "train.jsonl")
    lines = read_lines(tmp_path / "train.jsonl")
    assert s.rows == len(lines) and all(specforge_problem(ln) is None for ln in lines)
    # every input row in exactly one of the four files, as SpecForge's own run leaves them
    assert s.rows + s.flagged_left_out + s.skipped + s.errors == 22 and s.skipped == acc["rejects"]
    assert s.flagged_left_out == sum(1 for _ in read_lines(tmp_path / "train_flagged.jsonl")) >= 1
    assert all(ln["status"] == "skipped" and ln["conversations"] for ln in read_lines(tmp_path / "train_skipped.jsonl"))
    assert all(ln["source"] == "tutor-mix" and "ORIGINAL" not in json.dumps(ln) for ln in lines)
    assert all("older model" not in json.dumps(ln) for ln in lines), "an input assistant turn leaked"
    assert all(m.get("reasoning_content") for ln in lines for m in ln["conversations"] if m["role"] == "assistant")


def test_a_failed_turn_sends_the_conversation_to_errors_naming_the_turn(tmp_path: Path, sims) -> None:  # noqa: F811
    """A conversation whose third turn no longer fits the context (the regenerated history
    grew it) ends in errors.jsonl once, saying "turn 3 of 3"; nothing of it is in the shards."""
    s = sims("--context-length", "40")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    inp.write_text(json.dumps({"id": "c0", "ignore_eos": True, "conversations": CONV[1:]}) + "\n")
    cfg = FleetConfig(name="t", engine={"kind": "sim"}, generation={"max_tokens": 16, "regenerate": "all-turns"})
    assert run_local(cfg, inp, out, [ServerEntry(node="local", index=0, url=s.url, model="sim-model")],
                     flush_interval_s=0.5, progress_interval_s=0.2) == 0
    (err,) = [json.loads(ln) for ln in (out / "errors.jsonl").read_text().splitlines()]
    assert err["id"] == "c0" and err["status"] == 400 and err["error"].startswith("turn 3 of 3: HTTP 400")
    assert len(read_results(out)) == 0 and account(inp, out, cfg.generation)["ok"]


def test_token_ids_as_sampled_reach_speculators_pretokenized_rows(tmp_path: Path, sims) -> None:  # noqa: F811
    """issue 24: fleet could not write the pre-tokenized rows speculators' own regeneration
    writes (input_ids, loss_mask from the ids the target *sampled*); re-tokenizing the text can
    differ. With generation.return_token_ids the sim (like vLLM) returns prompt_token_ids and
    the choice's token_ids; each turn's are stored, and `speculators-tokens` makes one row per
    turn: the rendered prompt (mask 0), then exactly the sampled ids (mask 1)."""
    from fleet.generation.data.export import export
    from fleet.sim.generation import _token_id, prompt_token_ids
    from test_gen_export import read_lines

    s = sims()
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    _write(inp, 6)
    cfg = FleetConfig(name="t", engine={"kind": "sim"},
                      generation={"max_tokens": 24, "regenerate": "all-turns", "return_token_ids": True,
                                  "chat_template_kwargs": {"enable_thinking": True}})
    entry = [ServerEntry(node="local", index=0, url=s.url, model="sim-model")]
    assert run_local(cfg, inp, out, entry, flush_interval_s=0.5, progress_interval_s=0.2) == 0
    rows = {r["id"]: r for r in _check_conversations(out, 6)}
    summary = export(out, "speculators-tokens", tmp_path / "tok.jsonl", keep_flagged=True)
    lines = read_lines(tmp_path / "tok.jsonl")
    assert summary.rows == len(lines) == 18 and summary.skipped == 0
    for ln in lines:
        rid, j = ln["primary_id"], int(ln["id"].rsplit("_gen", 1)[1])
        msgs = [message_from_arrow(m) for m in rows[rid]["messages"]]
        answers = [m for m in msgs if m["role"] == "assistant"] + [
            {"content": rows[rid]["completion"], "reasoning_content": rows[rid]["reasoning_content"]}]
        sampled = [_token_id(w) for w in (answers[j]["reasoning_content"] or "").split() + answers[j]["content"].split()]
        slot = [i for i, m in enumerate(msgs) if m["role"] == "assistant"] + [len(msgs)]
        sent = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in msgs[:slot[j]]]
        prompt = prompt_token_ids(sent)
        assert ln["input_ids"] == prompt + sampled and ln["loss_mask"] == [0] * len(prompt) + [1] * len(sampled)

def test_a_speculators_tokens_export_of_a_job_without_token_ids_fails_with_the_remedy(
        tmp_path: Path, sims, capsys) -> None:  # noqa: F811
    """issue 34: without generation.return_token_ids nothing is stored, and `fleet export --format
    speculators-tokens` wrote an empty training file and exited 0. It must exit 2, write no DEST
    (an older one goes: it described another export), keep the reasons in DEST_skipped.jsonl,
    and say what works: the setting, and a new --output (completed rows are never sent again)."""
    from fleet.cli import main
    from test_gen_export import read_lines

    s = sims()
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    _write(inp, 6)
    cfg = FleetConfig(name="t", engine={"kind": "sim"}, generation={"max_tokens": 8})
    entry = [ServerEntry(node="local", index=0, url=s.url, model="sim-model")]
    assert run_local(cfg, inp, out, entry, flush_interval_s=0.5, progress_interval_s=0.2) == 0
    dest = tmp_path / "none.jsonl"
    dest.write_text('{"stale": true}\n')
    capsys.readouterr()
    assert main(["export", str(out), "--format", "speculators-tokens", "-o", str(dest)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "would write an empty file" in err and "have no token ids" in err, err
    assert "generation.return_token_ids = true" in err and "new --output" in err, err
    assert "--retry-errors re-sends failed rows only" in err, err
    assert not dest.exists()
    assert "return_token_ids" in read_lines(tmp_path / "none_skipped.jsonl")[0]["error"]
    # the conversation export needs no ids: it goes through
    assert main(["export", str(out), "--format", "speculators", "-o", str(dest)]) == 0
    assert len(read_lines(dest)) == 6
