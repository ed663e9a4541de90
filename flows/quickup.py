"""`fleet up` on a fleet that is already up: the bring-up's run recorded without Prefect's engine.

An adopt-only `fleet up` (every server running with its spec, venv and model copy in place) did
seconds of work in ≈ 9 s on a loaded 2-core machine, 6× a `fleet status`; most of it was importing
Prefect (≈ 2.5 s of CPU alone) and its flow engine. This path imports neither: it runs the same
stage bodies as the flow's tasks (fleet/bringup.py, with `adopt_only`: a stage with work to do stops
before doing it), side by side as the flow runs them, under the same node lock, and writes the same
records through Prefect's REST API (the standard library's HTTP client): the flow run
`bringup-<fleet>` (its parameters, version, states and message), one task run per stage with its
name, key, policy and states, every artifact with the text tasks/audit.py writes (fleet/artifacts.py),
the run's log lines (also printed as Prefect prints them), and the lock's slot, lease and holder
record through the calls tasks/locks.py makes.

Anything else takes the flow's path (`refusal` says why): a config whose nodes or secrets come from
Prefect blocks, a Prefect API other than this PREFECT_HOME's local server, Prefect settings that
change a run's records, a busy or widened lock, task keys not yet learned from a run of this code.
And so does any stage with work to do or any failure here (a server down, a changed config, a smoke
that fails, a write the server refuses): nothing was changed on a node, and what this try wrote is
undone — its artifacts deleted (each key's previous version is the latest again), then its flow run
with its task runs, the lock given back — before the flow runs as always, so failures and launches
are recorded by the one path that handles them.

A `fleet generate` that re-attaches to its job's live runner runs this bring-up too, then follows the
runner (flows/quickgen.py); the task keys learned here include the `generate` task's.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleet.artifacts import artifact_key, redact_text, run_markdown, stage_description, stage_markdown, stamp, \
    table_rows
from fleet.config import FleetConfig

if TYPE_CHECKING:   # imported where used: the stages' modules (httpx among them) load while the run opens
    from fleet.stages import ServerRow, StageOutcome

ROOT = Path(__file__).resolve().parents[1]
FLOW_FILE = ROOT / "flows" / "fleet.py"
TASKS_FILE = ROOT / "tasks" / "bringup.py"
GENERATE_FILE = ROOT / "tasks" / "generate.py"
# The retry policy of every task (tasks/policy.py TASK_OPTS), as the engine records it.
TASK_POLICY = {"max_retries": 0, "retry_delay_seconds": 0.0, "retries": 2, "retry_delay": [2, 4],
               "retry_jitter_factor": 0.5}
FLOW_PARAMS = {"action": "bringup", "free_ramdisk": False, "node_wait_s": 3600.0, "input": None, "output": None,
               "retry_errors": False}
# Prefect settings that change what a run records or where it goes: with any of them set, the flow's path.
PREFECT_ENVS = ("PREFECT_API_URL", "PREFECT_API_KEY", "PREFECT_API_AUTH_STRING", "PREFECT_PROFILE",
                "PREFECT_UI_URL", "PREFECT_LOGGING_LEVEL", "PREFECT_LOGGING_TO_API_ENABLED",
                "PREFECT_LOGGING_SETTINGS_PATH", "PREFECT_TASKS_DEFAULT_RETRIES")
SETTINGS_FILES = ("prefect.toml", ".env")


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes(), usedforsecurity=False).hexdigest()


def keys_file() -> Path:
    from flows.localserver import state_dir

    return state_dir() / "task-keys.json"


def _keys_source() -> str:
    """What the task keys depend on: the task module's code and Prefect's version (its hashing)."""
    from importlib.metadata import version

    return f"{_md5(TASKS_FILE)}-{_md5(GENERATE_FILE)}-{version('prefect')}"


def save_task_keys() -> None:
    """Called by the flow's path (which has the tasks): each task's Prefect key, for the next quick run."""
    from tasks.bringup import TASKS
    from tasks.generate import generate

    path = keys_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"source": _keys_source(), "keys": {**{k: t.task_key for k, t in TASKS.items()},
                                                                 "generate": generate.task_key}}))
    tmp.replace(path)


def task_keys() -> dict[str, str] | None:
    try:
        data = json.loads(keys_file().read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("source") != _keys_source():
        return None
    keys = data.get("keys")
    return keys if isinstance(keys, dict) else None


def refusal(cfg: FleetConfig, environ: Mapping[str, str], cwd: Path, home: Path) -> str | None:
    """Why this `fleet up` must take the flow's path, or None when the quick path may try it (pure:
    the config, the environment, and which Prefect settings files exist)."""
    if not cfg.launches_servers:
        return "no servers to bring up"
    if not cfg.nodes:
        return "no nodes"
    for n in cfg.nodes:
        if n.block or n.key_secret:
            return f"node {n.name} reads its credentials from Prefect blocks"
    for name in PREFECT_ENVS:
        if environ.get(name):
            return f"{name} is set"
    if environ.get("FLEET_QUICK_UP", "1") == "0":
        return "FLEET_QUICK_UP=0"
    for name in SETTINGS_FILES:
        if (cwd / name).exists():
            return f"Prefect settings in {cwd / name}"
    pyproject = cwd / "pyproject.toml"
    if pyproject.exists() and "[tool.prefect" in pyproject.read_text(errors="replace"):
        return f"Prefect settings in {pyproject}"
    profiles = home / "profiles.toml"
    if profiles.exists() and "PREFECT_" in profiles.read_text(errors="replace"):
        return f"Prefect profile settings in {profiles}"
    return None


class Fallback(Exception):
    """The quick path stops (nothing changed on any node): the flow's path runs instead."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


class ApiError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


class Api:
    """The few Prefect REST calls a run's records need, over the standard library's HTTP client (loopback:
    this PREFECT_HOME's local server): importing httpx (and the command-line tools it loads) cost ≈ 0.5 s
    of CPU on a loaded machine, a status command's worth. One keep-alive connection per thread."""

    def __init__(self, url: str) -> None:
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.base = parts.path.rstrip("/")
        self._local = threading.local()

    def _conn(self, fresh: bool = False) -> Any:
        import http.client

        conn = getattr(self._local, "conn", None)
        if conn is None or fresh:
            if conn is not None:
                conn.close()
            conn = self._local.conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        return conn

    def call(self, method: str, path: str, body: Any = None, ok: tuple[int, ...] = ()) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        for attempt in range(6):
            try:
                conn = self._conn(fresh=attempt > 0)
                conn.request(method, self.base + "/" + path.lstrip("/"), body=data, headers=headers)
                resp = conn.getresponse()
                status, text = resp.status, resp.read().decode("utf-8", "replace")
            except (ConnectionError, OSError) as exc:   # a kept-alive connection the server closed: once more
                if attempt < 2:
                    continue
                raise ApiError(0, str(exc)) from exc
            if status == 503 and attempt < 5:   # SQLite "database is locked": as Prefect's client does
                time.sleep(0.2 * (attempt + 1))
                continue
            break
        if status in ok:
            return None
        if status >= 400:
            raise ApiError(status, text)
        return json.loads(text) if text else None

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()


def attach_running() -> str:
    """flows/localserver.py `attach` for a server that runs and answers (the common case), without the
    httpx client and TLS context its health probe builds (≈ 0.4 s of CPU here); anything else — no
    server, one starting, one that does not answer — goes through `attach` itself."""
    import fcntl
    import http.client

    import flows.localserver as ls

    d = ls.state_dir()
    rec = ls.read_record(d)
    if rec is None or not ls.is_live(rec) or not ls._listening(rec.port):
        return ls.attach()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", rec.port, timeout=5)
        conn.request("GET", "/api/health")
        healthy = conn.getresponse().status == 200
        conn.close()
    except OSError:
        healthy = False
    if not healthy or d in ls._client_fds:
        return ls.attach()
    ls.port_range(os.environ)   # a bad setting is the same error it is to attach
    fd = os.open(d / "clients.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)   # a client for this process's life, as attach makes it
    ls._client_fds[d] = fd
    (d / "used").touch()
    again = ls.read_record(d)   # the server stopped between the look and the lock: attach decides
    return rec.url if again == rec and ls.is_live(rec) else ls.attach()


@dataclass
class Line:
    """One log line of the run: printed as Prefect's console prints it, and sent to the API."""

    level: int
    message: str
    at: float
    task: TaskRec | None = None


@dataclass
class TaskRec:
    name: str
    key: str
    inputs: dict[str, list[str]]
    started: float = 0.0
    ended: float = 0.0
    id: str = field(default_factory=lambda: str(uuid.uuid4()))
    artifacts: list[dict[str, Any]] = field(default_factory=list)


class _Logger:
    """What the stage bodies log through (fleet/bringup.py `Logger`), kept for the records."""

    def __init__(self, run: QuickRun, task: TaskRec | None) -> None:
        self.run, self.task = run, task

    def info(self, msg: str, *args: Any) -> None:
        self.run.say(20, msg % args if args else msg, self.task)

    def warning(self, msg: str, *args: Any) -> None:
        self.run.say(30, msg % args if args else msg, self.task)


class QuickRun:
    """The flow run being recorded: its lines and task runs, kept until the run is known to be adopt-only."""

    def __init__(self, cfg: FleetConfig, api: Api, keys: dict[str, str], action: str = "bringup") -> None:
        self.cfg, self.api, self.keys = cfg, api, keys
        self.name = f"{action}-{cfg.name}"
        self.id: str | None = None
        self.lines: list[Line] = []
        self.posted = 0   # run.lines[:posted] are sent
        self.tasks: list[TaskRec] = []
        self.artifacts: list[dict[str, Any]] = []
        self.opening: Future[float] | None = None   # `open_run`'s
        from concurrent.futures import ThreadPoolExecutor

        self.writer = ThreadPoolExecutor(max_workers=4, thread_name_prefix="fleet-quick-api")
        self.writes: list[Future[None]] = []
        self.artifact_ids: list[str] = []
        self._said = threading.Lock()

    def say(self, level: int, message: str, task: TaskRec | None = None) -> None:
        with self._said:   # stages run side by side
            self.lines.append(Line(level, message, time.time(), task))

    def logger(self, task: TaskRec | None = None) -> _Logger:
        return _Logger(self, task)

    @property
    def run_md(self) -> str:
        return run_markdown(self.name, self.id, os.environ.get("PREFECT_UI_URL") or None)[1]

    def task(self, kind: str, name: str, **inputs: list[TaskRec]) -> TaskRec:
        rec = TaskRec(name, self.keys[kind], {k: [t.id for t in v] for k, v in inputs.items()}, started=time.time())
        with self._said:
            self.tasks.append(rec)
        return rec

    def stage(self, rec: TaskRec, key_parts: tuple[object, ...], title: str,
              body: Callable[[], tuple[Any, str | None]]) -> Any:
        """A stage as tasks/bringup.py `_audited` runs it: timed, its artifact, its "done" line."""
        t0 = time.monotonic()
        try:
            result, log = body()
        except Exception as exc:   # a stage that fails is the flow's to record (retries, FAILED artifacts)
            raise Fallback(f"{title}: {exc}") from exc
        seconds = time.monotonic() - t0
        out: StageOutcome = result
        rec.artifacts.append(self.markdown(key_parts, title, seconds, out.as_dict() | {"seconds": round(seconds, 3)},
                                           log))
        self.say(20, f"{title}: done in {seconds:.2f} s" + (" (adopted what was in place)" if out.adopted else ""),
                 rec)
        return result

    def done(self, rec: TaskRec) -> None:
        rec.ended = time.time()
        self.say(20, "Finished in state Completed()", rec)
        # Written now, while the next stages run (the server answers on the other core). A fallback
        # deletes them: the artifacts one by one (the server then makes each key's previous version the
        # latest again), then the flow run, and its task runs with it.
        self.writes.append(self.writer.submit(self._task_run, rec))

    def task_body(self, t: TaskRec) -> dict[str, Any]:
        """A task run as the engine creates it: Running, its key, policy and inputs."""
        return {"id": t.id, "name": t.name, "flow_run_id": self.id, "task_key": t.key,
                "dynamic_key": str(uuid.uuid4()), "empirical_policy": TASK_POLICY, "tags": [], "labels": {},
                "task_inputs": {k: [{"input_type": "task_run", "id": i} for i in v] for k, v in t.inputs.items()},
                "state": _state("RUNNING")}

    def _task_run(self, t: TaskRec) -> None:
        # Created Running, then Completed: the run count, start and end the engine's two transitions leave.
        self.api.call("POST", "/task_runs/", self.task_body(t))
        for art in t.artifacts:
            made = self.api.call("POST", "/artifacts/", {**art, "flow_run_id": self.id, "task_run_id": t.id})
            with self._said:
                self.artifact_ids.append(str(made["id"]))
        self.api.call("POST", f"/task_runs/{t.id}/set_state", {"state": _state("COMPLETED", ""), "force": False})

    def opened(self) -> None:
        """`open_run` has ended, however it ended: nothing of it is still to come (a lock being taken)."""
        if self.opening is not None:
            try:
                self.opening.result()
            except Exception:
                pass

    def undo(self) -> None:
        """What a fallback leaves: nothing (the lock is the caller's)."""
        self.writer.shutdown(wait=True)
        for art_id in self.artifact_ids:
            self.api.call("DELETE", f"/artifacts/{art_id}", ok=(404,))
        if self.id:
            self.api.call("DELETE", f"/flow_runs/{self.id}", ok=(404,))

    def settle(self) -> None:
        """Every write started so far has ended (raises the first one's error)."""
        for f in self.writes:
            f.result()

    def markdown(self, key_parts: tuple[object, ...], title: str, seconds: float, result: dict[str, Any],
                 log: str | None, ok: bool = True) -> dict[str, Any]:
        return {"key": artifact_key(self.cfg, *key_parts), "type": "markdown",
                "description": stage_description(self.cfg, title, self.name, ok),
                "data": stage_markdown(self.cfg, title, self.run_md, ok=ok, seconds=seconds, result=result, log=log)}

    def table(self, key_parts: tuple[object, ...], rows: list[dict[str, Any]], description: str) -> dict[str, Any]:
        return {"key": artifact_key(self.cfg, *key_parts), "type": "table",
                "description": redact_text(stamp(description, self.name), self.cfg),
                "data": json.dumps(_sanitize(table_rows(self.cfg, rows)))}


def _sanitize(item: Any) -> Any:
    """NaN as null, as Prefect's table artifact writes it."""
    if isinstance(item, list):
        return [_sanitize(i) for i in item]
    if isinstance(item, dict):
        return {k: _sanitize(v) for k, v in item.items()}
    if isinstance(item, float) and item != item:
        return None
    return item


def _state(kind: str, message: str | None = None) -> dict[str, Any]:
    return {"type": kind.upper(), "name": kind.capitalize() if kind != "COMPLETED" else "Completed",
            "message": message, "state_details": {}}


class Lock:
    """The node lock as tasks/locks.py `hold_nodes` takes it: the one-slot limits, a lease held by
    this flow run, a holder record per limit; given back (lease, then records) by `release`."""

    def __init__(self, api: Api, cfg: FleetConfig, run: QuickRun, purpose: str = "bringup") -> None:
        from tasks.locks import Once, lock_names

        self.api, self.run, self.purpose = api, run, purpose
        self.names = lock_names(cfg)
        self.lease_id: str | None = None
        self.record_ids: dict[str, str] = {}
        self.holder_value: dict[str, Any] = {}
        self._release_once = Once(self._release, "releasing the node lock")   # a signal cannot cut it short
        self._stop = threading.Event()

    def take(self) -> None:
        from tasks.locks import LEASE_S, Holder, _machine_id, _pid_start, record_name

        for name in self.names:
            resp = self.api.call("GET", f"/v2/concurrency_limits/{name}", ok=(404,))
            if not isinstance(resp, dict):
                self.api.call("POST", "/v2/concurrency_limits/", {"name": name, "limit": 1}, ok=(409,))
            elif resp.get("limit") != 1 or not resp.get("active"):
                raise Fallback(f"concurrency limit {name} is widened or disabled")   # the flow warns about it
        resp = self.api.call("POST", "/v2/concurrency_limits/increment-with-lease",
                             {"names": self.names, "slots": 1, "mode": "concurrency", "lease_duration": LEASE_S,
                              "holder": {"type": "flow_run", "id": self.run.id}}, ok=(423,))
        if not isinstance(resp, dict):
            raise Fallback("the node is held by another run")   # the flow's path waits, names the holder, reclaims
        self.lease_id = str(resp["lease_id"])
        holder = Holder(run_id=self.run.id, run_name=self.run.name, purpose=self.purpose, host=socket.gethostname(),
                        machine=_machine_id(), pid=os.getpid(), pid_start=_pid_start(os.getpid()),
                        lease_id=self.lease_id, since=time.time())
        self.holder_value = asdict(holder)
        for name in self.names:
            for _ in range(3):
                body = {"name": record_name(name), "value": {**asdict(holder), "beat": time.time()}}
                made = self.api.call("POST", "/variables/", body, ok=(409,))
                if isinstance(made, dict):
                    self.record_ids[name] = str(made["id"])
                    break
                old = self.api.call("GET", f"/variables/name/{record_name(name)}", ok=(404,))
                if isinstance(old, dict):   # a record of a run that is gone (we hold the slot): replaced
                    self.api.call("DELETE", f"/variables/{old['id']}", ok=(404,))
        threading.Thread(target=self._beat, args=(LEASE_S,), name="fleet-lock-heartbeat", daemon=True).start()

    def _beat(self, lease_s: float) -> None:
        from tasks.locks import BEAT_S

        while not self._stop.wait(BEAT_S):   # a smoke may take minutes: the lease must outlive it
            try:
                self.api.call("POST", f"/v2/concurrency_limits/leases/{self.lease_id}/renew",
                              {"lease_duration": lease_s})
            except Exception:   # one failed beat is not fatal; the next one retries
                pass

    def release(self) -> None:
        """As tasks/locks.py `_Held.release`: the slot back, then the records removed — or kept, marked
        released, for a limit whose slot may still be this lease's (`kept_records`)."""
        self._release_once()

    def _release(self) -> None:
        from tasks.locks import kept_records, record_name, release_marked

        self._stop.set()
        if not self.lease_id:
            return
        try:
            self.api.call("POST", "/v2/concurrency_limits/decrement-with-lease", {"lease_id": self.lease_id},
                          ok=(404, 410))
        except Exception:
            pass   # told by what the limit says now
        lease = self.lease_id

        def record_lease(name: str) -> Any:
            var = self.api.call("GET", f"/variables/name/{record_name(name)}", ok=(404,))
            return var["value"].get("lease_id") if isinstance(var, dict) and isinstance(var.get("value"), dict) \
                else None

        kept = kept_records(self.names, lease,
                            lambda n: int(self.api.call("GET", f"/v2/concurrency_limits/{n}")["active_slots"]),
                            record_lease)
        for name, var_id in self.record_ids.items():
            try:
                if name in kept:   # by id: a record a new holder wrote since is not touched
                    self.api.call("PATCH", f"/variables/{var_id}", {"value": release_marked(self.holder_value)},
                                  ok=(404,))
                else:
                    self.api.call("DELETE", f"/variables/{var_id}", ok=(404,))
            except Exception:
                pass   # a record left behind names a process that is gone: the next run heals it


def _bringup(run: QuickRun, lock: Lock, nodes: dict[str, Any], t0: float) -> tuple[list[ServerRow], int]:
    """flows/fleet.py `bringup`, every stage adopt-only, side by side where the flow's tasks are: the
    nodes' provisions, each node's venv and model copy, every server's launch, then its smoke."""
    from concurrent.futures import ThreadPoolExecutor

    from fleet import bringup as steps
    from fleet.servers import plan_servers
    from fleet.smoke import compare_kv
    from fleet.stages import ServerRow

    cfg = run.cfg
    run.say(20, f"{lock.purpose}: holding {', '.join(lock.names)}")
    pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="fleet-quick")

    def stage(kind: str, name: str, key_parts: tuple[object, ...] | None, title: str,
              body: Callable[[TaskRec], Any], **inputs: list[TaskRec]) -> tuple[TaskRec, Any]:
        t = run.task(kind, name, **inputs)
        if key_parts is None:   # retire: no artifact, no "done" line
            try:
                out = body(t)
            except Exception as exc:
                raise Fallback(f"{title}: {exc}") from exc
        else:
            out = run.stage(t, key_parts, title, lambda: body(t))
        run.done(t)
        return t, out

    try:
        provs = {n.name: pool.submit(stage, "provision", f"provision-{n.name}", (n.name, "provision"),
                                     f"provision {n.name}",
                                     lambda t, name=n.name: steps.provision_body(nodes[name], cfg, name),
                                     cfg=[], node_name=[])
                 for n in cfg.nodes}
        prov = {name: f.result() for name, f in provs.items()}
        prep = {}
        for n in cfg.nodes:
            pt, p = prov[n.name]
            prep[n.name] = (
                pool.submit(stage, "venv", f"venv-{n.name}", (n.name, "venv"), f"venv {n.name}",
                            lambda t, name=n.name, p=p: steps.venv_body(nodes[name], cfg, name, p, run.logger(t),
                                                                        adopt_only=True),
                            cfg=[], node_name=[], provisioned=[pt]),
                pool.submit(stage, "stage", f"stage-{n.name}", (n.name, "stage"), f"stage {n.name}",
                            lambda t, name=n.name: steps.stage_body(nodes[name], cfg, name, adopt_only=True),
                            cfg=[], node_name=[], provisioned=[pt]))
        specs: list[tuple[Any, TaskRec, TaskRec]] = []
        for n in cfg.nodes:
            (vt, v), (st, s) = prep[n.name][0].result(), prep[n.name][1].result()
            specs += [(spec, vt, st) for spec in plan_servers(cfg, cfg.node(n.name), prov[n.name][1].gpu_ids,
                                                              model_path=s.model_path, python=v.python)]
        retires = [pool.submit(stage, "retire", f"retire-{n.name}", None, f"retire {n.name}",
                               lambda t, name=n.name: steps.retire_body(
                                   nodes[name], cfg, name, [sp.index for sp, _, _ in specs if sp.node == name],
                                   run.logger(t), adopt_only=True),
                               cfg=[], node_name=[], planned=[])
                   for n in cfg.nodes if any(sp.node == n.name for sp, _, _ in specs)]
        for f in retires:
            f.result()
        run.say(20, f"launching {len(specs)} server(s) on {len(cfg.nodes)} node(s)")

        def server(spec: Any, vt: TaskRec, st: TaskRec) -> ServerRow:
            lt, lr = stage("launch", f"launch-{spec.node}-{spec.index}", (spec.node, "server", spec.index, "launch"),
                           f"launch {spec.node} server {spec.index}",
                           lambda t: steps.launch_body(nodes[spec.node], cfg, spec, adopt_only=True),
                           cfg=[], spec=[vt, st])
            _, smoked = stage("smoke", f"smoke-{spec.node}-{spec.index}", (spec.node, "server", spec.index, "smoke"),
                              f"smoke {spec.node} server {spec.index}",
                              lambda t: steps.smoke_body(nodes[spec.node], cfg, spec, lr, run.logger(t)),
                              cfg=[], spec=[vt, st], launched=[lt])
            return ServerRow(spec.node, spec.index, gpus=list(spec.gpus), port=spec.port, pid=lr.pid,
                             ready_s=lr.ready_s, kv_cache_tokens=lr.fact_int("kv_cache_tokens"),
                             max_running_requests=smoked.max_running_requests or lr.fact_int("max_running_requests"),
                             state="adopted",
                             smoke_latency_s=round(smoked.latency_s, 3) if smoked.latency_s is not None else None,
                             proof=smoked.proof)

        rows = [f.result() for f in [pool.submit(server, *sp) for sp in specs]]
    finally:
        pool.shutdown(wait=True)
    flags = compare_kv({r.label: r.kv_cache_tokens for r in rows if r.up}, cfg.smoke.kv_cache_min_ratio)
    for r in rows:
        if flags.get(r.label):
            r.flag = flags[r.label]
            run.say(30, f"{r.node} server {r.server}: {r.flag}")
    return sorted(rows, key=ServerRow.sort_key), len(rows)


def prefect_home(environ: Mapping[str, str]) -> Path:
    return Path(environ.get("PREFECT_HOME") or "~/.prefect").expanduser()


def open_run(run: QuickRun, lock: Lock, params: Mapping[str, Any] = FLOW_PARAMS) -> Future[float]:
    """The flow run created (then Running) and the node lock taken, on one of the run's writer threads:
    six calls the server answers on the other core while the command imports the stages' modules and
    connects to its nodes (≈ 0.1 s of a 1.3 s command). Its result: when the flow's clock starts
    (flows/fleet.py `_run`: in its run). A failure and a fallback wait for it (`QuickRun.opened`)
    before giving the lock back; so does a Ctrl-C's crash mark."""
    def opening() -> float:
        run.id = _flow_run(run.api, run.cfg, run.name, params)
        began = time.monotonic()
        run.say(20, f"Beginning flow run '{run.name}' for flow 'fleet'")
        lock.take()
        return began

    run.opening = run.writer.submit(opening)
    return run.opening


def warm_imports() -> None:
    """What the stages import, loaded while the run opens (`open_run`): their modules (httpx among them)
    and the HTTP transport httpx loads at its first client (httpcore, ≈ 0.13 s of CPU), which the first
    readiness poll imported with every server's stage thread waiting on it."""
    import httpcore  # noqa: F401

    import fleet.bringup  # noqa: F401


def _flow_run(api: Api, cfg: FleetConfig, name: str, params: Mapping[str, Any] = FLOW_PARAMS) -> str:
    """Create the run as Prefect's engine does (flow `fleet`, its version, every parameter), then Running."""
    flow = api.call("POST", "/flows/", {"name": "fleet"})
    body = {"flow_id": flow["id"], "flow_version": _md5(FLOW_FILE), "name": name,
            "parameters": {"config": cfg.model_dump(mode="json"), **params}, "context": {}, "tags": [],
            "parent_task_run_id": None, "state": _state("PENDING"),
            "empirical_policy": {"retries": 0, "retry_delay": 0}}
    run_id = str(api.call("POST", "/flow_runs/", body)["id"])
    api.call("POST", f"/flow_runs/{run_id}/set_state", {"state": _state("RUNNING"), "force": False})
    return run_id


def write_summary(run: QuickRun, rows: list[ServerRow], up: int, t0: float) -> None:
    """The bring-up's task runs all written, then the summary table (flows/fleet.py `_write_summary`)."""
    run.settle()
    made = run.api.call("POST", "/artifacts/", {**run.table(("summary",), [r.as_dict() for r in rows],
                                                            f"{run.cfg.name}: {up} server(s) up, 0 failure(s), "
                                                            f"{time.monotonic() - t0:.1f} s"), "flow_run_id": run.id})
    run.artifact_ids.append(str(made["id"]))


def post_lines(run: QuickRun, lines: list[Line]) -> None:
    """Log lines as Prefect's log worker sends them."""
    if lines:
        run.api.call("POST", "/logs/", [{"name": "prefect.task_runs" if ln.task else "prefect.flow_runs",
                                         "level": ln.level, "message": ln.message, "flow_run_id": run.id,
                                         "task_run_id": ln.task.id if ln.task else None,
                                         "timestamp": datetime.fromtimestamp(ln.at, timezone.utc).isoformat()}
                                        for ln in lines])


def completed(run: QuickRun, message: str) -> None:
    """The run's end as the flow's engine writes it: the on-completion hook's lines, the last line, the
    lines not yet sent, the state."""
    run.say(20, "Running hook 'clear_cause' in response to entering state 'Completed'")
    run.say(20, "Hook 'clear_cause' finished running successfully")
    run.say(20, f"Finished in state Completed('{message}')")
    post_lines(run, run.lines[run.posted:])
    run.posted = len(run.lines)
    run.api.call("POST", f"/flow_runs/{run.id}/set_state", {"state": _state("COMPLETED", message), "force": False})


def _commit(run: QuickRun, rows: list[ServerRow], up: int, t0: float) -> str:
    """Every record of the run, once it is known to be adopt-only: task runs, artifacts, logs, the end."""
    write_summary(run, rows, up, t0)
    message = f"{up} server(s) up in {time.monotonic() - t0:.1f} s"
    completed(run, message)
    return message


def _print_lines(run: QuickRun, lines: list[Line] | None = None) -> None:
    """The run's lines as Prefect's console handler prints them (stderr)."""
    names = {20: "INFO", 30: "WARNING", 40: "ERROR"}
    for ln in run.lines if lines is None else lines:
        who = f"Task run '{ln.task.name}'" if ln.task else f"Flow run '{run.name}'"
        stamp_ = time.strftime("%H:%M:%S", time.localtime(ln.at)) + f".{int(ln.at * 1000) % 1000:03d}"
        print(f"{stamp_} | {names.get(ln.level, str(ln.level)):<7} | {who} - {ln.message}", file=sys.stderr)


def quick_up(cfg: FleetConfig, environ: Mapping[str, str] = os.environ) -> tuple[bool, list[dict[str, Any]], str] | None:
    """The adopt-only `fleet up`, recorded as the flow records it; None: take the flow's path (nothing changed)."""
    if refusal(cfg, environ, Path.cwd(), prefect_home(environ)) is not None:
        return None
    keys = task_keys()
    if keys is None:   # learned from the flow's path (save_task_keys), once per version of the task code
        return None
    from fleet.interrupt import on_interrupt
    from fleet.node import connect
    from flows.api import prefect_env

    prefect_env()
    api = Api(attach_running())
    run = QuickRun(cfg, api, keys)
    lock = Lock(api, cfg, run)
    nodes: dict[str, Any] = {}
    t0 = time.monotonic()
    unregister: Callable[[], None] = lambda: None
    try:
        unregister = on_interrupt("mark the flow run crashed", lambda: _crashed(run, lock), order=50)
        opening = open_run(run, lock)
        warm_imports()
        for n in cfg.nodes:
            nodes[n.name] = connect(n)
        t0 = opening.result()
        rows, up = _bringup(run, lock, nodes, t0)
        lock.release()
        # a write the server refused (or a bug) before the run's end: undone below, and the flow runs
        message = _commit(run, rows, up, t0)
    except Exception as exc:   # Fallback; NotAdopted (a stage with work to do); a write refused; a bug
        # Nothing changed on a node; the lock, the run's states, its task runs and artifacts so far are all
        # that was written: undone (the key's previous artifact is the latest again; the task runs go with
        # their flow run).
        # best effort: the flow's path next reports what is wrong with the API
        best_effort(run.opened, lock.release, run.undo, unregister, lambda: _close(nodes), api.close)
        if environ.get("FLEET_QUICK_UP_DEBUG"):
            print(f"fleet up: the flow's path: {exc}", file=sys.stderr)
        return None
    best_effort(run.writer.shutdown, unregister, lambda: _close(nodes), api.close)
    _print_lines(run)
    return True, [r.as_dict() for r in rows], message


def best_effort(*steps: Callable[[], Any]) -> None:
    """Each step in turn, whatever the one before raised (undoing a try, closing what it opened)."""
    for step in steps:
        try:
            step()
        except Exception:
            pass


def _close(nodes: dict[str, Any]) -> None:
    for node in nodes.values():
        try:
            node.close_forwards()
            node.close()
        except Exception:
            pass


def _crashed(run: QuickRun, lock: Lock) -> None:
    """Ctrl-C, SIGTERM, SIGHUP: the slot back, the run marked as flows/api.py marks one."""
    from fleet.interrupt import stopped_by

    run.opened()   # a run still being created, a lock still being taken: marked and given back, not left
    try:
        lock.release()
    finally:
        how = stopped_by() or "interrupted"
        if run.id is None:
            return   # the run was never created: nothing to mark
        run.api.call("POST", f"/flow_runs/{run.id}/set_state",
                     {"state": _state("CRASHED", f"{how} (the command; detached servers and runners keep running)"),
                      "force": True})
