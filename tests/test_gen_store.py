"""The result store: atomic shards under kill -9, exactly-once across resume, retry, lock, fingerprint.

Real files and real processes: the crash test SIGKILLs a writer at random moments and checks
every invariant after each kill.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import wait_until
from fleet.errors import FatalError
from fleet.generation.data.checks import account
from fleet.generation.data.inputs import iter_input
from fleet.generation.data.rows import Reject
from fleet.generation.data.idset import IdSet
from fleet.generation.data.manifest import write_manifest
from fleet.generation.data.results import read_errors, read_rejects, read_results, shard_paths
from fleet.generation.data.schema import RESULT_COLUMNS, RESULT_SCHEMA, message_from_arrow
from fleet.generation.data.store import ResultStore

ROOT = Path(__file__).resolve().parents[1]


def result(i: int | str, **kw) -> dict:
    rid = i if isinstance(i, str) else f"r{i:06d}"
    row = {"id": rid, "messages": [{"role": "user", "content": f"q {rid}"}], "completion": f"answer {rid}",
           "reasoning_content": None, "tool_calls": None, "finish_reason": "stop", "prompt_tokens": 5,
           "completion_tokens": 3, "server": "local/0", "attempts": 1, "latency_s": 0.5,
           "started_at": 1.0, "finished_at": 1.5}
    row.update(kw)
    return row


def all_ids(out: Path) -> list[str]:
    return read_results(out, ["id"]).column("id").to_pylist()


def test_results_commit_in_shards_and_read_back(tmp_path):
    out = tmp_path / "out"
    with ResultStore(out, shard_rows=3) as s:
        for i in range(7):
            assert s.add_result(result(i, tool_calls=[{"id": "c", "type": "function",
                                                       "function": {"name": "f", "arguments": "{}"}}] if i == 2 else None))
        assert [p.name for p in shard_paths(out)] == ["part-000001.parquet", "part-000002.parquet"]
        assert s.counts() == {"completed": 7, "committed": 6, "buffered": 1, "shards": 2, "errors": 0,
                              "rejects": 0, "quality_rejects": 0, "dropped": 0}
        s.flush()
        assert s.counts()["buffered"] == 0 and len(shard_paths(out)) == 3
    t = read_results(out)
    assert t.schema.names == RESULT_COLUMNS
    assert t.column("id").to_pylist() == [f"r{i:06d}" for i in range(7)]
    rows = t.to_pylist()
    assert [message_from_arrow(m) for m in rows[0]["messages"]] == [{"role": "user", "content": "q r000000"}]
    assert rows[0]["messages"][0]["content"] == "q r000000"   # nested: no json.loads
    assert rows[2]["tool_calls"][0]["function"]["name"] == "f"
    assert rows[0]["tool_calls"] is None and rows[0]["attempts"] == 1
    # readable by pandas, as users will read it
    assert len(pq.read_table(shard_paths(out)[0]).to_pandas()) == 3


def test_unknown_fields_are_refused_at_once(tmp_path):
    with ResultStore(tmp_path / "out") as s:
        with pytest.raises(ValueError, match="unknown result field"):
            s.add_result({"id": "a", "completon": "typo"})
        with pytest.raises(ValueError, match="non-empty string 'id'"):
            s.add_result({"completion": "x"})
        with pytest.raises(TypeError, match="completion"):
            s.add_result({"id": "a", "completion": 5})
        assert s.counts()["completed"] == 0


def test_exactly_once_within_a_run(tmp_path):
    with ResultStore(tmp_path / "out", shard_rows=2) as s:
        assert s.add_result(result("a"))
        assert not s.add_result(result("a"))  # never twice, buffered or not
        assert s.add_error("b", error="HTTP 400: too long", attempts=1, line=2, server="s0", status=400)
        assert not s.add_result(result("b"))  # an errored id never also completes ...
        assert not s.add_error("a", error="late", attempts=2, line=1, server=None, status=None)  # ... nor the reverse
        assert s.counts()["dropped"] == 3
    out = tmp_path / "out"
    assert all_ids(out) == ["a"] and [e["id"] for e in read_errors(out)] == ["b"]


def test_resume_skips_done_ids_and_ends_exactly_once(tmp_path):
    """Simulates a runner killed after a flush: resume generates exactly the remaining rows."""
    inp = tmp_path / "in.jsonl"
    with open(inp, "w") as f:
        for i in range(100):
            f.write(json.dumps({"id": f"r{i:06d}", "messages": [{"role": "user", "content": str(i)}]}) + "\n")
        f.write("{broken\n")
        f.write(json.dumps({"id": "r000005", "messages": [{"role": "user", "content": "dup"}]}) + "\n")
    out = tmp_path / "out"
    fp = "f" * 64
    s = ResultStore(out, shard_rows=10, input_fingerprint=fp)
    for item in iter_input(inp, None):
        if isinstance(item, Reject):
            s.add_reject(item)
            continue
        i = int(item.id[1:])
        if i % 10 == 9:
            s.add_error(item.id, error="boom", attempts=6, line=item.line, server="s0", status=500)
        elif i < 60:
            s.add_result(result(item.id))
    s.flush()
    s.add_result(result("r000070"))  # buffered, never flushed: lost in the "crash"
    s._release_lock()  # a crash: no close(), no flush
    s._closed = True

    s2 = ResultStore(out, shard_rows=10, input_fingerprint=fp)
    done = s2.done_ids()
    assert len(done) == 54 + 10  # completed + errors; the duplicate-id reject is not "done"
    todo = [x for x in iter_input(inp, None, skip_ids=done.__contains__)]
    req = [x for x in todo if not isinstance(x, Reject)]
    assert [r.id for r in req] == [f"r{i:06d}" for i in range(60, 100) if i % 10 != 9]
    for x in todo:
        if isinstance(x, Reject):
            assert not s2.add_reject(x)  # already recorded: never written twice
        else:
            assert s2.add_result(result(x.id))
    s2.close()
    acc = account(inp, out)
    assert acc["ok"], acc
    assert (acc["completed"], acc["errors"], acc["rejects"]) == (90, 10, 2)
    assert len(list(read_rejects(out))) == 2


def test_duplicate_reject_never_hides_the_first_row(tmp_path):
    """Regression: a duplicate's reject carries the first row's id; it must not mark that id done,
    or a crash before the first row completes would lose it for good."""
    out = tmp_path / "out"
    with ResultStore(out) as s:
        s.add_reject(Reject(line=9, id="x", reason="duplicate id (first at line 1)", raw=""))
        s.add_reject(Reject(line=3, id="y", reason="bad role 'wizard'", raw=""))
        assert "x" not in s.done_ids() and "y" in s.done_ids()
    with ResultStore(out) as s:
        assert "x" not in s.done_ids() and "y" in s.done_ids()
        assert s.add_result(result("x"))


def test_retry_errors_moves_the_file_aside_and_reopens_the_ids(tmp_path):
    out = tmp_path / "out"
    with ResultStore(out) as s:
        s.add_result(result("ok"))
        for rid in ("e1", "e2"):
            s.add_error(rid, error="timeout", attempts=6, line=None, server="s1", status=None)
    with ResultStore(out) as s:
        assert all(i in s.done_ids() for i in ("e1", "e2", "ok"))
        assert s.retry_errors() == {"e1", "e2"}
        assert "e1" not in s.done_ids() and "e2" not in s.done_ids() and "ok" in s.done_ids()
        assert s.counts()["errors"] == 0
        assert s.add_result(result("e1"))  # the retry succeeds
        assert s.add_error("e2", error="timeout again", attempts=6, line=None, server="s1", status=None)
        assert s.retry_errors() == {"e2"}  # a second retry sees only what failed again
        assert s.add_result(result("e2"))
        assert s.retry_errors() == set()
    assert sorted(all_ids(out)) == ["e1", "e2", "ok"]
    assert list(read_errors(out)) == []  # a retried error that completed is only in completed
    retried = sorted(out.glob("errors-*.retried.jsonl"))
    assert len(retried) == 2 and sum(len(p.read_text().splitlines()) for p in retried) == 3  # the audit trail
    with ResultStore(out) as s:
        assert len(s.done_ids()) == 3 and s.counts()["errors"] == 0


def test_second_store_on_the_same_dir_fails_naming_the_holder(tmp_path):
    out = tmp_path / "out"
    code = ("import sys; from fleet.generation.data.store import ResultStore; s = ResultStore(sys.argv[1]); "
            "print('locked', flush=True); sys.stdin.read(); s.close()")
    p = subprocess.Popen([sys.executable, "-c", code, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, cwd=ROOT)
    try:
        assert p.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        with pytest.raises(FatalError, match=rf"in use by another generation runner \(pid {p.pid} on ") as ei:
            ResultStore(out)
        assert time.monotonic() - t0 < 20  # at once: waiting would last as long as the holder (forever)
        assert ei.value.remedy and "--output" in ei.value.remedy
    finally:
        p.stdin.close()
        p.wait(timeout=30)
    with ResultStore(out) as s:  # released when the holder exits
        # and within one process too: a second open of a locked directory fails
        with pytest.raises(FatalError, match=rf"pid {os.getpid()}"):
            ResultStore(out)
        assert s.counts()["completed"] == 0


def test_a_different_input_into_the_same_dir_is_refused(tmp_path):
    out = tmp_path / "out"
    with ResultStore(out, input_fingerprint="a" * 64) as s:
        s.add_result(result(1))
    assert json.loads((out / "job.json").read_text())["input_fingerprint"] == "a" * 64
    with pytest.raises(FatalError, match="different input") as ei:
        ResultStore(out, input_fingerprint="b" * 64)
    assert "--output" in ei.value.remedy
    with ResultStore(out, input_fingerprint="a" * 64) as s:  # the lock was released by the failed open
        assert "r000001" in s.done_ids()
    with ResultStore(out) as s:  # no fingerprint (export, inspection): no check
        assert s.counts()["completed"] == 1


def test_torn_jsonl_tail_from_a_kill_is_cut_on_open(tmp_path):
    out = tmp_path / "out"
    with ResultStore(out) as s:
        s.add_error("e1", error="x", attempts=1, line=1, server=None, status=None)
    with open(out / "errors.jsonl", "ab") as f:
        f.write(b'{"id": "e2", "error": "half a li')
    with ResultStore(out) as s:
        assert "e1" in s.done_ids() and "e2" not in s.done_ids()
        s.add_error("e3", error="y", attempts=1, line=3, server=None, status=None)
    assert [e["id"] for e in read_errors(out)] == ["e1", "e3"]


def test_manifest_write_is_atomic_json(tmp_path):
    write_manifest(tmp_path, {"counts": {"completed": 1}, "when": time.time()})
    assert json.loads((tmp_path / "manifest.json").read_text())["counts"] == {"completed": 1}
    assert not list(tmp_path.glob("*.tmp"))


def test_flush_from_another_thread_while_adding(tmp_path):
    out = tmp_path / "out"
    n = 5000
    with ResultStore(out, shard_rows=700) as s:
        stop = threading.Event()

        def flusher():
            while not stop.is_set():
                s.flush()

        t = threading.Thread(target=flusher)
        t.start()
        try:
            for i in range(n):
                s.add_result(result(i))
        finally:
            stop.set()
            t.join()
    ids = all_ids(out)
    assert len(ids) == n and len(set(ids)) == n


def test_idset_matches_a_set():
    rng = random.Random(1)
    ref = {f"id{rng.randrange(10**9)}" for _ in range(3000)}
    s = IdSet()
    for i in ref:
        assert s.add(i)
    big = [f"b{i}" for i in range(150_000)]  # past the merge threshold (65,536) twice
    for i in big:
        s.add(i)
    ref.update(big)
    assert len(s) == len(ref)
    gone = rng.sample(sorted(ref), 500)
    for i in gone:
        s.discard(i)
        ref.discard(i)
    assert len(s) == len(ref)
    assert all(i in s for i in ref)
    assert not any(i in s for i in gone)
    assert not any(f"never{i}" in s for i in range(2000))
    assert s.add(gone[0]) and gone[0] in s and not s.add(gone[0])


# ---------------------------------------------------------------------------- kill -9


WRITER = r"""
import random, sys
from fleet.generation.data.rows import Reject
from fleet.generation.data.store import ResultStore

out, n, shard_rows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rnd = random.Random()
s = ResultStore(out, shard_rows=shard_rows)
done = s.done_ids()
print("open", len(done), flush=True)
for i in range(n):
    rid = f"r{i:06d}"
    if i % 97 == 13:
        s.add_reject(Reject(line=i + 1, id=rid, reason="bad role 'x'", raw="{}"))
        continue
    if rid in done:
        continue
    if i % 50 == 7:
        s.add_error(rid, error="HTTP 400", attempts=1, line=i + 1, server="s0", status=400)
    else:
        s.add_result({"id": rid, "completion": rnd.randbytes(3000).hex(),  # incompressible: real-sized writes "messages": "[]",
                      "prompt_tokens": 1, "completion_tokens": 2, "finish_reason": "stop"})
    if i % 333 == 0:
        s.flush()
s.close()
print("finished", flush=True)
"""


def check_invariants(out: Path) -> tuple[set[str], int]:
    """Open (cleans up), then check: every shard readable, no temp files, no id twice anywhere."""
    with ResultStore(out) as s:
        assert not list(out.rglob("*.tmp")), "temp files survive a reopen"
        counts = s.counts()
    ids: list[str] = []
    for p in shard_paths(out):
        t = pq.read_table(p)  # raises on a torn file
        assert t.num_rows > 0
        ids += t.column("id").to_pylist()
    assert len(ids) == len(set(ids)), "an id is in two shards"
    errors = [e["id"] for e in read_errors(out)]
    assert len(errors) == len(set(errors)) and not set(errors) & set(ids)
    lines = [r["line"] for r in read_rejects(out)]
    assert len(lines) == len(set(lines)), "a reject recorded twice"
    assert counts["completed"] == len(ids) and counts["errors"] == len(errors)
    return set(ids) | set(errors), len(ids)


def test_kill_9_at_random_moments_never_tears_a_shard_or_duplicates_an_id(tmp_path):
    out = tmp_path / "out"
    n, shard_rows = 20000, 250
    rng = random.Random(int(os.environ.get("FLEET_TEST_SEED", "4")))
    kills = torn = 0
    done_before = 0
    for _ in range(8):
        p = subprocess.Popen([sys.executable, "-c", WRITER, str(out), str(n), str(shard_rows)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            assert p.stdout.readline().startswith("open")
            start = len(shard_paths(out))
            wait_until(lambda: len(shard_paths(out)) > start or p.poll() is not None, timeout=60,
                       what="the writer to commit a shard")
            time.sleep(rng.uniform(0, 0.3))  # the random moment of the kill is the point of the test
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                kills += 1
            p.wait(timeout=30)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        torn += bool(list(out.rglob("*.tmp")))
        done, _ = check_invariants(out)
        assert len(done) >= done_before  # committed work is never lost
        done_before = len(done)
    assert kills >= 4, "the writer finished before it could be killed: make it slower"
    # finish the job: every id ends exactly once
    p = subprocess.run([sys.executable, "-c", WRITER, str(out), str(n), str(shard_rows)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert "finished" in p.stdout, p.stderr
    done, completed = check_invariants(out)
    expected = {f"r{i:06d}" for i in range(n) if i % 97 != 13}
    assert done == expected
    assert completed == len([i for i in range(n) if i % 97 != 13 and i % 50 != 7])
    print(f"{kills} kills, {torn} left a temp shard behind")


TOOL_MSGS = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get", "arguments": {"city": "Oslo"}}}]},
    {"role": "tool", "content": "12 C", "tool_call_id": "c1", "weight": 0},
]


def test_nested_columns_read_as_lists_and_structs_by_pandas_and_datasets(tmp_path, monkeypatch):
    """issue 12 item 9: messages, params and tool_calls are nested Parquet types, so pandas and
    `datasets` (offline, from local files) read conversations without json.loads; what has no
    fixed shape (tool arguments, content parts, unknown keys) round-trips exactly."""
    out = tmp_path / "out"
    params = {"max_tokens": 64, "temperature": 0.6, "stop": "END", "tools": [{"type": "function", "function": {
        "name": "get", "parameters": {"type": "object"}}}], "chat_template_kwargs": {"enable_thinking": True},
        "reasoning_effort": "low", "logit_bias": {"5": 1}}
    with ResultStore(out) as s:
        s.add_result(result(0, messages=TOOL_MSGS, params=params, flags=["truncated"], turns=2,
                            extra={"source": "x"},
                            tool_calls=[{"id": "c2", "type": "function", "function": {"name": "get", "arguments": "{}"}}]))
    from fleet.generation.data.schema import message_from_arrow, params_from_arrow

    row = read_results(out).to_pylist()[0]
    back = [message_from_arrow(m) for m in row["messages"]]
    # every message back as given (issue 34: arguments given as an object come back as one) ...
    assert back == TOOL_MSGS
    assert params_from_arrow(row["params"]) == {**params, "stop": ["END"]}
    assert row["flags"] == ["truncated"] and row["turns"] == 2 and json.loads(row["extra"]) == {"source": "x"}

    df = pq.read_table(shard_paths(out)[0]).to_pandas()
    msgs = df.loc[0, "messages"]
    assert msgs[0]["role"] == "system" and msgs[3]["tool_call_id"] == "c1"
    # ... while the typed column a Parquet reader sees holds the OpenAI wire format: arguments as a string
    assert msgs[2]["tool_calls"][0]["function"]["arguments"] == '{"city":"Oslo"}'
    assert df.loc[0, "tool_calls"][0]["function"]["name"] == "get" and df.loc[0, "params"]["max_tokens"] == 64

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import datasets

    ds = datasets.load_dataset("parquet", data_files=[str(p) for p in shard_paths(out)], split="train",
                               cache_dir=str(tmp_path / "hf-cache"))
    r = ds[0]
    assert r["messages"][1]["role"] == "user" and r["messages"][2]["tool_calls"][0]["id"] == "c1"
    assert r["params"]["temperature"] == 0.6 and r["params"]["stop"] == ["END"] and r["tool_calls"][0]["id"] == "c2"


def test_a_shard_from_before_nested_types_reads_as_nested(tmp_path):
    """A job resumed across the upgrade: shards written with JSON-string columns read back in
    today's nested types (a mixed directory must stream one schema, or export and checks break)."""
    out = tmp_path / "out"
    (out / "shards").mkdir(parents=True)
    old = pa.table({"id": ["old"], "messages": [json.dumps([{"role": "user", "content": "hi"}])],
                    "completion": ["yo"], "tool_calls": [json.dumps([{"id": "c", "type": "function",
                                                                        "function": {"name": "f", "arguments": "{}"}}])],
                    "params": [json.dumps({"max_tokens": 8})]})
    pq.write_table(old, out / "shards" / "part-000001.parquet")
    with ResultStore(out) as s:
        s.add_result(result("new"))
    t = read_results(out)
    assert t.schema == RESULT_SCHEMA
    rows = {r["id"]: r for r in t.to_pylist()}
    assert rows["old"]["messages"][0]["content"] == "hi" and rows["old"]["tool_calls"][0]["function"]["name"] == "f"
    assert rows["old"]["params"]["max_tokens"] == 8 and rows["new"]["messages"][0]["content"] == "q new"


def test_flush_waits_for_a_commit_under_way_in_another_thread(tmp_path, monkeypatch):
    """The runner's timed flush runs in a thread; at the end of a job its task is cancelled
    while the thread may still be writing the last shard. The final flush returned at once (the
    buffer was already taken) and the manifest said 0 completed, 0 shards, with every row in a
    shard written a moment later. A flush now returns only when that commit is done."""
    out = tmp_path / "out"
    s = ResultStore(out)
    for i in range(5):
        s.add_result(result(i))
    writing, release = threading.Event(), threading.Event()
    real_write = pq.write_table

    def slow_write(*a, **kw):
        writing.set()
        assert release.wait(30)
        return real_write(*a, **kw)

    monkeypatch.setattr(pq, "write_table", slow_write)

    class CountingLock:   # counts who asks for the commit lock, so the test knows B is waiting
        def __init__(self, inner):
            self.inner, self.asked = inner, 0

        def __enter__(self):
            self.asked += 1
            return self.inner.__enter__()

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

    lock = s._commit_lock = CountingLock(s._commit_lock)
    a = threading.Thread(target=s.flush)
    a.start()
    assert writing.wait(30)
    done: list[dict] = []
    b = threading.Thread(target=lambda: (s.flush(), done.append(s.counts())))
    b.start()
    wait_until(lambda: lock.asked >= 3, timeout=30, what="the second flush waiting for the commit lock")
    release.set()
    a.join(30)
    b.join(30)
    assert done and done[0]["committed"] == 5 and done[0]["shards"] == 1
    s.close()


def test_rows_with_large_answers_are_committed_without_waiting_for_the_timed_flush(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """Fault (issue 23, memory): rows of tens of MB of reasoning sat in the commit buffer until the
    timed flush (or shard_rows rows), and at the commit each was held twice (its strings and their
    Arrow copy): 8 such rows peaked the runner at 4.6x their size. Now the buffer commits a shard as
    soon as its answer text passes BUFFER_CHARS; rows of ordinary size still wait for shard_rows."""
    from fleet.generation.data import store

    monkeypatch.setattr(store, "BUFFER_CHARS", 1000)
    out = tmp_path / "out"
    with ResultStore(out, shard_rows=10_000) as s:
        s.add_result({"id": "a", "completion": "x" * 600})
        assert shard_paths(out) == []
        s.add_result({"id": "b", "completion": "y", "reasoning_content": "z" * 600})
        assert len(shard_paths(out)) == 1 and s.counts()["buffered"] == 0
        s.add_result({"id": "c", "completion": "small"})
        assert len(shard_paths(out)) == 1 and s.counts()["buffered"] == 1
    assert sorted(read_results(out, ["id"]).column(0).to_pylist()) == ["a", "b", "c"]


def test_a_runaway_answer_is_committed_at_once_never_beside_others(tmp_path: Path, monkeypatch) -> None:
    """Fault (issue 23, memory): rows of 30 MB waited in the buffer until 64 Mi chars of them had come,
    and all of them were held twice at their commit (strings and Arrow). A row whose answer alone passes
    LARGE_ROW_CHARS is committed at once, with what waited before it; ordinary rows still wait."""
    from fleet.generation.data import store

    monkeypatch.setattr(store, "LARGE_ROW_CHARS", 500)
    out = tmp_path / "out"
    with ResultStore(out, shard_rows=10_000) as s:
        s.add_result({"id": "a", "completion": "x" * 100})
        assert shard_paths(out) == []
        s.add_result({"id": "b", "completion": "y" * 200, "reasoning_content": "z" * 300})
        assert len(shard_paths(out)) == 1 and s.counts()["buffered"] == 0 and s.counts()["committed"] == 2
        s.add_result({"id": "c", "completion": "small"})
        assert len(shard_paths(out)) == 1 and s.counts()["buffered"] == 1
    assert sorted(read_results(out, ["id"]).column(0).to_pylist()) == ["a", "b", "c"]


def test_big_texts_are_stored_exactly_as_chunks_of_their_own(tmp_path: Path, monkeypatch) -> None:
    """Protects the text columns of a shard with BIG_TEXT values (issue 23, memory): each such value is put
    into Arrow as a chunk of its own (its UTF-8 bytes wrapped) between runs of the ordinary values. Every
    value reads back exactly, in row order: multi-byte text, empty strings, nulls, big and small mixed in
    one column, in every text column."""
    from fleet.generation.data import store

    monkeypatch.setattr(store, "BIG_TEXT", 8)
    rows = [
        {"id": "r0", "completion": "short", "reasoning_content": None, "extra": '{"k": 1}'},
        {"id": "r1-is-a-long-id", "completion": "é漢字🙂 and then some more", "reasoning_content": "think " * 50},
        {"id": "r2", "completion": "", "reasoning_content": "", "finish_reason": "stop"},
        {"id": "r3", "completion": "x" * 8, "reasoning_content": "y" * 7, "extra": '{"long": "' + "v" * 40 + '"}'},
        {"id": "r4", "completion": "🙂" * 3, "reasoning_content": None, "finish_reason": "length-cut-long"},
        {"id": "r5", "completion": "z" * 1000, "reasoning_content": "漢" * 9},
    ]
    out = tmp_path / "out"
    with ResultStore(out, shard_rows=len(rows)) as s:
        for r in rows:
            s.add_result(r)
        assert s.counts()["committed"] == len(rows) and len(shard_paths(out)) == 1
    cols = ["id", "completion", "reasoning_content", "finish_reason", "extra"]
    got = read_results(out, cols).to_pylist()
    assert got == [{c: r.get(c) for c in cols} for r in rows]
