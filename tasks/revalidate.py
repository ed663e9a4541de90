"""Re-validation of a running fleet: process, health, smoke and log verdict, never a relaunch.

For every server the launch records name (and every index `servers.count` expects but
no record has), in this order, stopping at the first thing that rules the server out:

    process alive (pid file + /proc, zombies count as dead)
    -> GET the engine's ready path (e.g. /health) answers 200
    -> one chat completion through the smoke client (the server is warm: every attempt
       uses smoke.timeout_s), answer with content and usage
    and always: the log (its head and tail) classified by the engine's rules; a fatal
    line makes the server unhealthy even while its process lives.

Each server leaves an artifact `<fleet>-<node>-server-<i>-revalidate`; the run leaves a
table `<fleet>-revalidate`. The flow ends Failed naming every unhealthy server. A node
the fleet was torn down on (its teardown marker, and none of the fleet's servers alive)
is not checked: its row says "nothing is up (torn down at …)", and when every node is so
the run ends Completed with that message (tasks/teardown.py).
"""

from __future__ import annotations

import posixpath
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from prefect import get_run_logger, task
from prefect.futures import PrefectFuture

from fleet.config import FleetConfig, NodeConfig
from fleet.engines import ServerSpec, get_profile
from fleet.errors import FleetError, ServerFailed
from fleet.node import Node
from fleet.servers import excerpt, record_smoke, records, server_paths
from fleet.smoke import ServerWatch, smoke
from fleet.staging import staged_path
from flows.outcome import RunFailed, failed
from tasks.audit import write_stage, write_table
from tasks.nodes import node_for
from tasks.policy import TASK_OPTS
from tasks.teardown import describe, torn_down

HEAD_BYTES = 256_000     # startup facts (KV cache, ready line) are at the start of the log
TAIL_BYTES = 1_000_000   # a crash is at the end; a multi-day log is never read whole

REVALIDATE_COLUMNS = ["node", "server", "port", "pid", "state", "process", "health", "smoke_latency_s",
                      "log_verdict", "kv_cache_tokens", "problem"]


@dataclass
class ServerCheck:
    """What re-validation found for one server."""

    node: str
    index: int
    port: int | None
    pid: int | None
    process: str = "not checked"        # alive | dead | no pid file | no launch record
    health: str = "not checked"         # "200" or what answered instead
    smoke_latency_s: float | None = None
    log_verdict: str = "not checked"    # ready | starting | failed | no log
    kv_cache_tokens: int | None = None
    problems: list[str] = field(default_factory=list)
    log_excerpt: str = ""
    seconds: float = 0.0

    @property
    def healthy(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("log_excerpt")
        d["healthy"] = self.healthy
        return d

    def row(self) -> dict[str, Any]:
        return {"node": self.node, "server": self.index, "port": self.port, "pid": self.pid,
                "state": "healthy" if self.healthy else "unhealthy", "process": self.process,
                "health": self.health, "smoke_latency_s": self.smoke_latency_s, "log_verdict": self.log_verdict,
                "kv_cache_tokens": self.kv_cache_tokens, "problem": "; ".join(self.problems) or None}

    def label(self) -> str:
        return f"{self.node} server {self.index}" + (f" (port {self.port})" if self.port else "")


def spec_from_record(cfg: FleetConfig, node_cfg: NodeConfig, rec: dict[str, Any]) -> ServerSpec:
    """The ServerSpec a launch record stands for, enough to address and smoke the server."""
    source = cfg.model.source
    model_path = staged_path(source, node_cfg.ramdisk) if cfg.model.stage and source else source
    return ServerSpec(
        node=node_cfg.name, index=int(rec.get("index", 0)), gpus=tuple(rec.get("gpus") or ()),
        host=rec.get("host") or cfg.servers.host, port=int(rec.get("port") or 0), model_path=model_path,
        served_name=rec.get("model") or cfg.model.name, python=posixpath.join(cfg.venv.path, "bin", "python"),
        workdir=node_cfg.workdir, api_key=cfg.api_key(),
    )


def read_log(node: Node, path: str) -> str:
    """Head and tail of a log in one round trip; the whole log when it is small."""
    script = ('[ -f "$1" ] || exit 3; n=$(wc -c < "$1"); if [ "$n" -le $(($2 + $3)) ]; then cat "$1"; '
              'else head -c "$2" "$1"; printf "\\n… (%s bytes omitted) …\\n" $((n - $2 - $3)); tail -c "$3" "$1"; fi')
    res = node.run(["sh", "-c", script, "fleet-log", path, str(HEAD_BYTES), str(TAIL_BYTES)], check=False, timeout=60)
    return res.stdout if res.exit_code == 0 else ""


def _health(url: str, path: str, api_key: str | None, timeout: float) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url + path, headers=headers, timeout=timeout)
    except httpx.TimeoutException:
        return f"timeout after {timeout:g} s"
    except httpx.HTTPError as exc:
        return type(exc).__name__
    return str(r.status_code) if r.status_code == 200 else f"HTTP {r.status_code}"


def check_server(node: Node, cfg: FleetConfig, node_cfg: NodeConfig, rec: dict[str, Any]) -> ServerCheck:
    """Re-validate one recorded server. Never raises for an unhealthy server: it says why."""
    t0 = time.monotonic()
    profile = get_profile(cfg.engine.kind)
    spec = spec_from_record(cfg, node_cfg, rec)
    paths = server_paths(node_cfg.workdir, cfg.name, spec.index)
    pid = node.read_pid(paths.pid)
    check = ServerCheck(node_cfg.name, spec.index, spec.port or None, pid)

    if pid is None:
        check.process = "no pid file"
        check.problems.append("no pid file: stopped (teardown or `fleet down`)")
    elif not node.is_alive(pid):
        check.process = "dead"
        check.problems.append(f"process {pid} is not running")
    else:
        check.process = "alive"
        host = "127.0.0.1" if spec.host in ("0.0.0.0", "::", "localhost") else spec.host
        url = node.local_url(spec.port, host)
        check.health = _health(url, profile.ready_path, spec.api_key, min(cfg.smoke.timeout_s, 30.0))
        if check.health != "200":
            check.problems.append(f"{profile.ready_path} answered {check.health}")
        else:
            # The server is warm: no first-request allowance.
            warm = cfg.smoke.model_copy(update={"first_timeout_s": cfg.smoke.timeout_s})
            try:
                watch = ServerWatch.start(node, pid, paths.log, profile.classify, index=spec.index, port=spec.port,
                                          secrets=[spec.api_key])
                res = smoke(url, profile.request_model(spec), warm, node=node_cfg.name, index=spec.index,
                            api_key=spec.api_key, temperature=cfg.generation.temperature, watch=watch)
                check.smoke_latency_s = round(res.latency_s or 0.0, 3)
                record_smoke(node, cfg, spec, {"ok": True, "at": time.time(), "latency_s": res.latency_s,
                                               "by": "revalidate"})
            except ServerFailed as exc:
                check.problems.append(exc.reason)
                record_smoke(node, cfg, spec, {"ok": False, "at": time.time(), "error": exc.reason[:500],
                                               "by": "revalidate"})

    text = read_log(node, paths.log)
    if not text:
        check.log_verdict = "no log"
    else:
        verdict = profile.classify(text)
        check.log_verdict = verdict.state
        kv = verdict.facts.get("kv_cache_tokens")
        check.kv_cache_tokens = int(kv) if isinstance(kv, int | float) else None
        if verdict.fatal and not any("fatal log line" in p for p in check.problems):  # once, not twice
            check.problems.append(f"fatal log line: {(verdict.reason or '')[:300]}")
        check.log_excerpt = excerpt(text, 10, 40, [spec.api_key])
    check.seconds = round(time.monotonic() - t0, 3)
    return check


def missing_servers(cfg: FleetConfig, node_cfg: NodeConfig, recs: list[dict[str, Any]]) -> list[ServerCheck]:
    """Servers the config expects (servers.count) that no launch record names."""
    count = node_cfg.servers if node_cfg.servers is not None else cfg.servers.count
    if count is None:
        return []  # one per GPU: the count is the node's, known only to a preflight
    have = {int(r.get("index", -1)) for r in recs}
    out = []
    for i in range(count):
        if i not in have:
            c = ServerCheck(node_cfg.name, i, cfg.servers.port_for(i, node_cfg), None, process="no launch record")
            c.problems.append("never launched (no launch record): run the bringup deployment")
            out.append(c)
    return out


# -------------------------------------------------------------------- Prefect layer


@task(name="revalidate-inventory", task_run_name="inventory-{node_name}", **TASK_OPTS)
def inventory(cfg: FleetConfig, node_name: str) -> dict[str, Any]:
    """The launch records of this fleet on the node, and its teardown marker when nothing of it runs."""
    node_cfg = next(n for n in cfg.nodes if n.name == node_name)
    node = node_for(cfg, node_name)
    recs = records(node, node_cfg.workdir, cfg.name)
    marker = torn_down(node, node_cfg, cfg.name)
    if marker is not None:
        for rec in recs:
            pid = node.read_pid(server_paths(node_cfg.workdir, cfg.name, int(rec.get("index", 0))).pid)
            if pid is not None and node.is_alive(pid):
                marker = None  # something runs again (started outside a bring-up): check everything
                break
    return {"records": recs, "torn_down": marker}


@task(name="revalidate", task_run_name="revalidate-{node_name}-{record[index]}", **TASK_OPTS)
def revalidate_server(cfg: FleetConfig, node_name: str, record: dict[str, Any]) -> Any:
    """Check one server and write its artifact; the task ends Failed (with its row) when it is unhealthy."""
    node_cfg = next(n for n in cfg.nodes if n.name == node_name)
    check = check_server(node_for(cfg, node_name), cfg, node_cfg, record)
    title = f"revalidate {node_name} server {check.index}"
    error = None if check.healthy else "\n".join(check.problems)
    write_stage(cfg, (node_name, "server", check.index, "revalidate"), title, ok=check.healthy,
                seconds=check.seconds, result=check.as_dict(), error=error, log=check.log_excerpt)
    if not check.healthy:
        get_run_logger().error("%s: unhealthy: %s", check.label(), "; ".join(check.problems))
        return failed(f"{check.label()}: " + "; ".join(check.problems), check.row())
    get_run_logger().info("%s: healthy (smoke %.2f s)", check.label(), check.smoke_latency_s or 0)
    return check.row()


def _outcome(fut: PrefectFuture) -> tuple[Any, str | None]:
    """(result, None) when completed; (row or None, why) when not. Never raises."""
    fut.wait()
    state = fut.state
    if state.is_completed():
        return fut.result(), None
    data = fut.result(raise_on_failure=False)
    if isinstance(data, RunFailed):
        data = data.data
    if isinstance(data, dict):  # an unhealthy server: its row, and the state's message
        return data, state.message or "unhealthy"
    if isinstance(data, FleetError):
        return None, data.reason
    if isinstance(data, BaseException):
        return None, str(data).splitlines()[0][:500]
    return None, f"task ended {state.name}"


def revalidate(cfg: FleetConfig) -> tuple[list[dict[str, Any]], list[str]]:
    """Re-validate every server of every node; (table rows, one line per unhealthy server)."""
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    inventories = {n.name: inventory.submit(cfg, n.name) for n in cfg.nodes}
    checks: dict[PrefectFuture, tuple[str, dict[str, Any]]] = {}
    blank = {c: None for c in REVALIDATE_COLUMNS}
    for node_cfg in cfg.nodes:
        inv, err = _outcome(inventories[node_cfg.name])
        if err:
            rows.append(blank | {"node": node_cfg.name, "server": "-", "state": "unreachable", "problem": err})
            failures.append(f"{node_cfg.name}: {err}")
            continue
        recs = inv["records"]
        if inv["torn_down"]:
            rows.append(blank | {"node": node_cfg.name, "server": "-", "state": "torn down",
                                 "problem": f"nothing is up ({describe(inv['torn_down'])})"})
            continue
        for missing in missing_servers(cfg, node_cfg, recs):
            rows.append(missing.row())
            failures.append(f"{missing.label()}: {'; '.join(missing.problems)}")
        if not recs and cfg.servers.count is None:
            why = f"no servers of fleet {cfg.name!r} recorded: run the bringup deployment"
            rows.append(blank | {"node": node_cfg.name, "server": "-", "state": "unhealthy", "problem": why})
            failures.append(f"{node_cfg.name}: {why}")
        for rec in recs:
            checks[revalidate_server.submit(cfg, node_cfg.name, rec)] = (node_cfg.name, rec)
    for fut, (node_name, rec) in checks.items():
        row, err = _outcome(fut)
        label = f"{node_name} server {rec.get('index')} (port {rec.get('port')})"
        if row is None:  # the check itself could not run (node lost mid-way)
            row = blank | {"node": node_name, "server": rec.get("index"), "port": rec.get("port"),
                           "state": "unknown", "problem": err}
        rows.append(row)
        if err:
            failures.append(err if err.startswith(node_name) else f"{label}: {err}")
    rows.sort(key=lambda r: (r["node"], -1 if r["server"] == "-" else r["server"]))
    up = sum(1 for r in rows if r["state"] == "healthy")
    down = [r for r in rows if r["state"] == "torn down"]
    write_table(cfg, ("revalidate",), rows, f"revalidation of {cfg.name}: {up} healthy, {len(failures)} unhealthy"
                + (f", {len(down)} node(s) torn down" if down else ""))
    return rows, failures

