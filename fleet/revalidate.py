"""Re-validation of one running server: process, health, smoke and log verdict, never a relaunch.

In this order, stopping at the first thing that rules the server out:

    process alive (pid file + /proc, zombies count as dead)
    -> GET the engine's ready path (e.g. /health) answers 200
    -> one chat completion through the smoke client (the server is warm: every attempt
       uses smoke.timeout_s), answer with content and usage
    and always: the log (its head and tail) classified by the engine's rules; a fatal
    line makes the server unhealthy even while its process lives.

`fleet status --check` runs it directly; the `revalidate` action of the flow runs it as one
Prefect task per server (tasks/revalidate.py) and writes the artifacts.
"""

from __future__ import annotations

import posixpath
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from fleet.config import FleetConfig, NodeConfig
from fleet.engines import ServerSpec, get_profile
from fleet.errors import ServerFailed
from fleet.net import tls_context
from fleet.node import Node
from fleet.servers import excerpt, record_smoke, records, server_paths
from fleet.smoke import ServerWatch, smoke

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
    process: str = "not checked"        # alive | stopped | dead | no pid file | no launch record
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


def _model_path_before_records(cfg: FleetConfig, node_cfg: NodeConfig) -> str:
    """What a server launched before its record named the model path serves: the source, or the copy
    fleet then staged to RAMDISK/<source directory name>."""
    source = cfg.model.source
    if not (cfg.model.stage and source):
        return source
    return posixpath.join(node_cfg.ramdisk.rstrip("/") or "/", posixpath.basename(source.rstrip("/")))


def spec_from_record(cfg: FleetConfig, node_cfg: NodeConfig, rec: dict[str, Any]) -> ServerSpec:
    """The ServerSpec a launch record stands for, enough to address and smoke the server."""
    model_path = rec.get("model_path") or _model_path_before_records(cfg, node_cfg)
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
        r = httpx.get(url + path, headers=headers, timeout=timeout, verify=tls_context(url))
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
    elif (state := node.process_state(pid)) == "dead":
        check.process = "dead"
        check.problems.append(f"process {pid} is not running")
    elif state == "stopped":
        # It cannot answer: no health request that waits out its timeout on it.
        check.process = "stopped"
        check.problems.append(f"process {pid} is stopped (SIGSTOP): `kill -CONT -{pid}` on the node, or `fleet down`")
    else:
        check.process = "alive"
        url = node.local_url(spec.port, spec.connect_host)
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


def check_node(node: Node, cfg: FleetConfig, node_cfg: NodeConfig) -> list[ServerCheck]:
    """Every recorded server of this fleet on the node checked in turn, then the ones never launched."""
    recs = records(node, node_cfg.workdir, cfg.name)
    checks = [check_server(node, cfg, node_cfg, rec) for rec in recs]
    return sorted(checks + missing_servers(cfg, node_cfg, recs), key=lambda c: c.index)
