"""Progress you can see at any row length (issue 37, item 3): the rate, the console line and the
ETA count generated tokens — the engines' counters, streamed events, an estimate from the rows'
age — not only finished rows, and the line shows the rows in flight and the oldest one's age.

Real parts for the end-to-end test: the flow's generate action (the session's Prefect test
server), a sim server decoding rows of minutes, the runner as a process. The pure parts (the
/metrics reader on lines the engines really printed, the ETA, the line, the estimate) below it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fleet.generation.hotpath import promtext, tokens
from fleet.generation.hotpath.hedge import Hedge
from fleet.generation.hotpath.rowqueue import Job, WorkQueue
from fleet.generation.hotpath.serverstate import Endpoint, ServerState
from fleet.generation.job.progress import Progress, eta
from test_bringup import port_block, run_logs, sim_config
from test_generate_flow import stop_everything  # noqa: F401  (the fixture is re-used)

DATA = Path(__file__).parent / "data" / "metrics"
RATE = re.compile(r"\| ([\d,]+) tok/s now, avg [\d,]+ \| ETA ")


# ----------------------------------------------------------------------------- end to end


@pytest.mark.usefixtures("prefect_api")
def test_rows_of_minutes_show_a_rate_and_an_eta_before_any_row_ends(tmp_path: Path, stop_everything) -> None:  # noqa: F811
    """Fault: rows of minutes (1,024 tokens, ~115 s each on an H200) showed `0/128 rows (0.0%), 0.0 tok/s
    now, avg 0.0, ETA None s` until the first row ended: the rate and the ETA came from finished rows
    only. Now, through the flow's generate action with rows of ~3.4 minutes (4,096 tokens at 20 tok/s),
    within 30 s of the runner's start progress.json and the flow's line show a non-zero token rate and
    an ETA while 0 rows are done, and the rows in flight with the oldest one's age; never "None"."""
    from flows.fleet import fleet

    cfg = sim_config(tmp_path, port_block(1), n=1, engine={"sim": {"startup_s": 0.3, "tokens_per_s": 20}},
                     generation={"max_tokens": 4096})
    stop_everything(cfg)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    # ignore_eos: each row decodes its whole max_tokens, 4,096 tokens at 20 tok/s (the sim's pace per row)
    inp.write_text("".join(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"q {i}"}],
                                       "ignore_eos": True}) + "\n" for i in range(3)))
    seen: dict[str, Any] = {}

    def watch(lines: list[str]) -> None:
        """Until progress.json and the flow's log both show a rate and an ETA (or the runner has run
        90 s, three times the bound), then the runner is killed: the job ends there."""
        deadline = time.monotonic() + 400   # the bring-up first, on a busy machine
        pid = None
        while time.monotonic() < deadline:
            try:
                p = json.loads((out / "progress.json").read_text())
            except (OSError, ValueError):
                p = None
            if p is not None:
                pid = p.get("pid")
                if p.get("tok_s") and p.get("eta_s") is not None and "progress" not in seen:
                    seen["progress"] = p
                line = next((ln for ln in list(lines) if (m := RATE.search(ln)) and m[1] != "0"), None)
                if line and "line" not in seen:
                    seen["line"] = line
                if ("progress" in seen and "line" in seen) or p.get("elapsed_s", 0) > 90 or \
                        p.get("state") in ("done", "stopped", "failed"):
                    break
            time.sleep(0.5)
        seen["last"] = p
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)   # a job of ten minutes is not run to its end
            except ProcessLookupError:
                pass

    with run_logs() as lines:
        watcher = threading.Thread(target=watch, args=(lines,), daemon=True)
        watcher.start()
        fleet(config=cfg, action="generate", input=str(inp), output=str(out), return_state=True)
        watcher.join(timeout=60)
    text = "\n".join(lines)
    assert "progress" in seen, (seen.get("last"), text[-3000:])
    p = seen["progress"]
    assert p["rows_done"] == 0 and p["completed"] == 0, p
    assert p["elapsed_s"] <= 30, f"a rate and an ETA only after {p['elapsed_s']} s of the runner"
    assert p["tok_s"] > 0 and p["generated_tokens"] > 0 and p["eta_s"] > 0 and p["eta_basis"] == "max_tokens", p
    assert p["rows_in_flight"] == 3 and p["oldest_in_flight_s"] is not None, p
    assert p["servers"][0]["progress"] == "metrics" and p["servers"][0]["tok_s"] > 0, p["servers"][0]
    assert "line" in seen, text[-3000:]
    line = seen["line"]
    assert " 0/3 " in line and "in flight 3, oldest " in line and "ETA ≤" in line, line
    assert "None" not in text, [ln for ln in lines if "None" in ln]


# ----------------------------------------------------------------------------- the pure parts


def test_generated_tokens_are_the_counters_that_move_as_the_engine_decodes() -> None:
    """vLLM's generation_tokens_total (every step) and SGLang's realtime decode counter count; SGLang's
    generation_tokens_total (its docs' example) moves only when a request ends, its realtime prefill
    counter and vLLM's per-request histograms are not generated tokens: none of those count."""
    read = {p.stem: promtext.generated_tokens(p.read_text()) for p in DATA.glob("*.txt")}
    assert read == {"sglang_docs": None, "sglang_multiprocess": None, "sglang_0_5_1": None,
                    "vllm_0_30": 32.0, "vllm_dp2": None}
    both = ('vllm:generation_tokens_total{engine="0"} 10.0\nvllm:generation_tokens_total{engine="1"} 5.0\n'
            'sglang:realtime_tokens_total{mode="decode",tp_rank="0"} 7.0\n'
            'sglang_realtime_tokens_total{mode="prefill_compute"} 100.0\n'
            'sglang:generation_tokens_total{model_name="m"} 1000.0\n')
    assert promtext.generated_tokens(both) == 22.0


def test_eta_from_tokens_with_its_basis_and_none_without_a_rate() -> None:
    """Rows left × tokens per row less what the rows in flight have, over the token rate: measured once
    a row ended, max_tokens before; rows per second when answers carry no token counts; no rate, no ETA."""
    kw: dict[str, Any] = {"rows_per_s": 0.0, "max_tokens": 4096}
    assert eta(128, tok_s=1000.0, rows_finished=0, completion_tokens=0, generated_tokens=24_000, **kw) == \
        ((128 * 4096 - 24_000) / 1000.0, "max_tokens")
    assert eta(64, tok_s=1000.0, rows_finished=64, completion_tokens=64_000, generated_tokens=70_000, **kw) == \
        ((64 * 1000 - 6_000) / 1000.0, "tokens")
    assert eta(10, tok_s=0.0, rows_finished=0, completion_tokens=0, generated_tokens=0, **kw) == (None, None)
    assert eta(None, tok_s=50.0, rows_finished=0, completion_tokens=0, generated_tokens=0, **kw) == (None, None)
    assert eta(10, tok_s=0.0, rows_finished=5, completion_tokens=0, generated_tokens=0, max_tokens=8,
               rows_per_s=2.0) == (5.0, "rows")
    assert eta(0, tok_s=0.0, rows_finished=5, completion_tokens=9, generated_tokens=9, **kw) == (0.0, "rows")


def _progress(**kw: Any) -> dict[str, Any]:
    p = {"state": "running", "detail": "running", "rows_total": 128, "rows_done": 0, "percent": 0.0,
         "completed": 0, "errors": 0, "rejects": 0, "in_flight": 64, "rows_in_flight": 64,
         "oldest_in_flight_s": 112.0, "tok_s": 1010.0, "tok_s_avg": 950.0, "eta_s": 1234, "eta_basis": "max_tokens",
         "servers_up": 1, "servers": [{}]}
    return {**p, **kw}


def test_the_line_says_eta_only_with_a_basis_and_shows_the_oldest_row() -> None:
    """The line of a job of long rows: rows in flight and the oldest one's age, the token rate, `ETA ≤`
    while it assumes max_tokens rows, `ETA` once measured, no ETA at all without a rate (never "None")."""
    line = Progress.line(_progress())
    assert "| in flight 64, oldest 1m52s | 1,010 tok/s now, avg 950 | ETA ≤20m34s |" in line, line
    assert "| ETA 20m34s |" in Progress.line(_progress(eta_basis="tokens"))
    none = Progress.line(_progress(tok_s=0.0, eta_s=None, eta_basis=None, oldest_in_flight_s=None))
    assert "ETA" not in none and "None" not in none and "| in flight 64 |" in none, none
    done = Progress.line(_progress(state="done", rows_done=128, in_flight=0, rows_in_flight=0, eta_s=0))
    assert "ETA" not in done and "oldest" not in done and "| avg 950 tok/s |" in done, done
    # a progress file of an older runner (no rows_in_flight, no eta_basis) still makes a line
    old = {k: v for k, v in _progress().items() if k not in ("rows_in_flight", "oldest_in_flight_s", "eta_basis")}
    assert "| in flight 64 | 1,010 tok/s now, avg 950 | ETA 20m34s |" in Progress.line(old)


def test_estimate_without_counters_is_age_times_the_row_rate_bounded_and_never_goes_back() -> None:
    """A server without token counters: each row in flight counts its age × the per-row rate last seen
    (another server's while it has answered none), at most its max_tokens, at least its streamed
    events; a row that ends shorter than its estimate takes nothing back."""

    async def run() -> None:
        a, b, c = (ServerState(Endpoint(f"n/{i}", f"http://{i}", "m")) for i in range(3))
        hedge = Hedge(0.05, [a, b, c], WorkQueue(8), lambda s: False, lambda: False, 100)
        from fleet.generation.hotpath.client import Outcome

        hedge.note(b, Outcome("ok", completion_tokens=50, latency_s=5.0))   # 10 tok/s a row, on b
        b.completion_tokens = 50
        job = Job(req=type("R", (), {"id": "r1", "params": {}})())
        f = hedge.start(a, job)
        now = f.t0 + 3.0
        assert tokens.count([a, b], hedge, now) == pytest.approx(30.0 + 50.0)
        assert a.generated == pytest.approx(30.0) and tokens.in_flight(hedge, now) == (1, pytest.approx(3.0))
        assert tokens.count([a, b], hedge, f.t0 + 60.0) == pytest.approx(100.0 + 50.0), "at most max_tokens"
        hedge.end(f)
        a.completion_tokens = 20   # it ended at 20 tokens: the count keeps the 100 already shown
        assert tokens.count([a, b], hedge, f.t0 + 61.0) == pytest.approx(100.0 + 50.0)
        assert tokens.in_flight(hedge, f.t0 + 61.0) == (0, None)
        # streamed: a row's events are a floor under its estimate (and max_tokens a ceiling)
        g = hedge.start(c, Job(req=type("R", (), {"id": "r2", "params": {}})()))
        g.chunks = 40
        assert tokens.count([c, b], hedge, g.t0 + 1.0) == pytest.approx(40.0 + 50.0)
        # an engine counter: the first reading is a baseline, a restart counts from zero
        tokens.note_reading(b, 1000.0)
        tokens.note_reading(b, 1300.0)
        tokens.note_reading(b, 40.0)
        assert b.gen_counted == 340.0 and tokens.count([b], hedge, now) == 340.0

    asyncio.run(run())


def test_a_multinode_job_has_a_token_eta_before_its_first_row_ends() -> None:
    """Fault: the multi-node line's ETA came from rows finished since the controller started: `ETA ?`
    for as long as the first rows of minutes ran. Now it sums its running nodes' token rates and
    their in-flight tokens, and says `ETA ≤` while no row has finished; no rate, no ETA."""
    from fleet.generation.multinode.progress import format_line, job_eta

    running = [{"this_run": {"completed": 0}, "completion_tokens": 0, "generated_tokens": 6_000},
               {"this_run": {"completed": 0}, "completion_tokens": 0, "generated_tokens": 4_000}]
    assert job_eta(100, running, tok_s=500.0, rows_per_s=0.0, max_tokens=1024) == \
        ((100 * 1024 - 10_000) / 500.0, "max_tokens")
    assert job_eta(100, running, tok_s=0.0, rows_per_s=0.0, max_tokens=1024) == (None, None)
    p = {"rows_done": 0, "rows_total": 100, "percent": 0.0, "chunks": {"running": 2}, "chunks_total": 4,
         "nodes": [{"node": "a", "state": "running", "rows_done": 0, "share": 0.0, "rows_per_s": 0.0}],
         "rows_per_s": 0.0, "tok_s": 500.0, "eta_s": 185, "eta_basis": "max_tokens", "rows_in_flight": 16,
         "oldest_in_flight_s": 75.0}
    assert format_line(p).endswith("| in flight 16, oldest 1m15s | 0.0 rows/s | 500 tok/s | ETA ≤3m05s"), format_line(p)
    assert "ETA" not in format_line({**p, "eta_s": None, "tok_s": 0.0})
