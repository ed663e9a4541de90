"""`<out>/progress.json` and the console line of a running job, rewritten every
`progress_interval_s` from the dispatcher's counters and the store's, for whoever watches
(the flow's task, `fleet status`, a human with `cat`).

The rate and the ETA count generated tokens, the rows still in flight included
(`fleet.generation.hotpath.tokens`), so rows of minutes show progress before the first one
ends: ETA = (rows left × tokens per row − tokens already generated for the rows in flight) ÷
the token rate, with tokens per row measured from this run's finished rows, or, before any
has finished, every row taken to run to max_tokens (the line says `ETA ≤`). No rate, no ETA.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleet.generation.data.durable import write_json_atomic
from fleet.generation.job.jobspec import JobSpec

if TYPE_CHECKING:
    from fleet.generation.hotpath.dispatch import Dispatcher

__all__ = ["PROGRESS_FILE", "Progress", "eta", "fmt_s"]

FINAL = ("done", "stopped", "failed")

PROGRESS_FILE = "progress.json"


def fmt_s(s: float | None) -> str:
    if s is None:
        return "?"
    s = int(s)
    if s >= 86400:
        return f"{s // 86400}d{s % 86400 // 3600}h"
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s"


def eta(rows_left: int | None, *, tok_s: float, rows_per_s: float, rows_finished: int, completion_tokens: float,
        generated_tokens: float, max_tokens: int) -> tuple[float | None, str | None]:
    """(seconds to the end, its basis) — basis "tokens": tokens per row measured from `rows_finished`
    rows; "max_tokens": none finished yet, each row taken to run to `max_tokens` (an upper bound of
    a single-turn row); "rows": answers that carry no token counts, finished rows per second.
    (None, None) without a rate to divide by."""
    if rows_left is None:
        return None, None
    if rows_left == 0:
        return 0.0, "rows"
    if rows_finished and not completion_tokens:   # a server whose answers have no usage
        return (rows_left / rows_per_s, "rows") if rows_per_s > 0 else (None, None)
    if tok_s <= 0:
        return None, None
    per_row, basis = (completion_tokens / rows_finished, "tokens") if rows_finished else (float(max_tokens), "max_tokens")
    in_flight = max(0.0, generated_tokens - completion_tokens)   # the rows in flight have this much already
    return max(0.0, rows_left * per_row - in_flight) / tok_s, basis


class Progress:
    """progress.json and the console line, from the dispatcher's counters and the store's."""

    def __init__(self, job: JobSpec, store: Any, started_at: float) -> None:
        self.job = job
        self.store = store
        self.rows_total: int | None = None
        self.started_at = started_at
        self.path = Path(job.output) / PROGRESS_FILE
        self._lock = threading.Lock()   # the writes and the end's heartbeat
        self._last: dict[str, Any] | None = None

    def build(self, disp: Dispatcher, state: str | None = None) -> dict[str, Any]:
        snap = disp.snapshot()
        counts = self.store.counts()   # the truth, across every run into this directory
        completed, errors, rejects = counts["completed"], counts["errors"], counts["rejects"]
        quality_rejects = counts.get("quality_rejects", 0)
        done = completed + errors + rejects + quality_rejects
        total = self.rows_total
        remaining = None if total is None else max(0, total - done)
        rows_per_s = snap["completed"] + snap["errors"]
        rows_per_s = rows_per_s / snap["elapsed_s"] if snap["elapsed_s"] > 0 else 0.0
        eta_s, eta_basis = eta(remaining, tok_s=snap["tok_s"], rows_per_s=rows_per_s, rows_finished=snap["completed"],
                               completion_tokens=snap["completion_tokens"], generated_tokens=snap["generated_tokens"],
                               max_tokens=disp.gen.max_tokens)
        st = state or snap["state"]
        return {
            "state": st.split(":")[0] if not st.startswith("paused") else "paused",
            "detail": st, "reason": snap["reason"],
            "pid": os.getpid(), "started_at": self.started_at, "updated_at": time.time(),
            "elapsed_s": snap["elapsed_s"],
            "input": self.job.input, "output": self.job.output,
            "rows_total": total, "rows_done": done, "completed": completed, "errors": errors,
            "rejects": rejects, "quality_rejects": quality_rejects,
            "committed": counts.get("committed"), "shards": counts.get("shards"),
            "percent": round(100 * done / total, 2) if total else None,
            "this_run": {k: snap[k] for k in ("fed", "completed", "errors", "rejects", "retries", "requeues")},
            "in_flight": snap["in_flight"], "rows_in_flight": snap["rows_in_flight"],
            "oldest_in_flight_s": snap["oldest_in_flight_s"], "queued": snap["queued"],
            "tok_s": snap["tok_s"], "tok_s_avg": snap["tok_s_avg"],
            "rows_per_s": round(rows_per_s, 2), "eta_s": round(eta_s) if eta_s is not None else None,
            "eta_basis": eta_basis,
            "prompt_tokens": snap["prompt_tokens"], "completion_tokens": snap["completion_tokens"],
            "generated_tokens": snap["generated_tokens"],
            "servers_up": snap["servers_up"], "hedge": snap["hedge"], "servers": snap["servers"],
        }

    def write(self, disp: Dispatcher, state: str | None = None) -> dict[str, Any]:
        data = self.build(disp, state)
        self.put(data)
        return data

    def put(self, data: dict[str, Any]) -> None:
        """Write `data` as progress.json; the end's heartbeat rewrites this, never an older one."""
        with self._lock:
            write_json_atomic(self.path, data, sync=False)
            self._last = data

    @contextmanager
    def beating(self, every_s: float) -> Iterator[None]:
        """For the run's end (its data checks, the last commit, the upload of its shards to a store):
        the last progress rewritten every `every_s` with a fresh updated_at. The ticker has stopped by
        then, and a multi-node controller took an end longer than node_lost_s (a chunk's upload on a
        busy machine, 21 s) for a stalled runner: its node lost, its finished chunk run again
        elsewhere. A frozen runner (SIGSTOP) beats no more; each step of the end is bounded on its own
        (the store client's timeouts)."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(every_s):
                with self._lock:
                    if self._last is None:
                        continue
                    data = {**self._last, "updated_at": time.time()}
                    try:
                        write_json_atomic(self.path, data, sync=False)
                    except OSError:   # a full disk, the output removed: the end reports those itself
                        continue
                    self._last = data

        t = threading.Thread(target=beat, name="fleet-progress-beat", daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join(timeout=every_s + 5)

    @staticmethod
    def line(p: dict[str, Any], prefix: str = "[fleet generate]") -> str:
        """The one console line of a job's progress (the runner's log, the flow's log): `prefix` first."""
        total = p["rows_total"]
        pct = f" ({p['percent']:.1f}%)" if p["percent"] is not None else ""
        final = p["state"] in FINAL
        oldest = p.get("oldest_in_flight_s")
        if p.get("eta_s") is None or final:
            eta_part = ""   # no rate yet: no ETA rather than a guess
        else:
            eta_part = f" | ETA {'≤' if p.get('eta_basis') == 'max_tokens' else ''}{fmt_s(p['eta_s'])}"
        return (f"{prefix} {p['detail']} | {p['rows_done']:,}/{total:,}{pct}" if total is not None else
                f"{prefix} {p['detail']} | {p['rows_done']:,}/?") + (
            f" | ok {p['completed']:,} err {p['errors']:,} rej {p['rejects']:,}"
            + (f" gated {p['quality_rejects']:,}" if p.get("quality_rejects") else "")
            + f" | in flight {p.get('rows_in_flight', p['in_flight'])}"   # rows: a row and its backup count once
            + (f", oldest {fmt_s(oldest)}" if oldest is not None and not final else "")
            # two rates, named: the last minute's (tok_s) and this run's average (tok_s_avg), which
            # in the final line is the manifest's throughput.completion_tok_s
            + (f" | avg {p['tok_s_avg']:,.0f} tok/s" if final else
               f" | {p['tok_s']:,.0f} tok/s now, avg {p['tok_s_avg']:,.0f}") + eta_part
            + f" | servers up {p['servers_up']}/{len(p['servers'])}") + _servers_out(p)


def _servers_out(p: dict[str, Any]) -> str:
    """Why servers are out, on the console line: each one's reason when every server is down (a
    pause never silent), else the first one taken out (the job goes on without it; its last line
    still says which one was out and why)."""
    out = [s for s in p["servers"] if s.get("state") in ("down", "recovering")]
    if not out:
        return ""
    if not p["servers_up"] and p["state"] not in FINAL:
        return " | all servers down: " + "; ".join(f"{s['name']}: {(s.get('down_reason') or s['state'])[:300]}"
                                                    for s in out)
    more = f" (+{len(out) - 1} more)" if len(out) > 1 else ""
    return f" | out: {out[0]['name']}: {(out[0].get('down_reason') or out[0]['state'])[:200]}{more}"
