"""Input rows for generation: every format, every reject reason, ids, duplicates, resume skipping.

Real files only (JSONL, JSONL.gz, Parquet written with pyarrow), no doubles.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fleet.config import GenerationConfig
from fleet.generation.data.inputs import _SeenIds, iter_input
from fleet.generation.data.rows import InputStats, Reject, Request, content_id, digest
from fleet.generation.data.sources import count_rows, input_fingerprint

ROOT = Path(__file__).resolve().parents[1]
CFG = GenerationConfig(max_tokens=4096, temperature=0.6)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
TOOL_CONVERSATION = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 18}"},
]


def write_jsonl(path: Path, rows: list) -> Path:
    with open(path, "w") as f:
        for r in rows:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")
    return path


def items(path: Path, cfg: GenerationConfig | None = CFG, **kw) -> list[Request | Reject]:
    return list(iter_input(path, cfg, **kw))


def requests(xs) -> list[Request]:
    return [x for x in xs if isinstance(x, Request)]


def rejects(xs) -> list[Reject]:
    return [x for x in xs if isinstance(x, Reject)]


# ---------------------------------------------------------------------------- formats


def test_openai_batch_rows_params_and_defaults(tmp_path):
    cfg = GenerationConfig(max_tokens=4096, temperature=0.6, top_p=0.95, seed=7, stop=["</s>"],
                           chat_template_kwargs={"enable_thinking": True, "x": 1})
    p = write_jsonl(tmp_path / "in.jsonl", [
        {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "gpt-x", "stream": True, "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 512, "temperature": 0.2, "chat_template_kwargs": {"enable_thinking": False}}},
        {"custom_id": "r2", "body": {"messages": [{"role": "user", "content": "yo"}], "max_completion_tokens": 99}},
    ])
    r1, r2 = items(p, cfg)
    assert r1 == Request(id="r1", line=1, messages=[{"role": "user", "content": "hi"}], params={
        "max_tokens": 512, "temperature": 0.2, "top_p": 0.95, "seed": 7, "stop": ["</s>"],
        "chat_template_kwargs": {"enable_thinking": False, "x": 1}})
    # max_completion_tokens in the row replaces the default max_tokens; no model, no stream
    assert r2.params == {"max_completion_tokens": 99, "temperature": 0.6, "top_p": 0.95, "seed": 7,
                         "stop": ["</s>"], "chat_template_kwargs": {"enable_thinking": True, "x": 1}}
    # defaults are copied, never shared between rows (a mutated row must not leak)
    assert r1.params["stop"] is not r2.params["stop"]


def test_simple_rows_params_top_level_and_nested_metadata_ignored(tmp_path):
    p = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "s1", "messages": [{"role": "user", "content": "a"}], "temperature": 1.0, "source": "wiki",
         "category": {"x": 1}},
        {"id": 42, "messages": [{"role": "user", "content": "b"}], "params": {"top_k": 20, "tools": TOOLS}},
    ])
    s1, s2 = items(p)
    assert s1.params == {"max_tokens": 4096, "temperature": 1.0}  # source/category are metadata
    assert s2.id == "42"  # integer ids become strings
    assert s2.params == {"max_tokens": 4096, "temperature": 0.6, "top_k": 20, "tools": TOOLS}


def test_tool_calling_conversation_is_kept_intact(tmp_path):
    """Regression: assistant tool_calls with null content and tool messages must pass as they are."""
    p = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "t1", "messages": TOOL_CONVERSATION, "tools": TOOLS, "tool_choice": "auto"},
    ])
    (r,) = items(p)
    assert isinstance(r, Request), r
    assert r.messages[2] == {"role": "assistant", "tool_calls": TOOL_CONVERSATION[2]["tool_calls"]}  # null dropped
    assert r.messages[3] == TOOL_CONVERSATION[3]
    assert r.params["tools"] == TOOLS and r.params["tool_choice"] == "auto"


def test_sharegpt_rows_drop_the_trailing_answer_and_map_tools(tmp_path):
    p = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "g1", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Q1"},
                                       {"from": "gpt", "value": "A1"}, {"from": "human", "value": "Q2"},
                                       {"from": "gpt", "value": "A2 (regenerated)"}]},
        # LLaMA-Factory tool style: top-level system and tools (a JSON string), function_call / observation
        {"id": "g2", "system": "Use tools.", "tools": json.dumps(TOOLS), "conversations": [
            {"from": "human", "value": "Weather in Paris?"},
            {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
            {"from": "observation", "value": "{\"temp_c\": 18}"},
            {"from": "gpt", "value": "18 C"}]},
    ])
    g1, g2 = items(p)
    assert g1.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q1"},
                           {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}]
    assert g2.messages == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1_0", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "content": "{\"temp_c\": 18}", "tool_call_id": "call_1_0"},
    ]
    assert g2.params["tools"] == TOOLS


def test_gzip_input(tmp_path):
    p = tmp_path / "in.jsonl.gz"
    with gzip.open(p, "wt") as f:
        for i in range(3):
            f.write(json.dumps({"id": f"z{i}", "messages": [{"role": "user", "content": str(i)}]}) + "\n")
    assert [r.id for r in items(p)] == ["z0", "z1", "z2"]
    assert count_rows(p) == 3


def test_parquet_input_streams_row_groups_and_matches_jsonl(tmp_path):
    """Parquet with nested columns (list<struct> messages, struct params) gives the same requests
    as the same rows in JSONL, nulls of absent struct fields removed, row numbers across row groups."""
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"}], "params": {"temperature": 0.1 * i}}
            for i in range(1, 10)]
    rows[4] = {"id": "p5", "messages": TOOL_CONVERSATION, "params": {"temperature": 0.5}}
    rows[6] = {"id": "p7", "messages": [{"role": "assistant", "content": "only me"}], "params": None}
    table = pa.Table.from_pylist(rows)
    pq_path = tmp_path / "in.parquet"
    pq.write_table(table, pq_path, row_group_size=2)
    assert pq.ParquetFile(pq_path).num_row_groups == 5
    from_pq = items(pq_path)
    jl_path = write_jsonl(tmp_path / "in.jsonl", rows)
    from_jl = items(jl_path)
    assert requests(from_pq) == requests(from_jl)
    assert [(r.line, r.id, r.reason) for r in rejects(from_pq)] == [(r.line, r.id, r.reason) for r in rejects(from_jl)]
    (bad,) = rejects(from_pq)
    assert bad.line == 7 and bad.id == "p7" and "last message is from the assistant" in bad.reason
    tool_row = next(r for r in from_pq if r.id == "p5")
    assert tool_row.messages[2] == {"role": "assistant", "tool_calls": TOOL_CONVERSATION[2]["tool_calls"]}
    assert count_rows(pq_path) == 9


def test_parquet_batch_rows_with_json_string_columns(tmp_path):
    """pandas dumps often carry nested objects as JSON strings; those are decoded."""
    table = pa.table({
        "custom_id": ["a", "b"],
        "body": [json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 7}), "{not json"],
    })
    p = tmp_path / "batch.parquet"
    pq.write_table(table, p)
    a, b = items(p)
    assert a == Request(id="a", line=1, messages=[{"role": "user", "content": "x"}],
                        params={"max_tokens": 7, "temperature": 0.6})
    assert isinstance(b, Reject) and b.line == 2 and b.id == "b" and "body: a string that is not valid JSON" in b.reason


# ---------------------------------------------------------------------------- malformed rows


MALFORMED = [
    ("{\"id\": \"x\", \"messages\": [", None, "bad JSON"),
    ("[1, 2]", None, "row is not a JSON object"),
    ({"id": "m1"}, "m1", "no messages"),
    ({"id": "m2", "messages": []}, "m2", "empty messages"),
    ({"id": "m3", "messages": "hello"}, "m3", "messages must be a list"),
    ({"id": "m3b", "messages": {"role": "user", "content": "q"}}, "m3b", "messages must be a list"),
    ({"id": "m4", "messages": [{"role": "wizard", "content": "x"}]}, "m4", "bad role 'wizard'"),
    ({"id": "m5", "messages": [{"role": "user", "content": 5}]}, "m5", "content must be a string or a list"),
    ({"id": "m6", "messages": [{"role": "user"}]}, "m6", "no content"),
    ({"id": "m7", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
     "m7", "last message is from the assistant"),
    ({"id": 1.5, "messages": [{"role": "user", "content": "q"}]}, None, "id must be a string or an integer"),
    ({"id": "", "messages": [{"role": "user", "content": "q"}]}, None, "empty id"),
    ({"id": "m8", "messages": [{"role": "user", "content": "q"}], "max_tokens": "lots"}, "m8",
     "max_tokens must be a positive integer"),
    ({"id": "m9", "messages": [{"role": "user", "content": "q"}], "n": 4}, "m9", "n=4 is not supported"),
    ({"custom_id": "m10", "url": "/v1/embeddings", "body": {"input": "x"}}, "m10", "unsupported url"),
    ({"id": "m11", "messages": [{"role": "assistant", "tool_calls": [{"function": {}}]},
                                {"role": "user", "content": "q"}]}, "m11", "needs function.name"),
    ({"id": "m12", "conversations": [{"from": "alien", "value": "x"}]}, "m12", "bad role 'alien'"),
    ({"id": "m13", "conversations": [{"from": "human", "value": ["x"]}]}, "m13", "item 0 is not a content part"),
    ({"id": "m14", "conversations": [{"from": "gpt", "value": "only an answer"}]}, "m14", "empty conversations"),
]


def test_each_malformed_row_is_rejected_with_its_line_and_reason(tmp_path):
    lines: list = []
    expected: list[tuple[int, str | None, str]] = []
    for row, rid, reason in MALFORMED:
        lines.append({"id": "ok-before-" + str(len(lines)), "messages": [{"role": "user", "content": "fine"}]})
        lines.append("")  # blank lines: skipped and counted, but they do count in line numbers
        lines.append(row)
        expected.append((len(lines), rid, reason))
    p = write_jsonl(tmp_path / "in.jsonl", lines)
    p.write_bytes(p.read_bytes() + b"\xff\xfe not utf-8\n")
    expected.append((len(lines) + 1, None, "not UTF-8"))
    st = InputStats()
    out = items(p, stats=st)
    got = rejects(out)
    assert [(r.line, r.id) for r in got] == [(ln, rid) for ln, rid, _ in expected]
    for r, (_, _, reason) in zip(got, expected):
        assert reason in r.reason, (r, reason)
        assert r.raw and len(r.raw) <= 2000
    assert len(requests(out)) == len(MALFORMED)
    assert st == InputStats(rows=2 * len(MALFORMED) + 1, blank=len(MALFORMED), requests=len(MALFORMED),
                            skipped=0, rejects=len(MALFORMED) + 1, duplicates=0)


def test_raw_is_truncated(tmp_path):
    p = write_jsonl(tmp_path / "in.jsonl", [{"id": "big", "messages": [{"role": "user", "content": 7}],
                                             "pad": "x" * 5000}])
    (r,) = items(p)
    assert isinstance(r, Reject) and len(r.raw) == 2000


# ---------------------------------------------------------------------------- ids


def test_content_ids_are_stable_key_order_free_and_documented(tmp_path):
    msgs = [{"role": "user", "content": "héllo"}]
    a = write_jsonl(tmp_path / "a.jsonl", [{"messages": msgs, "temperature": 0.3}])
    b = tmp_path / "b.jsonl"  # same row, keys in another order, other whitespace
    b.write_text('{ "temperature":0.3 ,"messages":[{"content":"héllo","role":"user"}]}\n')
    (ra,), (rb,) = items(a), items(b)
    # the documented recipe: sha256 of canonical JSON of messages + the row's own params
    blob = json.dumps({"messages": msgs, "params": {"temperature": 0.3}}, sort_keys=True,
                      separators=(",", ":"), ensure_ascii=False)
    assert ra.id == rb.id == "h-" + hashlib.sha256(blob.encode()).hexdigest()[:24]
    # config defaults are not part of the id: changing a default must not rename rows (resume)
    (rc,) = items(a, GenerationConfig(max_tokens=10, temperature=1.5))
    assert rc.id == ra.id
    # the same conversation in ShareGPT form gets the same id
    s = write_jsonl(tmp_path / "s.jsonl", [{"conversations": [{"from": "human", "value": "héllo"},
                                                              {"from": "gpt", "value": "old answer"}],
                                            "params": {"temperature": 0.3}}])
    assert items(s)[0].id == ra.id


def test_content_ids_identical_across_processes(tmp_path):
    """Ids must not depend on the per-process string hash seed (digests are in-process only)."""
    p = write_jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(50)])
    code = ("import sys; from fleet.generation.data.inputs import iter_input; "
            "print(','.join(r.id for r in iter_input(sys.argv[1], None)))")
    outs = {subprocess.run([sys.executable, "-c", code, str(p)], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2)}
    assert len(outs) == 1
    assert outs.pop().strip().split(",") == [r.id for r in items(p, None)]


def test_duplicates_first_wins_and_each_later_one_is_reported(tmp_path):
    q = [{"role": "user", "content": "q"}]
    p = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "messages": q},
        {"id": "b", "messages": [{"role": "user", "content": 3}]},  # rejected, but the id is taken
        {"id": "a", "messages": [{"role": "user", "content": "other"}]},
        {"id": "b", "messages": q},
        {"messages": q},  # content id
        {"messages": q},  # same content: same id
        {"id": "a", "messages": q},
    ])
    st = InputStats()
    out = items(p, stats=st)
    assert [(type(x).__name__, x.line, x.id) for x in out] == [
        ("Request", 1, "a"), ("Reject", 2, "b"), ("Reject", 3, "a"), ("Reject", 4, "b"),
        ("Request", 5, content_id(q, {})), ("Reject", 6, content_id(q, {})), ("Reject", 7, "a")]
    dups = [x for x in out if isinstance(x, Reject) and x.reason.startswith("duplicate id")]
    assert [d.reason for d in dups] == ["duplicate id (first at line 1)", "duplicate id (first at line 2)",
                                        "duplicate id (first at line 5)", "duplicate id (first at line 1)"]
    assert st.duplicates == 4


def test_skip_ids_skips_requests_but_never_hides_rejects_or_duplicates(tmp_path):
    """Regression: a duplicate of a done id must still be reported on resume (never dropped silently)."""
    q = [{"role": "user", "content": "q"}]
    p = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "done1", "messages": q}, {"id": "todo", "messages": q}, {"id": "done1", "messages": q},
        {"messages": q}, {"id": "bad", "messages": 1},
    ])
    done = {"done1", content_id(q, {})}
    calls: list[str] = []

    def skip(i: str) -> bool:
        calls.append(i)
        return i in done

    st = InputStats()
    out = items(p, skip_ids=skip, stats=st)
    assert [(type(x).__name__, x.line, x.id) for x in out] == [
        ("Request", 2, "todo"), ("Reject", 3, "done1"), ("Reject", 5, "bad")]
    assert st.skipped == 2 and st.requests == 1
    assert "bad" in calls  # explicit ids are checked before validation (cheap resume) ...
    # ... and a rejected row whose id is done is skipped too: its reject was recorded the first time
    out2 = items(p, skip_ids=lambda i: i in done | {"bad"})
    assert [(x.line, x.id) for x in out2] == [(2, "todo"), (3, "done1")]


def test_seen_ids_table_is_compact_and_exact():
    seen = _SeenIds(capacity=8)
    ids = [f"id-{i}" for i in range(200_000)]
    for n, i in enumerate(ids, 1):
        assert seen.first_line(digest(i), n) == 0
    assert len(seen) == 200_000
    assert seen.first_line(digest("id-123"), 999_999) == 124
    assert seen.first_line(digest("id-199999"), 999_999) == 200_000
    table_bytes = seen._keys.itemsize * len(seen._keys) + seen._lines.itemsize * len(seen._lines)
    assert table_bytes / len(seen) <= 48  # ≤ 48 MB per million ids at worst (just after doubling)


def test_fingerprint_and_count_rows(tmp_path):
    p = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "messages": []}, "", {"id": "b", "messages": []}])
    assert input_fingerprint(p) == hashlib.sha256(p.read_bytes()).hexdigest()
    assert count_rows(p) == 2  # blank lines are not rows
    p2 = tmp_path / "in2.jsonl"
    p2.write_bytes(p.read_bytes() + b" ")
    assert input_fingerprint(p2) != input_fingerprint(p)


def test_missing_or_unreadable_input_is_a_fatal_error_with_a_remedy(tmp_path):
    from fleet.errors import FatalError

    with pytest.raises(FatalError, match="not found") as ei:
        items(tmp_path / "nope.jsonl")
    assert "--input" in ei.value.remedy
    with pytest.raises(FatalError, match="not found"):
        input_fingerprint(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(FatalError, match="not a readable Parquet file"):
        items(bad)


# ---------------------------------------------------------------------------- planned resume


def _nasty_rows() -> list:
    """Every kind of row the one-pass reader decides on: ids of every type, duplicates of done and not-done
    ids, content ids (also one equal to an explicit id), bad JSON, blank lines, bad content, int ids."""
    q = [{"role": "user", "content": "q"}]
    cid = content_id(q, {})
    return [
        {"id": "a", "messages": q}, "", {"custom_id": "b", "body": {"messages": q}},
        {"id": "c", "custom_id": "c2", "messages": q}, '{"id": "broken", "messages": [', "   ",
        {"id": 7, "messages": q}, {"id": "7", "messages": q}, {"id": "", "messages": q}, {"id": 1.5, "messages": q},
        [1, 2], "null", {"messages": q}, {"id": cid, "messages": q}, {"messages": [{"role": "user", "content": 3}]},
        {"id": "bad", "messages": 1}, {"id": "a", "messages": q}, {"id": "d", "messages": q}, {"messages": q},
        {"custom_id": None, "id": "e", "messages": q}, {"id": "b", "messages": 1}, {"id": "f", "messages": q},
        '{"id": "deep", "messages": [{"role": "user", "content": "q"}], "params": {"x": ' + "[" * 2000 + "]" * 2000 + "}}",
        '{"messages": [{"role": "user", "content": "q"}], "params": {"x": ' + "[" * 900 + "]" * 900 + "}}",
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
        {"id": "g", "messages": q, "max_tokens": 0}, {"id": "c2", "messages": q}, "",
    ]


def _both_paths(p: Path, done_ids: set[str], cfg: GenerationConfig | None = CFG):
    from fleet.generation.data.idset import IdSet

    done = IdSet()
    for i in done_ids:
        done.add(i)
    st1, st2 = InputStats(), InputStats()
    one_pass = items(p, cfg, skip_ids=done.__contains__, stats=st1, plan=False)
    planned = items(p, cfg, skip_ids=done.__contains__, stats=st2)   # an IdSet: planned from the ids
    assert items(p, cfg, skip_ids=lambda i: i in done_ids) == one_pass   # a plain callable: never planned
    return one_pass, st1, planned, st2


@pytest.mark.parametrize("limit", [None, 5, 17])
@pytest.mark.parametrize("done_ids", [{"zzz"}, {"a", "b", "7", "bad", "f", "g"},
                                      {"a", "c2", "d", "e", "f", "deep", "h-unknown"}])
def test_planned_resume_yields_exactly_what_the_one_pass_reader_yields(tmp_path, limit, done_ids):
    """Fault: planning a resume from the ids alone (issue 14: ≤ 2 s for 902,087 rows) must not change a
    single decision: the same requests, rejects (reasons, ids, lines, raw), duplicates and counts."""
    rows = _nasty_rows()
    q = [{"role": "user", "content": "q"}]
    p = write_jsonl(tmp_path / "in.jsonl", rows)
    p.write_bytes(b"\xef\xbb\xbf" + p.read_bytes())   # a BOM on line 1
    cfg = CFG.model_copy(update={"limit": limit})
    one_pass, st1, planned, st2 = _both_paths(p, done_ids | {content_id(q, {})}, cfg)
    assert planned == one_pass
    assert st2 == st1
    assert st1.skipped and st1.duplicates if limit is None else True


def test_planned_resume_of_a_truncated_gzip_yields_the_rows_before_the_break_then_the_error(tmp_path):
    from fleet.errors import InputError

    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": "x" * 50 + str(i)}]} for i in range(3000)]
    p = tmp_path / "in.jsonl.gz"
    p.write_bytes(gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in rows))[:-4000])
    done = {f"r{i}" for i in range(0, 3000, 2)}
    from fleet.generation.data.idset import IdSet

    ids = IdSet()
    for i in done:
        ids.add(i)
    got: list[list] = []
    errors: list[str] = []
    for skip in (lambda i: i in done, ids.__contains__):
        out: list = []
        with pytest.raises(InputError) as ei:
            for x in iter_input(p, CFG, skip_ids=skip):
                out.append(x)
        got.append(out)
        errors.append(str(ei.value))
    assert got[0] == got[1] and got[0] and errors[0] == errors[1]


def test_plan_resume_counts_without_validating_done_rows(tmp_path):
    from fleet.generation.data.resume import plan_resume
    from fleet.generation.data.idset import IdSet

    q = [{"role": "user", "content": "q"}]
    p = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "messages": 1}, {"id": "b", "messages": q},
                                             {"id": "a", "messages": q}, "not json"])
    done = IdSet()
    done.add("a")
    plan = plan_resume(p, CFG, done)
    assert (plan.rows, plan.skipped, plan.duplicates, plan.remaining) == (4, 1, 1, 3)
    assert plan.visit.tolist() == [2, 3, 4] and plan.first_at == {3: 1} and list(plan.rejects) == [4]


@pytest.mark.parametrize("codec", ["orjson", "stdlib"])
def test_a_prompt_with_a_lone_surrogate_is_a_bad_line_with_either_codec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       codec: str) -> None:
    """Fault: a node's runner venv has no orjson, and json.loads takes a `\\ud83d` escape left
    unpaired: the row's prompt then holds a lone surrogate that UTF-8 cannot encode, so sending it
    (dumps(body).encode()) or storing it raised outside every handler. Such a line is a bad line at
    input (orjson refuses it too); a paired escape (an emoji) is a good row."""
    from fleet.generation.data import jsonl, sources

    if codec == "stdlib":
        monkeypatch.setattr(sources, "loads_utf8", jsonl.stdlib_loads_utf8)
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"id": "good", "messages": [{"role": "user", "content": "hi \\ud83d\\ude00"}]}\n'
                     b'{"id": "lone", "messages": [{"role": "user", "content": "hi \\ud83d there"}]}\n'
                     b'{"id": "LONE", "messages": [{"role": "user", "content": "hi \\uDC00"}]}\n')
    got = list(sources.jsonl_rows(path, InputStats()))
    assert got[0][1]["messages"][0]["content"] == "hi \U0001f600"
    assert [type(obj).__name__ for _, obj, _ in got[1:]] == ["Bad", "Bad"], got
