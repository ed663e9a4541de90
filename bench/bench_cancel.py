"""Prefect's Cancel of a bring-up under a process worker: where the seconds go, before and after.

    .venv/bin/python bench/bench_cancel.py --reps 3 [--before main]

One real `prefect server start` (SQLite, temp PREFECT_HOME) and one `prefect worker start` on a
process pool; three deployments, run in turn each rep (interleaved, so the machine's load falls
on all three alike):

    tiny     a stand-alone flow that sleeps in a loop (no fleet): Prefect's own floor
    before   flows/fleet.py:fleet action=bringup from `git archive <--before>` (the code before)
    after    the same from this checkout

A bring-up launches two sim servers that take 600 s to start, so its launch tasks wait in their
readiness waits (what a real bring-up does for minutes); once the lock is held and both servers are
launched (the tiny flow: once Running), `prefect flow-run cancel ID` is typed as a user would. Then,
polled every 0.1 s, from the run's Cancelling state (server timestamp):

    exit      the flow run's process gone (infrastructure_pid)
    hook      the runner's hook subprocess (`_workspace_runtime_bootstrap.py hook cancellation`:
              a new Python that imports prefect and loads the flow to look for on_cancellation
              hooks) seen alive, from/to
    Cancelled the run's first Cancelled state, and who set it (its message)
    runner    the Cancelled state Prefect's runner sets after the hook subprocess

The sim servers are killed (process groups, from their pid files) after each rep. Prints one line
per run and a median table; the load average is printed with each run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil  # type: ignore[import-untyped]

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
POOL = "bench-cancel"
TINY = """import time
from prefect import flow


@flow(name="tiny")
def tiny() -> None:
    while True:
        time.sleep(0.1)
"""
JOB_ENV = {"PREFECT_LOGGING_EXTRA_LOGGERS": "fleet", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


@dataclass
class Rec:
    kind: str
    load: float
    cli_s: float = 0.0
    exit_s: float | None = None
    hook: tuple[float, float] | None = None
    cancelled_s: float | None = None
    by: str = ""
    runner_s: float | None = None
    lock_free: bool | None = None
    states: list[str] = field(default_factory=list)


def free_base(n: int) -> int:
    while True:
        base = random.randrange(20000, 60000)
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue


def ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


class Bench:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        port = free_base(1)
        self.api = f"http://127.0.0.1:{port}/api"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        self.env.update(PREFECT_HOME=str(tmp / "home"), PREFECT_API_URL=self.api,
                        PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_WORKER_QUERY_SECONDS="1")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.log = open(tmp / "server.log", "wb")
        self.procs.append(subprocess.Popen([PY, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                            "--port", str(port)], env=self.env, stdout=self.log,
                                           stderr=subprocess.STDOUT, start_new_session=True))
        self.wait(lambda: self._healthy(), 300, "prefect server")

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.api + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    @staticmethod
    def wait(cond: Any, timeout: float, what: str, every: float = 0.2) -> Any:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            got = cond()
            if got:
                return got
            time.sleep(every)
        raise TimeoutError(what)

    def get(self, path: str) -> Any:
        r = httpx.get(self.api + path, timeout=30)
        r.raise_for_status()
        return r.json()

    def post(self, path: str, body: dict[str, Any]) -> Any:
        r = httpx.post(self.api + path, json=body, timeout=30)
        r.raise_for_status()
        return r.json()

    def cli(self, *args: str) -> str:
        return subprocess.run([PY, "-m", "prefect", *args], cwd=ROOT, env=self.env, capture_output=True,
                              text=True, timeout=300, check=True).stdout

    def start_worker(self) -> None:
        self.cli("work-pool", "create", POOL, "--type", "process")
        log = open(self.tmp / "worker.log", "wb")
        self.procs.append(subprocess.Popen([PY, "-m", "prefect", "worker", "start", "--pool", POOL], cwd=ROOT,
                                           env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))
        self.wait(lambda: self.post(f"/work_pools/{POOL}/workers/filter", {}), 120, "the worker")

    def deploy(self, name: str, flow: str, directory: Path, entrypoint: str) -> str:
        fid = self.post("/flows/", {"name": flow})["id"]
        body = {"flow_id": fid, "name": name, "entrypoint": entrypoint, "work_pool_name": POOL,
                "pull_steps": [{"prefect.deployments.steps.set_working_directory": {"directory": str(directory)}}],
                "job_variables": {"env": JOB_ENV}}
        return str(self.post("/deployments/", body)["id"])

    def close(self) -> None:
        for p in reversed(self.procs):
            for sig in (signal.SIGINT, signal.SIGINT, signal.SIGKILL):
                try:
                    os.killpg(p.pid, sig)
                    p.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    break


def sim_config(tmp: Path, name: str) -> Path:
    sys.path.insert(0, str(ROOT))
    from fleet.demo import to_toml

    model = tmp / "model"
    if not model.exists():
        model.mkdir()
        (model / "config.json").write_text("{}")
        (model / "weights.bin").write_bytes(b"w" * 50_000)
        (tmp / "ram").mkdir()
    data = {"name": name,
            "nodes": [{"name": "local", "workdir": str(tmp / name / "work"), "ramdisk": str(tmp / "ram")}],
            "engine": {"kind": "sim", "sim": {"startup_s": 600, "tokens_per_s": 5000}},
            "model": {"source": str(model), "stage_margin_gb": 0.0}, "venv": {"path": str(tmp / "venv")},
            "servers": {"count": 2, "base_port": free_base(2), "ready_timeout_s": 900, "stop_grace_s": 2},
            "smoke": {"first_timeout_s": 10, "timeout_s": 3, "attempts": 2, "backoff_s": 0.1}}
    path = tmp / f"{name}.toml"
    path.write_text(to_toml(data))
    return path


def lock_slots(b: Bench) -> int:
    out = 0
    for lim in b.post("/v2/concurrency_limits/filter", {}):
        if lim["name"].startswith("fleet-node-"):
            out += lim["active_slots"]
    return out


def hook_procs() -> list[int]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if any(c.endswith("_workspace_runtime_bootstrap.py") for c in cmd) and "hook" in cmd:
            out.append(p.pid)
    return out


def one(b: Bench, kind: str, dep: str, cfg: Path | None) -> Rec:
    rec = Rec(kind, os.getloadavg()[0])
    params = {"config": str(cfg), "action": "bringup"} if cfg else {}
    run = b.post(f"/deployments/{dep}/create_flow_run", {"parameters": params})
    rid = run["id"]
    work = cfg.parent / cfg.stem / "work" / "servers" if cfg else None

    def ready() -> bool:
        fr = b.get(f"/flow_runs/{rid}")
        assert fr["state"]["type"] in ("SCHEDULED", "PENDING", "RUNNING"), fr["state"]
        if fr["state"]["type"] != "RUNNING" or not fr["infrastructure_pid"]:
            return False
        return work is None or (lock_slots(b) == 1 and len(list(work.glob("*.pid"))) == 2)

    b.wait(ready, 600, f"{kind} run to be launching")
    pid = int(b.get(f"/flow_runs/{rid}")["infrastructure_pid"])
    t = time.time()
    b.cli("flow-run", "cancel", rid)
    rec.cli_s = time.time() - t
    hook: list[float] = []
    end = time.monotonic() + 300
    while time.monotonic() < end:
        now = time.time()
        if rec.exit_s is None and not psutil.pid_exists(pid):
            rec.exit_s = now
        if hook_procs():
            hook = [hook[0] if hook else now, now]
        states = b.get(f"/flow_run_states/?flow_run_id={rid}")
        cancelled = [s for s in states if s["type"] == "CANCELLED"]
        if cancelled and rec.cancelled_s is None:
            rec.cancelled_s, rec.by = ts(cancelled[0]["timestamp"]), cancelled[0]["message"] or ""
            if work is not None:
                rec.lock_free = lock_slots(b) == 0
        done = rec.exit_s is not None and not hook_procs() and any("successfully" in (s["message"] or "")
                                                                   for s in cancelled)
        if done or (cancelled and rec.exit_s is not None and hook and now - hook[1] > 20):
            break
        time.sleep(0.1)
    states = sorted(b.get(f"/flow_run_states/?flow_run_id={rid}"), key=lambda s: s["timestamp"])
    rec.states = [s["type"] for s in states]
    t0 = ts(next(s["timestamp"] for s in states if s["type"] == "CANCELLING"))
    runner = [s for s in states if s["type"] == "CANCELLED" and "successfully" in (s["message"] or "")]
    rec.runner_s = ts(runner[0]["timestamp"]) - t0 if runner else None
    rec.exit_s = rec.exit_s - t0 if rec.exit_s else None
    rec.cancelled_s = rec.cancelled_s - t0 if rec.cancelled_s else None
    rec.hook = (hook[0] - t0, hook[1] - t0) if hook else None
    if work is not None:
        for f in work.glob("*.pid"):
            try:
                os.killpg(int(f.read_text().split()[0]), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    return rec


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def line(r: Rec) -> str:
    hook = f"{r.hook[0]:.1f}–{r.hook[1]:.1f}" if r.hook else "-"
    return (f"| {r.kind} | {r.load:.1f} | {r.cli_s:.1f} | {fmt(r.exit_s)} | {hook} | {fmt(r.cancelled_s)} | "
            f"{r.by[:48]} | {fmt(r.runner_s)} | {'-' if r.lock_free is None else r.lock_free} |")


def archive(ref: str, dest: Path) -> Path:
    dest.mkdir()
    tar = subprocess.run(["git", "archive", ref], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=__import__("io").BytesIO(tar)) as t:
        t.extractall(dest, filter="data")
    return dest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--before", default="main", help="git ref of the code before the change")
    ap.add_argument("--kinds", default="tiny,before,after")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-cancel-"))
    (tmp / "tiny").mkdir()
    (tmp / "tiny" / "tiny.py").write_text(TINY)
    b = Bench(tmp)
    recs: list[Rec] = []
    try:
        b.start_worker()
        deps = {"tiny": b.deploy("tiny", "tiny", tmp / "tiny", "tiny.py:tiny"),
                "before": b.deploy("before", "fleet", archive(args.before, tmp / "before"), "flows/fleet.py:fleet"),
                "after": b.deploy("after", "fleet", ROOT, "flows/fleet.py:fleet")}
        print("| run | load 1 min | cancel CLI s | exit | hook subprocess | Cancelled | set by | runner's "
              "Cancelled | lock free at Cancelled |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for i in range(args.reps):
            for kind in args.kinds.split(","):
                cfg = sim_config(tmp, f"bc-{kind}-{i}") if kind != "tiny" else None
                recs.append(one(b, kind, deps[kind], cfg))
                print(line(recs[-1]), flush=True)
    finally:
        b.close()
    print("\nmedian seconds from Cancelling:")
    for kind in args.kinds.split(","):
        rs = [r for r in recs if r.kind == kind]
        if rs:
            med = {k: statistics.median([getattr(r, k) for r in rs if getattr(r, k) is not None] or [float("nan")])
                   for k in ("exit_s", "cancelled_s", "runner_s")}
            print(f"  {kind}: exit {med['exit_s']:.1f}, Cancelled {med['cancelled_s']:.1f}, "
                  f"runner's Cancelled {med['runner_s']:.1f}  ({len(rs)} runs)")
    print(json.dumps({"tmp": str(tmp)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
