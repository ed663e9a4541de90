"""Export formats, data checks, the exactly-once accounting and the plan arithmetic."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fleet.generation.data.checks import account, data_checks
from fleet.generation.data.export import export
from fleet.generation.data.plan import format_plan, plan
from fleet.generation.data.manifest import write_manifest
from fleet.generation.data.schema import RESULT_SCHEMA
from fleet.generation.data.store import ResultStore

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]
TOOL_HISTORY = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "tool_calls": CALL},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 18}"},
]


def row(rid: str, completion: str | None, finish: str | None, tokens: int | None, **kw) -> dict:
    r = {"id": rid, "messages": [{"role": "user", "content": f"question {rid}"}], "completion": completion,
         "finish_reason": finish, "prompt_tokens": 7, "completion_tokens": tokens, "server": "n/0",
         "attempts": 1, "latency_s": 1.0, "started_at": 1700000000.0, "finished_at": 1700000001.0}
    r.update(kw)
    return r


@pytest.fixture
def job(tmp_path) -> Path:
    """A crafted job: one row per data-check case, one failed row."""
    out = tmp_path / "job"
    with ResultStore(out, shard_rows=2) as s:
        s.add_result(row("a", "Hello world", "stop", 10, reasoning_content="I should greet."))
        s.add_result(row("b", "cut off mid sente", "length", 100))
        s.add_result(row("c", "  \n ", "stop", 0))  # empty after strip
        s.add_result(row("d", "<think>oops</think> answer", "stop", 20))  # reasoning not separated
        s.add_result(row("e", "", "tool_calls", 30, messages=TOOL_HISTORY[:2], tool_calls=CALL,
                         params={"max_tokens": 64, "tools": TOOLS}))  # tool-call-only: not "empty"
        s.add_result(row("f", "Sunny, 18 C.", "stop", None, messages=TOOL_HISTORY))
        s.add_error("g", error="HTTP 400: prompt longer than the context", attempts=1, line=7,
                    server="n/1", status=400)
    write_manifest(out, {"servers": [{"name": "n/0", "model": "tiny-qwen"}, {"name": "n/1", "model": "tiny-qwen"}]})
    return out


def read_lines(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f]


def test_data_checks_numbers(job):
    d = data_checks(job)
    assert d["rows"] == 6
    assert (d["cut_at_max_tokens"], d["empty_completions"], d["think_tags"]) == (1, 1, 1)
    assert d["cut_at_max_tokens_share"] == pytest.approx(1 / 6)
    assert (d["with_reasoning"], d["with_tool_calls"]) == (1, 1)
    assert d["finish_reasons"] == {"length": 1, "stop": 4, "tool_calls": 1}
    # tokens 0, 10, 20, 30, 100 (one null): mean 32, median 20, p95 interpolated 30 + 0.8 * 70
    assert d["completion_tokens"] == {"mean": 32.0, "p50": 20.0, "p95": pytest.approx(86.0), "max": 100,
                                      "total": 160, "rows": 5}


def test_data_checks_on_an_empty_job(tmp_path):
    ResultStore(tmp_path / "empty").close()
    d = data_checks(tmp_path / "empty")
    assert d["rows"] == 0 and d["cut_at_max_tokens_share"] is None and d["completion_tokens"]["p50"] is None


def test_export_openai_batch(job, tmp_path):
    dest = tmp_path / "out" / "batch_output.jsonl"
    assert export(job, "openai-batch", dest).rows == 7
    lines = read_lines(dest)
    ok = {ln["custom_id"]: ln for ln in lines if ln["error"] is None}
    assert set(ok) == set("abcdef")
    a = ok["a"]
    assert a["response"]["status_code"] == 200 and a["id"].startswith("batch_req_")
    body = a["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "tiny-qwen"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hello world", "reasoning_content": "I should greet."}
    assert choice["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 10, "total_tokens": 17}
    assert ok["e"]["response"]["body"]["choices"][0]["message"]["tool_calls"] == CALL
    (err,) = [ln for ln in lines if ln["error"] is not None]
    assert err["custom_id"] == "g" and err["response"] is None
    assert err["error"]["message"].startswith("HTTP 400") and err["error"]["code"] == "400"
    # deterministic: exporting again gives the same bytes
    dest2 = tmp_path / "again.jsonl"
    export(job, "openai-batch", dest2)
    assert dest2.read_bytes() == dest.read_bytes()


def test_export_jsonl_is_flat_and_pandas_reads_it(job, tmp_path):
    dest = tmp_path / "flat.jsonl"
    assert export(job, "jsonl", dest).rows == 6
    lines = read_lines(dest)
    assert set(lines[0]) == set(RESULT_SCHEMA.names)
    e = next(ln for ln in lines if ln["id"] == "e")
    assert e["messages"] == TOOL_HISTORY[:2] and e["tool_calls"] == CALL and e["params"]["tools"] == TOOLS
    df = pd.read_json(dest, lines=True)
    assert len(df) == 6 and set(df["id"]) == set("abcdef")


def test_export_sharegpt_with_tool_history(job, tmp_path):
    dest = tmp_path / "sharegpt.jsonl.gz"
    assert export(job, "sharegpt", dest).rows == 6
    by_id = {ln["id"]: ln for ln in read_lines(dest)}
    assert by_id["a"]["conversations"] == [
        {"from": "human", "value": "question a"},
        {"from": "gpt", "value": "Hello world", "reasoning_content": "I should greet."}]
    assert by_id["f"]["conversations"] == [
        {"from": "system", "value": "Use tools."},
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "gpt", "value": "", "tool_calls": CALL},
        {"from": "tool", "value": "{\"temp_c\": 18}", "tool_call_id": "call_1"},
        {"from": "gpt", "value": "Sunny, 18 C."}]
    assert by_id["e"]["conversations"][-1] == {"from": "gpt", "value": "", "tool_calls": CALL}
    assert by_id["e"]["tools"] == TOOLS


def _export(job: Path, fmt: str, dest: Path) -> Path:
    export(job, fmt, dest)  # type: ignore[arg-type]
    return dest


def specforge_problem(line: dict) -> str | None:
    """SpecForge's acceptance of a regenerated-data line, written from its documented rules
    (scripts/regenerate_train_data.py output, scripts/conversation_validation.py): status
    "success"; `conversations` a non-empty list of {role, content}; system turns only before the
    first user turn; then user and assistant alternating, starting with user; every content a
    non-empty string (assistant turns included: its check refuses an empty answer)."""
    if line.get("status") != "success":
        return "status must be 'success'"
    conv = line.get("conversations")
    if not isinstance(conv, list) or not conv:
        return "conversations must be a non-empty list"
    expected, saw_user = "user", False
    for i, m in enumerate(conv):
        if not isinstance(m, dict):
            return f"message {i} must be an object"
        role, content = m.get("role"), m.get("content")
        if not isinstance(content, str) or not content.strip():
            return f"message {i} content must be a non-empty string"
        if role == "system" and not saw_user:
            continue
        if role != expected:
            return f"message {i} expected role {expected!r}, got {role!r}"
        saw_user, expected = True, "assistant" if role == "user" else "user"
    return None if saw_user else "conversation has no user message"


def test_export_specforge_lines_pass_its_validator_and_keep_extra_fields(job, tmp_path):
    """issue 13: SpecForge's validator rejected `--format sharegpt` at line 1 ("status must be
    'success'"). The specforge format is its own regenerated-data JSONL: the input's other
    fields kept, role/content messages, reasoning_content where saved, status "success"; rows
    it cannot take (tool turns) go to DEST_skipped.jsonl with status "skipped" and the reason."""
    with ResultStore(job) as s:
        s.add_result(row("h", "Two.", "stop", 3, extra={"source": "gsm8k", "category": "math", "id": "ignored"},
                         messages=[{"role": "system", "content": "Be terse."},
                                   {"role": "user", "content": "1+1?"},
                                   {"role": "assistant", "content": "2", "reasoning_content": "add"},
                                   {"role": "user", "content": "2/1?"}]))
    dest = tmp_path / "regen.jsonl"
    n = export(job, "specforge", dest).rows
    lines = read_lines(dest)
    assert n == len(lines) == 4  # a b d h; c is an empty answer, e and f hold tool turns
    assert [specforge_problem(ln) for ln in lines] == [None] * 4
    sg = {ln["id"]: ln for ln in read_lines(_export(job, "sharegpt", tmp_path / "sg.jsonl"))}
    assert sg["h"]["conversations"][2] == {"from": "gpt", "value": "2", "reasoning_content": "add"}
    h = next(ln for ln in lines if ln["id"] == "h")
    assert h["source"] == "gsm8k" and h["category"] == "math" and h["status"] == "success"
    assert h["conversations"] == [
        {"role": "system", "content": "Be terse."}, {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2", "reasoning_content": "add"}, {"role": "user", "content": "2/1?"},
        {"role": "assistant", "content": "Two."}]
    a = next(ln for ln in lines if ln["id"] == "a")
    assert a["conversations"][-1] == {"role": "assistant", "content": "Hello world", "reasoning_content": "I should greet."}
    skipped = {ln["id"]: ln for ln in read_lines(tmp_path / "regen_skipped.jsonl")}
    assert set(skipped) == {"c", "e", "f"} and all(ln["status"] == "skipped" for ln in skipped.values())
    assert "tool" in skipped["e"]["error"] and "tool" in skipped["f"]["error"]
    assert skipped["c"]["error"] == "SpecForge would refuse it: messages[1] (assistant): empty content"
    # a later export with nothing to skip removes the stale skipped file
    only_a = tmp_path / "only_a"
    with ResultStore(only_a) as s:
        s.add_result(row("a", "Hi", "stop", 1))
    export(only_a, "specforge", dest)
    assert not (tmp_path / "regen_skipped.jsonl").exists()


def speculators_conversation(turns: list[dict]) -> list[dict]:
    """vLLM speculators' reading of a `conversations` list (its preprocessing, as documented):
    role from `from`/`role` (human/user, gpt/assistant, system, tool), content from
    `value`/`content`, tool_calls / tool_call_id / reasoning_content kept."""
    roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
             "tool": "tool"}
    out = []
    for t in turns:
        role = roles.get(t.get("from", t.get("role", "")))
        assert role is not None, f"speculators would read {t} as an unknown role"
        m = {"role": role, "content": t.get("value") or t.get("content") or ""}
        for k in ("tool_calls", "tool_call_id", "reasoning_content"):
            if t.get(k):
                m[k] = t[k]
        out.append(m)
    return out


def test_export_speculators_reads_as_its_conversations_and_loads_with_datasets(job, tmp_path, monkeypatch):
    """The speculators format is the conversation file its preprocessing takes
    (`--train-data-path x.jsonl`): every turn role/content with tool calls and reasoning
    kept, `tools` at the top level; and `datasets` loads it (and the specforge file) offline."""
    dest = tmp_path / "spec.jsonl"
    assert export(job, "speculators", dest).rows == 6
    by_id = {ln["id"]: ln for ln in read_lines(dest)}
    f = speculators_conversation(by_id["f"]["conversations"])
    assert [m["role"] for m in f] == ["system", "user", "assistant", "tool", "assistant"]
    assert f[2]["tool_calls"] == CALL and f[3]["tool_call_id"] == "call_1" and f[4]["content"] == "Sunny, 18 C."
    assert by_id["e"]["tools"] == TOOLS and "tools" not in by_id["a"]
    assert speculators_conversation(by_id["a"]["conversations"])[-1]["reasoning_content"] == "I should greet."
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import datasets

    export(job, "specforge", tmp_path / "sf.jsonl")
    for path in (dest, tmp_path / "sf.jsonl"):
        ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(tmp_path / "hf"))
        assert len(ds) >= 3 and ds[0]["conversations"][0]["role"] == "user"


def test_export_is_atomic_and_replaces(job, tmp_path):
    dest = tmp_path / "x.jsonl"
    dest.write_text("old\n")
    export(job, "jsonl", dest)
    assert "old" not in dest.read_text() and not list(tmp_path.glob("*.tmp"))
    with pytest.raises(ValueError, match="unknown export format"):
        export(job, "csv", dest)  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError):
        export(tmp_path / "nothing", "jsonl", tmp_path / "y.jsonl")


def test_account_proves_exactly_once_and_catches_violations(tmp_path):
    inp = tmp_path / "in.jsonl"
    with open(inp, "w") as f:
        for i in range(20):
            f.write(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": str(i)}]}) + "\n")
        f.write("not json\n")
    out = tmp_path / "out"
    from fleet.generation.data.inputs import iter_input
    from fleet.generation.data.rows import Reject

    with ResultStore(out, shard_rows=4) as s:
        for item in iter_input(inp, None):
            if isinstance(item, Reject):
                s.add_reject(item)
            elif item.id == "r3":
                s.add_error(item.id, error="x", attempts=6, line=item.line, server=None, status=500)
            elif item.id != "r7":
                s.add_result(row(item.id, "ok", "stop", 1))
    acc = account(inp, out)
    assert not acc["ok"] and acc["missing"] == 1 and acc["missing_ids"] == ["r7"]
    assert (acc["completed"], acc["errors"], acc["rejects"], acc["duplicated"]) == (18, 1, 1, 0)
    # a shard written behind the store's back with an id already completed: caught
    t = pa.Table.from_pylist([{"id": "r5"}, {"id": "r7"}], schema=RESULT_SCHEMA)
    pq.write_table(t, out / "shards" / "part-999999.parquet")
    acc = account(inp, out)
    assert not acc["ok"] and acc["duplicated"] == 1 and acc["duplicated_ids"] == ["r5"] and acc["missing"] == 0


# ---------------------------------------------------------------------------- plan


def test_plan_seed_job():
    """The seed job's hand arithmetic, made consistent (its average output length is not on
    record; 2,000 tokens is assumed): 16.5 days on 4 GPUs; 1-2 days on 8 B200s at $0.49-0.87/M."""
    slow = plan(completions=902_087, avg_output_tokens=2000, tokens_per_s=316, price_per_gpu_hour=None, gpus=4)
    assert slow["total_tokens"] == 1_804_174_000
    assert slow["wall_days"] == pytest.approx(16.5, abs=0.05)
    assert slow["cost_usd"] is None and slow["usd_per_m_tokens"] is None
    fast = plan(completions=902_087, avg_output_tokens=2000, tokens_per_s=2600, price_per_gpu_hour=4.60, gpus=8)
    slowb = plan(completions=902_087, avg_output_tokens=2000, tokens_per_s=1470, price_per_gpu_hour=4.60, gpus=8)
    assert fast["wall_days"] == pytest.approx(1.00, abs=0.01) and slowb["wall_days"] == pytest.approx(1.78, abs=0.01)
    assert fast["usd_per_m_tokens"] == pytest.approx(0.49, abs=0.005)
    assert slowb["usd_per_m_tokens"] == pytest.approx(0.87, abs=0.005)
    # $ total = GPU-hours x price = $/M x M tokens
    assert fast["cost_usd"] == pytest.approx(fast["gpu_hours"] * 4.60)
    assert fast["cost_usd"] == pytest.approx(fast["usd_per_m_tokens"] * fast["total_tokens"] / 1e6)


def test_plan_rate_per_gpu_or_total_agree():
    per_gpu = plan(completions=1000, avg_output_tokens=500, tokens_per_s=100, price_per_gpu_hour=2.0, gpus=8)
    total = plan(completions=1000, avg_output_tokens=500, tokens_per_s=800, price_per_gpu_hour=2.0, gpus=8,
                 tokens_per_s_is_per_gpu=False)
    assert per_gpu == total
    assert per_gpu["wall_s"] == pytest.approx(625.0)  # 500,000 tokens / 800 tok/s
    assert per_gpu["gpu_hours"] == pytest.approx(625 / 3600 * 8)


def test_plan_format_and_validation():
    text = format_plan(plan(completions=902_087, avg_output_tokens=2000, tokens_per_s=2600,
                            price_per_gpu_hour=4.6, gpus=8))
    assert "1,804.2 M output tokens" in text and "20,800 tok/s" in text and "$0.491" in text and "24.1 h" in text
    assert "$" not in format_plan(plan(completions=10, avg_output_tokens=10, tokens_per_s=10, gpus=1))
    for bad in ({"gpus": 0}, {"tokens_per_s": 0}, {"avg_output_tokens": -1}, {"completions": -1},
                {"price_per_gpu_hour": -1.0}):
        args = {"completions": 1, "avg_output_tokens": 1, "tokens_per_s": 1, "gpus": 1} | bad
        with pytest.raises(ValueError):
            plan(**args)


@pytest.fixture
def flagged_job(tmp_path) -> Path:
    """Four conversations: clean, cut at max_tokens, looping, both."""
    out = tmp_path / "flagged"
    with ResultStore(out) as s:
        s.add_result(row("ok", "Fine.", "stop", 2))
        s.add_result(row("cut", "half an ans", "length", 512, flags=["truncated"]))
        s.add_result(row("loop", "la la la la la la la la", "stop", 80, flags=["repetition"]))
        s.add_result(row("both", "la la la la la la la la", "length", 512, flags=["truncated", "repetition"]))
    write_manifest(out, {"state": "done"})
    return out


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_trainer_exports_leave_flagged_conversations_out(flagged_job, tmp_path, fmt):
    """issue 24: with the drafter recipe (truncated/repetition = "flag") the training file held
    looping and cut answers unmarked. A trainer format leaves a flagged conversation out by
    default, writes it (and its flags) to DEST_flagged.jsonl, counts it by flag in the
    summary and the job's manifest; `keep_flagged` keeps all, or only the flags named."""
    dest = tmp_path / "train.jsonl"
    s = export(flagged_job, fmt, dest)
    assert [ln["id"] for ln in read_lines(dest)] == ["ok"] and s.rows == 1
    side = {ln["id"]: ln["flags"] for ln in read_lines(tmp_path / "train_flagged.jsonl")}
    assert side == {"cut": ["truncated"], "loop": ["repetition"], "both": ["truncated", "repetition"]}
    assert s.flagged_left_out == 3 and s.left_out_by_flag == {"truncated": 2, "repetition": 2}
    assert s.files["flagged"] == str(tmp_path / "train_flagged.jsonl")
    m = json.loads((flagged_job / "manifest.json").read_text())
    assert m["exports"][str(dest)]["flagged_left_out"] == 3 and m["state"] == "done"
    s = export(flagged_job, fmt, dest, keep_flagged={"truncated"})
    assert [ln["id"] for ln in read_lines(dest)] == ["ok", "cut"] and s.flagged_kept == 1
    assert {ln["id"] for ln in read_lines(tmp_path / "train_flagged.jsonl")} == {"loop", "both"}
    s = export(flagged_job, fmt, dest, keep_flagged=True)
    assert s.rows == 4 and s.flagged_left_out == 0 and s.flagged_kept == 3
    assert not (tmp_path / "train_flagged.jsonl").exists(), "a stale side file would describe another export"


def test_non_trainer_formats_keep_flagged_rows(flagged_job, tmp_path):
    """jsonl, sharegpt and openai-batch carry every row: their readers have the flags column; and
    they leave a trainer export's side files alone (only a file's own format may replace them)."""
    for fmt in ("jsonl", "sharegpt", "openai-batch"):
        s = export(flagged_job, fmt, tmp_path / f"{fmt}.jsonl")  # type: ignore[arg-type]
        assert s.rows == 4 and s.files == {}
    assert not list(tmp_path.glob("*_flagged.jsonl"))
    export(flagged_job, "specforge", tmp_path / "jsonl.jsonl")
    export(flagged_job, "jsonl", tmp_path / "jsonl.jsonl")
    assert len(read_lines(tmp_path / "jsonl_flagged.jsonl")) == 3


def test_cli_export_prints_what_it_left_out(flagged_job, tmp_path, capsys):
    """`fleet export` says how many conversations it left out, by flag, and where they went."""
    from fleet.cli import main

    dest = tmp_path / "t.jsonl"
    assert main(["export", str(flagged_job), "--format", "specforge", "-o", str(dest)]) == 0
    out = capsys.readouterr().out
    assert "wrote 1 rows" in out
    assert f"left out 3 flagged conversation(s) (repetition: 2, truncated: 2) -> {tmp_path / 't_flagged.jsonl'}" in out
    assert main(["export", str(flagged_job), "--format", "specforge", "-o", str(dest), "--keep-flagged"]) == 0
    assert "wrote 4 rows" in capsys.readouterr().out
    assert main(["export", str(flagged_job), "--format", "specforge", "-o", str(dest),
                 "--keep-flagged", "truncated,repetition"]) == 0
    assert "wrote 4 rows" in capsys.readouterr().out
    # a misspelt flag would keep nothing it names and leave the user believing otherwise
    assert main(["export", str(flagged_job), "--format", "specforge", "-o", str(dest), "--keep-flagged", "truncate"]) != 0
    assert "unknown flag(s) truncate" in capsys.readouterr().err


def test_specforge_error_and_skipped_files_hold_the_input_row_in_its_key_order(tmp_path):
    """issue 24: SpecForge writes DEST_error.jsonl and DEST_skipped.jsonl as the input row plus
    "status" and "error", keys in the input's order; so does the specforge export: failed and
    quality-rejected rows to _error, input rejects to _skipped, each read back from the input;
    and a completed row keeps the input's key order too."""
    from fleet.config import GenerationConfig
    from fleet.generation.hotpath.client import Outcome
    from fleet.generation.data.inputs import iter_input
    from fleet.generation.data.rows import Reject
    from fleet.generation.hotpath.work import RowPlan

    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "old"}]
    rows = [{"source": "s1", "conversations": conv, "id": "r1", "category": "c"},
            {"id": "r2", "conversations": conv, "lang": "en"},
            {"conversations": conv, "source": "s3", "id": "r3"},
            {"id": "r4", "conversations": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
             "source": "s4"}]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    gen = GenerationConfig(regenerate="all-turns", input_rules="specforge")
    items = list(iter_input(inp, gen))
    out = tmp_path / "job"
    with ResultStore(out) as s:
        r1 = next(i for i in items if not isinstance(i, Reject) and i.id == "r1")
        work = RowPlan(gen).work(r1)   # the runner's path from a request to its result row
        assert not work.advance(Outcome("ok", status=200, completion="new", finish_reason="stop"), 1)
        s.add_result(work.result(Outcome("ok", status=200, completion="new", finish_reason="stop"), "n/0")[0])
        s.add_error("r2", error="HTTP 400: too long", attempts=1, line=2, status=400)
        s.add_quality_reject(row("r3", "<think>x</think>", "stop", 1), ["think_markers"], line=3)
        for item in items:
            if isinstance(item, Reject):
                s.add_reject(item)
    write_manifest(out, {"input": {"path": str(inp)}})
    dest = tmp_path / "sf.jsonl"
    s = export(out, "specforge", dest)
    assert s.rows == 1 and s.errors == 2 and s.skipped == 1
    (done,) = read_lines(dest)
    assert list(done) == ["source", "conversations", "id", "category", "status"]
    assert done["conversations"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "new"}]
    errors = read_lines(tmp_path / "sf_error.jsonl")
    assert errors == [{**rows[1], "status": "error", "error": "HTTP 400: too long"},
                      {**rows[2], "status": "error", "error": "rejected by the quality gate(s): think_markers"}]
    assert [list(e) for e in errors] == [[*rows[1], "status", "error"], [*rows[2], "status", "error"]]
    (skipped,) = read_lines(tmp_path / "sf_skipped.jsonl")
    assert skipped == {**rows[3], "status": "skipped",
                       "error": "SpecForge would refuse it: messages[1]: expected an assistant turn, "
                                "got two user turns in a row"}
    # the input moved away: the lines hold what fleet kept (the id; the reject's raw row)
    inp.rename(tmp_path / "gone.jsonl")
    export(out, "specforge", dest)
    assert read_lines(tmp_path / "sf_error.jsonl")[0] == {"id": "r2", "status": "error", "error": "HTTP 400: too long"}
    assert read_lines(tmp_path / "sf_skipped.jsonl")[0]["source"] == "s4"


def test_speculators_export_keeps_the_input_fields(tmp_path):
    """issue 24: the speculators export dropped the input's extra fields (`source`)."""
    out = tmp_path / "job"
    with ResultStore(out) as s:
        s.add_result(row("a", "Hi", "stop", 1, extra={"source": "sharegpt", "turn_count": 1}))
    (line,) = read_lines(_export(out, "speculators", tmp_path / "s.jsonl"))
    assert line["source"] == "sharegpt" and line["turn_count"] == 1 and line["id"] == "a"


def test_an_export_put_elsewhere_afterwards_is_recorded_under_its_real_name(flagged_job, tmp_path):
    """Fault (found in review): `fleet export DIR --dest s3://…` exports to a temporary file first, and
    the job's manifest recorded the export under that temporary path (/tmp/fleet-export-…), the
    summary named its side files there. `named` is the destination the files are put at."""
    tmp = tmp_path / "written" / "train.jsonl"
    tmp.parent.mkdir()
    s = export(flagged_job, "specforge", tmp, named="s3://bucket/jobs/train.jsonl")
    assert s.dest == "s3://bucket/jobs/train.jsonl"
    assert s.files["flagged"] == "s3://bucket/jobs/train_flagged.jsonl"
    assert (tmp.parent / "train_flagged.jsonl").exists()          # written locally, to be put there
    exports = json.loads((flagged_job / "manifest.json").read_text())["exports"]
    assert list(exports) == ["s3://bucket/jobs/train.jsonl"]
