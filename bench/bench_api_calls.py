"""What each REST call of a quick `fleet up` costs the local Prefect server (issue 37, item 2).

    .venv/bin/python bench/bench_api_calls.py [--calls 40]

Starts (or attaches to) this PREFECT_HOME's local server (flows/localserver.py), creates one flow
run, then sends each kind of call the quick path sends (flows/quickup.py: a task run created
Running, its artifact, its Completed state; a lock's holder record written and removed; a batch of
log lines), `--calls` of each one after another from one thread, and prints the server's CPU per call
(its /proc stat before and after, and again 1.5 s later for what its background services do after)
and the wall per call. GET /health is the floor: routing and middleware. The run is deleted at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flows.localserver import attach, read_record, state_dir  # noqa: E402
from flows.quickup import TASK_POLICY, Api, _state  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=40)
    n = ap.parse_args().calls
    api = Api(attach())
    rec = read_record(state_dir())
    assert rec is not None

    def cpu() -> float:
        f = Path(f"/proc/{rec.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

    flow = api.call("POST", "/flows/", {"name": "bench-api-calls"})
    run = api.call("POST", "/flow_runs/", {"flow_id": flow["id"], "name": "bench-api-calls",
                                           "state": _state("PENDING"), "parameters": {}})
    api.call("POST", f"/flow_runs/{run['id']}/set_state", {"state": _state("RUNNING"), "force": False})
    ids = [str(uuid.uuid4()) for _ in range(n)]

    def measure(what: str, call: Callable[[int], object]) -> None:
        time.sleep(1.0)   # what the previous kind set off in the background, out of this one's figure
        c0, t0 = cpu(), time.monotonic()
        for i in range(n):
            call(i)
        c1, t1 = cpu(), time.monotonic()
        time.sleep(1.5)
        c2 = cpu()
        print(f"| {what} | {1000 * (c1 - c0) / n:.1f} | {1000 * (c2 - c0) / n:.1f} | {1000 * (t1 - t0) / n:.1f} |",
              flush=True)

    def record(i: int) -> None:
        made = api.call("POST", "/variables/", {"name": f"bench-api-calls-{uuid.uuid4().hex[:12]}", "value": {"i": i}})
        api.call("DELETE", f"/variables/{made['id']}")

    print(f"{n} calls of each kind, one after another; server pid {rec.pid}; load {os.getloadavg()[0]:.2f}\n")
    print("| call | server CPU ms per call | with the 1.5 s after | wall ms per call |\n| --- | --- | --- | --- |")
    measure("GET /health", lambda i: api.call("GET", "/health"))
    measure("POST /task_runs/ (Running)", lambda i: api.call("POST", "/task_runs/", {
        "id": ids[i], "name": f"t{i}", "flow_run_id": run["id"], "task_key": "bench", "dynamic_key": str(i),
        "empirical_policy": TASK_POLICY, "state": _state("RUNNING")}))
    measure("POST /artifacts/ (2 KB markdown)", lambda i: api.call("POST", "/artifacts/", {
        "key": f"bench-api-calls-{i}", "type": "markdown", "data": "x" * 2000, "flow_run_id": run["id"],
        "task_run_id": ids[i]}))
    measure("POST /task_runs/{id}/set_state (Completed)", lambda i: api.call(
        "POST", f"/task_runs/{ids[i]}/set_state", {"state": _state("COMPLETED", ""), "force": False}))
    measure("POST /variables/ + DELETE (a lock's holder record)", record)
    measure("POST /logs/ (5 lines)", lambda i: api.call("POST", "/logs/", [
        {"name": "bench", "level": 20, "message": "m", "flow_run_id": run["id"],
         "timestamp": "2026-12-04T00:00:00+00:00"}] * 5))
    api.call("DELETE", f"/flow_runs/{run['id']}")


if __name__ == "__main__":
    main()
