"""Other people's servers (issue 33, items 1-3): a server's errors are the server's, a rate limit is
waited for, and a job never pauses silently.

Each job runs through the runner in-process (`run_local`: dispatcher, store, relaunch path) with its
servers as `[[endpoints]]`: a healthy `fleet sim` and a stand-in on loopback (bench/garbage.py) that
answers every chat with a 400, a 429, or lists no model. Waits poll with deadlines, never a sleep.
"""

from __future__ import annotations

import json
import sys
import threading
from email.utils import formatdate
from pathlib import Path
from typing import Any

import pytest

from conftest import scaled, wait_until
from fleet.config import FleetConfig
from test_gen_dispatch import sims  # noqa: F401  (the fixture is re-used)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from garbage import GOOD, GarbageServer, Reply, write_rows  # noqa: E402

CONTEXT_400 = Reply("400", status=400, body=json.dumps({"object": "error", "message": (
    "This model's maximum context length is 2048 tokens. However, you requested 2100 tokens."),
    "type": "BadRequestError", "code": 400}).encode())
VALID = Reply("valid", body=json.dumps({**GOOD, "model": "sim-model"}).encode())


def rate_limit(retry_after: str) -> Reply:
    return Reply("429", status=429, headers=(("Retry-After", retry_after),),
                 body=b'{"error":{"message":"Rate limit reached for requests","type":"rate_limit"}}')


def config(servers: list[tuple[str, str]], **generation: Any) -> FleetConfig:
    return FleetConfig(servers={"count": 0}, engine={"kind": "sim"},
                       generation={"max_tokens": 8, "max_concurrency_per_server": 4, **generation},
                       endpoints=[{"name": name, "url": url, "model": "sim-model", "engine": "sim"}
                                  for name, url in servers])


def run(cfg: FleetConfig, work: Path, rows: int, marked: frozenset[int] = frozenset(), **kw: Any) -> dict[str, Any]:
    """One job; its exit code, manifest, servers by name, and errors."""
    from fleet.generation.job.endpoints import endpoint_entries
    from fleet.generation.job.runner import run_local

    work.mkdir(parents=True, exist_ok=True)
    inp, out = work / "in.jsonl", work / "out"
    write_rows(inp, rows, marked)
    rc = run_local(cfg, inp, out, endpoint_entries(cfg), progress_interval_s=0.1, flush_interval_s=0.5,
                   dispatch={"backoff_s": 0.05, "backoff_max_s": 0.2, "recovery_backoff_s": 0.2,
                             "recovery_backoff_max_s": 0.5, "probe_interval_s": 0.05, "bounds_poll_s": 0.1}, **kw)
    manifest = json.loads((out / "manifest.json").read_text())
    errors_file = out / "errors.jsonl"
    errors = [json.loads(x) for x in errors_file.read_text().splitlines()] if errors_file.exists() else []
    return {"rc": rc, "manifest": manifest, "counts": manifest["counts"], "errors": errors, "out": out,
            "servers": {s["name"]: s for s in manifest["servers"]}}


# ---------------------------------------------------------------------------- 1. a server's 4xx

def test_a_server_answering_every_chat_with_400_is_taken_out_and_its_rows_end_on_the_healthy_one(
        tmp_path: Path, sims) -> None:
    """Protects: an endpoint answering every chat with HTTP 400 "maximum context length is 2048 tokens"
    (started with a shorter context than its peers) beside a healthy sim sent 184 of 200 rows to
    errors.jsonl and exited 0: work stealing handed it most rows because it answered fastest, each 400
    was final, and it was never taken out. Now a 4xx that another server does not give is the server's:
    the rows it refused end on the healthy sim, none in errors, and it is out with the reason; without a
    relaunch it is back only once it answers a request it refused, so few requests reach it at all."""
    good = sims("--tokens-per-s", "2000")
    bad = GarbageServer([CONTEXT_400])
    try:
        res = run(config([("good", good.url), ("bad", bad.url)]), tmp_path / "job", 80)
    finally:
        bad.close()
    assert res["rc"] == 0, res["manifest"].get("error")
    assert res["counts"]["completed"] == 80 and not res["counts"].get("errors"), res["counts"]
    b = res["servers"]["endpoint/bad"]
    assert b["requests"] == 0 and b["downs"] >= 1 and b["refusals"] >= 3, b
    assert "rows it refused were answered by other servers" in b["down_reason"], b
    assert "maximum context length is 2048" in b["down_reason"], b
    # its refusals wait for the others' verdict: a few rows bounced, not the input
    assert b["sent"] <= 4 + 3 + 4, b
    assert res["servers"]["endpoint/good"]["requests"] == 80


def test_a_400_that_two_servers_give_is_the_rows_and_no_server_is_taken_out(tmp_path: Path, sims) -> None:
    """The other side: a row over every server's context (the sim's --context-length, and the stand-in
    refusing just those rows) is the row's fault: it ends in errors after the second server's 400, each
    row once, and neither server is taken out for it."""
    good = sims("--tokens-per-s", "2000", "--context-length", "40")
    bad = GarbageServer([CONTEXT_400], only_for=b"MARKED")
    marked = frozenset({3, 9, 17})
    try:
        cfg = config([("good", good.url), ("bad", bad.url)])
        work = tmp_path / "job"
        work.mkdir()
        inp = work / "in.jsonl"
        write_rows(inp, 40, marked)
        # the marked rows are long: over the sim's context of 40 tokens too
        inp.write_text("".join(
            json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}" + (
                " MARKED" + " word" * 60 if i in marked else "")}]}) + "\n" for i in range(40)))
        from fleet.generation.job.endpoints import endpoint_entries
        from fleet.generation.job.runner import run_local

        rc = run_local(cfg, inp, work / "out", endpoint_entries(cfg), progress_interval_s=0.1, flush_interval_s=0.5,
                       dispatch={"backoff_s": 0.05, "backoff_max_s": 0.2})
    finally:
        bad.close()
    manifest = json.loads((work / "out" / "manifest.json").read_text())
    errors = [json.loads(x) for x in (work / "out" / "errors.jsonl").read_text().splitlines()]
    assert rc == 0 and manifest["counts"]["completed"] == 37 and manifest["counts"]["errors"] == 3, manifest["counts"]
    assert sorted(e["id"] for e in errors) == ["r17", "r3", "r9"], errors
    for s in manifest["servers"]:
        assert s["downs"] == 0 and s["state"] == "up", s


def test_the_same_error_stop_fires_when_every_server_gives_it(tmp_path: Path) -> None:
    """The "first 100 rows all failed with the same error" stop (a bad sampling parameter) still fires
    when every server refuses every row alike: the second server's 400 makes each the rows'."""
    a, b = GarbageServer([CONTEXT_400]), GarbageServer([CONTEXT_400])
    try:
        res = run(config([("a", a.url), ("b", b.url)]), tmp_path / "job", 130)
    finally:
        a.close()
        b.close()
    assert res["rc"] == 1 and "the first 100 rows all failed with the same error" in res["manifest"]["reason"], \
        res["manifest"]["reason"]


def test_a_row_a_server_failed_with_5xx_is_retried_on_another_before_it_is_an_error(tmp_path: Path, sims) -> None:
    """Protects: a server answering every chat with HTTP 500 at once beside a healthy sim took most rows
    (it is the fastest to answer) and their retries too, so rows spent every attempt on it and ended in
    errors before it was taken out (50 5xx in a row). Now a 5xx's retry goes to another server when one
    can take it: with two attempts per row, every row is done."""
    good = sims("--tokens-per-s", "2000")
    bad = GarbageServer([Reply("500", status=500, body=b'{"error":{"message":"Internal Server Error"}}')])
    try:
        res = run(config([("good", good.url), ("bad", bad.url)], max_attempts=2), tmp_path / "job", 60)
    finally:
        bad.close()
    assert res["rc"] == 0 and res["counts"]["completed"] == 60 and not res["counts"].get("errors"), res["counts"]
    assert res["servers"]["endpoint/good"]["requests"] == 60


# ---------------------------------------------------------------------------- 2. rate limits

def test_retry_after_parses_seconds_and_http_dates() -> None:
    from fleet.generation.hotpath.client import parse_retry_after

    assert parse_retry_after("5") == 5.0 and parse_retry_after(" 0 ") == 0.0
    assert parse_retry_after(formatdate(1_000_030.0, usegmt=True), now=1_000_000.0) == pytest.approx(30.0)
    assert parse_retry_after(formatdate(1_000_000.0, usegmt=True), now=1_000_100.0) == 0.0   # in the past
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None and parse_retry_after("-3") is None


def test_an_endpoint_that_rate_limits_is_waited_for_and_no_row_is_charged(tmp_path: Path) -> None:
    """Protects: the only endpoint answering 429 with Retry-After failed the job (its 429s charged to
    the rows' attempts, ~27 requests a second, nothing read Retry-After). Now a rate limit costs the
    row nothing: the server gets no new row until its Retry-After (an absurd one capped by
    generation.retry_after_max_s; an HTTP date read too), with a halved in-flight limit that grows back,
    and every row is done, each sent once after the limits: exactly 6 rate limits and 24 answers."""
    script = [rate_limit("3600")] * 4 + [rate_limit(formatdate(usegmt=True))] * 2
    bad = GarbageServer(script, then=VALID)
    try:
        res = run(config([("busy", bad.url)], max_attempts=1, retry_after_max_s=0.5), tmp_path / "job", 24)
        served = list(bad.served)
    finally:
        bad.close()
    assert res["rc"] == 0, res["manifest"].get("error")
    assert res["counts"]["completed"] == 24 and not res["counts"].get("errors"), res["counts"]
    assert served.count("429") == 6 and served.count("valid") == 24, served
    s = res["servers"]["endpoint/busy"]
    assert s["rate_limits"] == 6 and s["downs"] == 0, s


def test_a_server_that_only_rate_limits_past_the_bound_is_taken_out_with_that_reason(
        tmp_path: Path, sims, caplog) -> None:
    """One that rate-limits for longer than generation.rate_limit_down_s is down, with that reason, and
    the job goes on on the others."""
    good = sims("--tokens-per-s", "40")   # 60 rows take it seconds: the bound (0.3 s) passes well before
    bad = GarbageServer([rate_limit("0")])
    caplog.set_level("WARNING", logger="fleet.generation")
    try:
        res = run(config([("good", good.url), ("busy", bad.url)], rate_limit_down_s=0.3, max_attempts=1),
                  tmp_path / "job", 60)
    finally:
        bad.close()
    assert res["rc"] == 0 and res["counts"]["completed"] == 60 and not res["counts"].get("errors"), res["counts"]
    assert res["servers"]["endpoint/busy"]["downs"] >= 1, res["servers"]["endpoint/busy"]
    assert any("endpoint/busy down: rate-limited for" in r.getMessage() and "rate_limit_down_s" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


# ---------------------------------------------------------------------------- 3. no silent pause

def _job_thread(target: Any) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(target()), daemon=True)
    t.start()
    return t, result


def test_an_endpoint_never_admitted_fails_the_job_naming_model_and_says_why_on_the_console(
        tmp_path: Path, capsys) -> None:
    """Protects: four `transformers serve` endpoints without `model`, whose /v1/models answers HTTP 500
    (no Hugging Face cache), were never admitted and the job sat "paused: all servers down", 0 rows, for
    as long as it was let run, the reason only in progress.json. Now the console line names each
    server's reason at every print, and after generation.admit_max_s the job fails with the reasons
    (`model` named as the fix) and a remedy."""
    from fleet.generation.job.runner import run_local

    bad = GarbageServer([VALID], models_status=500)
    try:
        cfg = FleetConfig(servers={"count": 0}, engine={"kind": "sim"},
                          generation={"max_tokens": 8, "admit_max_s": 1.5},
                          endpoints=[{"name": "tserve", "url": bad.url, "engine": "transformers"}])
        work = tmp_path / "job"
        work.mkdir()
        write_rows(work / "in.jsonl", 10)
        from fleet.generation.job.endpoints import endpoint_entries

        t, result = _job_thread(lambda: run_local(
            cfg, work / "in.jsonl", work / "out", endpoint_entries(cfg), progress_interval_s=0.1,
            console_interval_s=0.1, console=True,
            dispatch={"recovery_backoff_s": 0.1, "recovery_backoff_max_s": 0.2, "bounds_poll_s": 0.1}))
        t.join(timeout=120)
        assert not t.is_alive(), "the job still runs: a never-admitted endpoint stalls it silently"
    finally:
        bad.close()
    assert result == [1]
    printed = capsys.readouterr().out
    assert "all servers down: endpoint/tserve: " in printed and "set `model`" in printed, printed[-2000:]
    manifest = json.loads((work / "out" / "manifest.json").read_text())
    failure = manifest["error"]
    assert failure["kind"] == "servers", failure
    assert "no server could be admitted" in failure["cause"] and "set `model`" in failure["cause"], failure
    assert "generation.admit_max_s" in failure["remedy"] and "run the same command again" in failure["remedy"]


def test_a_pause_of_servers_that_were_up_is_bounded_too(tmp_path: Path) -> None:
    """A job whose only server went away after serving rows waits paused, saying why, but not for ever:
    after generation.paused_max_s it fails with the server's reason; the rows done are kept."""
    bad = GarbageServer([Reply("slow", body=VALID.body, delay_s=0.05)])
    try:
        cfg = config([("gone", bad.url)], paused_max_s=1.0, max_concurrency_per_server=2)
        t, result = _job_thread(lambda: run(cfg, tmp_path / "job", 400))
        wait_until(lambda: len(bad.served) >= 10, timeout=60, what="rows through the server")
    finally:
        bad.close()   # gone: every connection refused from now on
    t.join(timeout=120)
    assert not t.is_alive() and result, "the job still runs"
    res = result[0]
    assert res["rc"] == 1 and res["manifest"]["error"]["kind"] == "servers", res["manifest"]["error"]
    assert "every server has been down" in res["manifest"]["reason"] and "endpoint/gone" in res["manifest"]["reason"]
    assert res["counts"]["completed"] >= 1   # what was done before is kept


def test_a_row_a_server_refused_waits_for_another_server_in_the_queue() -> None:
    """The queue's part (pure): a row refused by server "a" is not handed to a's waiting getter while
    another could take it; b's getter gets it; once no other can (skip says so), a takes it again."""
    import asyncio

    from fleet.generation.hotpath.rowqueue import Job, WorkQueue

    others_up = {"yes": True}

    async def main() -> None:
        q = WorkQueue(8)
        q.skip = lambda item, name: isinstance(item, Job) and bool(item.refused) and name in item.refused \
            and others_up["yes"]
        job = Job(req=None, refused={"a": "HTTP 400"})
        get_a = asyncio.ensure_future(q.get("a"))
        await asyncio.sleep(0)
        q.put_again(job)
        assert not get_a.done() and len(q) == 1
        assert await q.get("b") is job
        q.put_again(job)
        others_up["yes"] = False   # b went down: a is the only one left to ask
        q.rehand()
        assert await asyncio.wait_for(get_a, 5) is job
        q.put_again(Job(req=None))   # a row nobody refused: the first getter, as before
        assert (await q.get("a")).refused is None

    asyncio.run(main())


def test_the_console_line_names_the_servers_out_and_why() -> None:
    """Pure: with every server down the line gives each one's reason; with one out of two, that one."""
    from fleet.generation.job.progress import Progress

    def p(state: str, up: int, servers: list[dict[str, Any]]) -> dict[str, Any]:
        return {"rows_total": 10, "percent": 10.0, "detail": state, "state": state.split(":")[0], "rows_done": 1,
                "completed": 1, "errors": 0, "rejects": 0, "in_flight": 0, "tok_s": 0.0, "tok_s_avg": 0.0,
                "eta_s": None, "servers_up": up, "servers": servers}

    a = {"name": "endpoint/a", "state": "down", "down_reason": "not answering http://h:1/health"}
    b = {"name": "endpoint/b", "state": "recovering", "down_reason": "3 rows it refused were answered by others"}
    line = Progress.line(p("paused", 0, [a, b]))
    assert line.endswith(" | all servers down: endpoint/a: not answering http://h:1/health; "
                         "endpoint/b: 3 rows it refused were answered by others"), line
    line = Progress.line(p("running", 1, [{"name": "endpoint/c", "state": "up"}, b]))
    assert line.endswith(" | out: endpoint/b: 3 rows it refused were answered by others"), line
    # the last line too says which server was out and why (a job of seconds prints no other)
    line = Progress.line(p("done", 1, [{"name": "endpoint/c", "state": "up"}, b]))
    assert line.endswith(" | out: endpoint/b: 3 rows it refused were answered by others"), line
    assert "out:" not in Progress.line(p("done", 1, [{"name": "endpoint/c", "state": "up"}]))


# ---------------------------------------------------------------------------- through `fleet generate`

@pytest.mark.usefixtures("prefect_api")
def test_fleet_generate_sets_a_fast_failing_server_aside_and_waits_for_a_busy_one(tmp_path: Path, sims) -> None:
    """Items 1 and 2 through the command a user runs (`fleet generate`, its flow, its detached runner):
    three `[[endpoints]]` — a healthy sim, one that answers every chat with HTTP 400 "maximum context
    length" (before: most rows ended in errors.jsonl, exit 0) and one that answers its first six chats
    429 with Retry-After (before: each 429 charged to the row, the job failed). Every row ends done,
    none in errors (with max_attempts = 1, so no 429 was charged to a row); the 400 server is out with
    its reason, said in the command's output."""
    import os
    import subprocess

    from fleet.demo import to_toml

    good = sims("--tokens-per-s", "400")
    bad = GarbageServer([CONTEXT_400])
    busy = GarbageServer([rate_limit("1")] * 6, then=VALID)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    write_rows(inp, 60)
    cfg = {"name": "others", "nodes": [{"name": "local", "workdir": str(tmp_path / "work")}],
           "servers": {"count": 0}, "engine": {"kind": "sim"},
           "endpoints": [{"name": n, "url": u, "model": "sim-model", "engine": "sim", "max_in_flight": 4}
                         for n, u in (("good", good.url), ("bad", bad.url), ("busy", busy.url))],
           "generation": {"max_tokens": 8, "max_attempts": 1, "retry_after_max_s": 2}}
    path = tmp_path / "others.toml"
    path.write_text(to_toml(cfg))
    try:
        r = subprocess.run([sys.executable, "-m", "flows.cli", "generate", "-c", str(path), "--input", str(inp),
                            "--output", str(out)], cwd=ROOT, capture_output=True, text=True,
                           timeout=scaled(240), env={**os.environ, "PYTHONPATH": str(ROOT)})
        served_busy = list(busy.served)
    finally:
        bad.close()
        busy.close()
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-4000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["completed"] == 60 and not manifest["counts"].get("errors"), manifest["counts"]
    servers = {s["name"]: s for s in manifest["servers"]}
    b = servers["endpoint/bad"]
    assert b["requests"] == 0 and b["downs"] >= 1 and "maximum context length" in (b.get("down_reason") or ""), b
    # max_attempts = 1: a 429 charged to its row would have put that row in errors.jsonl
    n429 = served_busy.count("429")
    assert n429 >= 1 and servers["endpoint/busy"]["rate_limits"] == n429, (served_busy, servers["endpoint/busy"])
    assert "endpoint/bad" in text and "rows it refused were answered by other servers" in text, text[-4000:]
