"""Launch, adopt, watch and stop inference servers on a node.

Each server is a detached process with three files in `<workdir>/servers/`:
`<fleet>-<i>.log` (its output), `.pid`, and `.json` — the launch record: the command
(secrets redacted), a hash of the full launch spec, port, GPUs, start time, and the last
smoke result. A live server whose record has the same hash is adopted, not relaunched.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from fleet.config import FleetConfig, NodeConfig
from fleet.engines import LogVerdict, ServerSpec, get_profile
from fleet.errors import FleetError, JobConflict, ServerFailed, ServerNotReady
from fleet.interrupt import check_stop
from fleet.jobs import live_jobs
from fleet.net import tls_context
from fleet.node import Node, describe
from fleet.preflight import parse_listening_ports, servers_on_node
from fleet.workdir import ensure_workdir

REDACTED = "***"


@dataclass(frozen=True)
class ServerPaths:
    log: str
    pid: str
    record: str


def server_paths(workdir: str, fleet: str, index: int) -> ServerPaths:
    base = f"{workdir.rstrip('/')}/servers/{fleet}-{index}"
    return ServerPaths(log=f"{base}.log", pid=f"{base}.pid", record=f"{base}.json")


def plan_servers(cfg: FleetConfig, node_cfg: NodeConfig, gpu_ids: list[int], *, model_path: str,
                 python: str) -> list[ServerSpec]:
    """One ServerSpec per server on this node: GPUs split in groups of tensor_parallel, ports from the base."""
    tp = cfg.servers.tensor_parallel
    count = servers_on_node(cfg, len(gpu_ids), node_cfg)
    specs = []
    for i in range(count):
        gpus = tuple(gpu_ids[i * tp:(i + 1) * tp]) if gpu_ids else ()
        specs.append(ServerSpec(
            node=node_cfg.name, index=i, gpus=gpus, host=cfg.servers.host, port=cfg.servers.port_for(i, node_cfg),
            model_path=model_path, served_name=cfg.model.name, python=python, workdir=node_cfg.workdir,
            api_key=cfg.api_key(), extra_args=tuple(cfg.servers.extra_args_by_index.get(i, ())),
        ))
    return specs


def redact(items: list[str], secrets: list[str | None]) -> list[str]:
    """The argv with secret values replaced, for logs, records and artifacts."""
    live = [s for s in secrets if s]
    out = []
    for item in items:
        for s in live:
            item = item.replace(s, REDACTED)
        out.append(item)
    return out


def launch_hash(argv: list[str], env: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps([argv, sorted(env.items())]).encode()).hexdigest()[:16]


def upload_sim_script(node: Node, workdir: str) -> None:
    """Put the simulator on the node: one stdlib-only zip (`fleet.sim.bundle`), built from
    package resources, not paths (the runner on an SSH node imports fleet from a zip file)."""
    import tempfile

    from fleet.sim.bundle import build_pyz

    with tempfile.NamedTemporaryFile(suffix=".pyz") as tmp:
        tmp.write(build_pyz())
        tmp.flush()
        node.put(tmp.name, f"{workdir.rstrip('/')}/bin/fleet_sim.pyz")


@dataclass
class LaunchResult:
    node: str
    index: int
    port: int
    gpus: list[int]
    pid: int
    adopted: bool
    replaced_pid: int | None
    command: str
    log_path: str
    seconds: float
    replaced_port: int | None = None   # the port the replaced server listened on (its record's)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def replaced(self) -> str | None:
        """The summary table's word for a replacement: "replaced (port 35600 → 35601)", None when none."""
        if self.replaced_pid is None:
            return None
        if self.replaced_port is not None and self.replaced_port != self.port:
            return f"replaced (port {self.replaced_port} → {self.port})"
        return f"replaced (pid {self.replaced_pid} → {self.pid}: new launch spec)"


def read_record(node: Node, paths: ServerPaths) -> dict[str, Any]:
    text = node.read_text(paths.record)
    try:
        return json.loads(text) if text else {}
    except json.JSONDecodeError:
        return {}


def listening_ports(node: Node) -> set[int]:
    res = node.run(["sh", "-c", "cat /proc/net/tcp /proc/net/tcp6 2>/dev/null"], check=False, timeout=30)
    return parse_listening_ports(res.stdout)


def _own_port_taken(verdict: LogVerdict, port: int) -> bool:
    """The server could not bind its own port (not an engine's internal one: ZMQ, torch's store)."""
    return any(label == "port-in-use" and str(port) in entry.splitlines()[0]
               for entry, label in zip(verdict.fatal, verdict.fatal_labels, strict=False))


def _taken_port_remedy(node: Node, cfg: FleetConfig, port: int) -> str:
    """The ports free now, as `fleet up`'s port check names them (preflight.port_remedy). A bind
    error repeated four times and "(memory fraction, port, GPU)" told a person nothing to do."""
    from fleet.preflight import port_remedy

    try:
        listening = listening_ports(node)
    except FleetError:
        listening = set()
    n = cfg.servers.count or len(cfg.servers.ports or []) or 1
    return port_remedy(cfg, [port], listening | {port}, n) + ", then re-run"


def _refuse_if_in_use(node: Node, cfg: FleetConfig, spec: ServerSpec, pid: int, index: int | None = None,
                      port: int | None = None) -> None:
    index = spec.index if index is None else index
    for job in live_jobs(node, spec.workdir, cfg.name):
        if any(s.get("index") == index and s.get("node") in (None, spec.node) for s in job.servers):
            raise JobConflict(
                f"server {index} (pid {pid}, port {port or spec.port}) runs with another launch spec and is in use "
                f"by the generation job writing {job.output} (runner pid {job.pid} on node {job.node}): replacing it "
                f"would pull it from under that job; {job.stop_hint()}",
                host=node.host,
                remedy="once that job has ended, run this command again to apply the new spec — or put the config "
                       "back as it was",
            )


def recorded_pid(node: Node, workdir: str, fleet: str, rec: dict[str, Any]) -> int | None:
    """The live process a launch record names, found by its pid file (pid and start time) and the
    port the record says it was started with — never the port the config asks for now: after a
    changed servers.base_port the old server, looked for on the new port, was taken for a reused
    pid and left running, unrecorded, beside its replacement (issue 33)."""
    paths = server_paths(workdir, fleet, int(rec.get("index", 0)))
    pid = node.read_pid(paths.pid, expect=_expect(rec))
    return pid if pid is not None and node.is_alive(pid) else None


def _free_port_of_peer(node: Node, cfg: FleetConfig, spec: ServerSpec) -> None:
    """The port this server needs is held by another server this fleet recorded on the node (the
    ports moved: base_port 35600 → 35601 puts server 0 on server 1's old port): that server's own
    spec changed with it, so it is stopped here, not taken for another program's."""
    for rec in records(node, spec.workdir, cfg.name):
        if int(rec.get("index", -1)) == spec.index or _record_port(rec) != spec.port:
            continue
        pid = recorded_pid(node, spec.workdir, cfg.name, rec)
        if pid is not None:
            _refuse_if_in_use(node, cfg, spec, pid, index=int(rec["index"]), port=spec.port)
            node.stop(pid, grace_s=cfg.servers.stop_grace_s)


def _record_port(rec: dict[str, Any]) -> int | None:
    return int(rec["port"]) if str(rec.get("port", "")).isdigit() else None


def retire_unplanned(node: Node, cfg: FleetConfig, node_cfg: NodeConfig, planned: set[int],
                     dry_run: bool = False) -> list[dict[str, Any]]:
    """Stop the recorded servers of this fleet on the node whose slot the config no longer plans
    (servers.count lowered, fewer GPUs): one server per slot the config names, none left running
    on GPUs the remaining slots may now be given. Their pid file and record go with them, so
    `fleet status` shows no ghost. A server a live generation job uses is refused (JobConflict)."""
    out: list[dict[str, Any]] = []
    for rec in records(node, node_cfg.workdir, cfg.name):
        index = int(rec.get("index", -1))
        if index in planned or rec.get("node") not in (None, node_cfg.name):
            continue
        pid = recorded_pid(node, node_cfg.workdir, cfg.name, rec)
        if dry_run:   # what would be retired, nothing stopped or removed
            out.append({"node": node_cfg.name, "index": index, "port": _record_port(rec), "pid": pid})
            continue
        if pid is not None:
            for job in live_jobs(node, node_cfg.workdir, cfg.name):
                if any(s.get("index") == index and s.get("node") in (None, node_cfg.name) for s in job.servers):
                    raise JobConflict(
                        f"server {index} (pid {pid}, port {rec.get('port')}) is no longer in the config "
                        f"(servers.count) but the generation job writing {job.output} uses it; {job.stop_hint()}",
                        host=node.host, remedy="once that job has ended, run this command again — or put "
                                               "servers.count back as it was")
            node.stop(pid, grace_s=cfg.servers.stop_grace_s)
        paths = server_paths(node_cfg.workdir, cfg.name, index)
        node.run(["rm", "-f", "--", paths.pid, paths.record], check=False, timeout=30)
        out.append({"node": node_cfg.name, "index": index, "port": _record_port(rec), "pid": pid})
    return out


def _same_launch(record: dict[str, Any], key: str, spec: ServerSpec) -> bool:
    """The recorded server was started with this very spec (command, env, port): `launch` adopts it."""
    return record.get("hash") == key and _record_port(record) == spec.port


@dataclass
class _Slot:
    """What `launch` reads of a server's slot before it decides: its record and live pid, and the command
    it would start now (its hash is what the record must say for the live server to be adopted)."""

    record: dict[str, Any]
    pid: int | None
    argv: list[str]
    env: dict[str, str]
    key: str
    shown: str
    secrets: list[str | None]


def _slot(node: Node, cfg: FleetConfig, spec: ServerSpec) -> _Slot:
    ensure_workdir(node, spec.workdir, create=False)   # checked once per node; never trust another's records
    profile = get_profile(cfg.engine.kind)
    argv = [str(a) for a in profile.argv(cfg, spec)]
    env = dict(profile.env(cfg, spec))
    secrets = [spec.api_key, *cfg.secrets()]
    record = read_record(node, server_paths(spec.workdir, cfg.name, spec.index))
    pid = recorded_pid(node, spec.workdir, cfg.name, record | {"index": spec.index})
    return _Slot(record, pid, argv, env, launch_hash(argv, env), describe(redact(argv, secrets)), secrets)


def _adoption(cfg: FleetConfig, spec: ServerSpec, slot: _Slot, t0: float) -> LaunchResult | None:
    if slot.pid is None or not _same_launch(slot.record, slot.key, spec):
        return None
    return LaunchResult(spec.node, spec.index, spec.port, list(spec.gpus), slot.pid, True, None, slot.shown,
                        server_paths(spec.workdir, cfg.name, spec.index).log, time.monotonic() - t0)


def adopted(node: Node, cfg: FleetConfig, spec: ServerSpec) -> LaunchResult | None:
    """What `launch` returns when it adopts: the live server of this slot started with this very spec;
    None where `launch` would start or replace one. It only reads (the adopt-only bring-up's launch:
    one look at the slot, where asking `launch` after a check looked twice — three node round trips
    per server, each an SSH exchange on a remote node)."""
    t0 = time.monotonic()
    return _adoption(cfg, spec, _slot(node, cfg, spec), t0)


def launch(node: Node, cfg: FleetConfig, spec: ServerSpec) -> LaunchResult:
    """Start the server for `spec`, or adopt the live one already started with the same spec.

    One server per slot: a live server of this slot started with any other spec (port, flags,
    model, GPUs) is found by its record, stopped and replaced; a server of another slot of this
    fleet on the port this one needs is stopped too (its spec moved with the ports)."""
    t0 = time.monotonic()
    ensure_workdir(node, spec.workdir)
    profile = get_profile(cfg.engine.kind)
    paths = server_paths(spec.workdir, cfg.name, spec.index)
    slot = _slot(node, cfg, spec)
    found = _adoption(cfg, spec, slot, t0)
    if found is not None:
        return found
    argv, env, key, shown, secrets, record, pid = (slot.argv, slot.env, slot.key, slot.shown, slot.secrets,
                                                  slot.record, slot.pid)
    replaced = replaced_port = None
    if pid is not None:
        # Same slot, different spec (config changed): replace it rather than run two on one GPU —
        # unless a generation job is using it: pulling a server from under a live runner makes the
        # two fight over the slot (the runner relaunches its own spec).
        _refuse_if_in_use(node, cfg, spec, pid, port=_record_port(record))
        node.stop(pid, grace_s=cfg.servers.stop_grace_s)
        replaced, replaced_port = pid, _record_port(record)

    listening = listening_ports(node)
    if spec.port in listening:
        _free_port_of_peer(node, cfg, spec)
        listening = listening_ports(node)
    if spec.port in listening:
        from fleet.preflight import port_remedy

        # Not a server this fleet recorded in its workdir (that one was adopted or stopped above):
        # another user's fleet on a shared machine, or another program. Never take it over.
        raise ServerFailed(
            f"server {spec.index}: port {spec.port} is already in use by another process (not a server of "
            f"fleet {cfg.name!r} recorded in {spec.workdir}: another user's fleet, or another program)",
            host=node.host,
            remedy=port_remedy(cfg, [spec.port], listening, max(cfg.servers.count or 1, spec.index + 1)),
        )
    if cfg.engine.kind == "sim":
        upload_sim_script(node, spec.workdir)
    # Keep the previous log for the post-mortem; the new one starts with the exact command.
    node.run(["sh", "-c", 'umask 077; mkdir -p -- "$(dirname -- "$1")"; [ -f "$1" ] && mv -f -- "$1" "$1.prev"; '
              'printf "%s\\n" "$2" > "$1"', "fleet-log", paths.log, f"# fleet launch: {shown}"], timeout=30)
    rec: dict[str, Any] = {
        "fleet": cfg.name, "node": spec.node, "index": spec.index, "port": spec.port, "host": spec.host,
        "gpus": list(spec.gpus), "pid": None, "hash": key, "engine": cfg.engine.kind,
        "command": redact(argv, secrets), "env": profile.shown_env(cfg, env), "started_at": time.time(),
        "log": paths.log, "model": spec.served_name, "model_path": spec.model_path,
    }
    # The record names the new port before the process starts: were fleet killed between the start
    # and the record, the pid file would name a process that the old record (old port) disowns —
    # a live server that `fleet down` and the next `fleet up` never see.
    node.write_text(paths.record, json.dumps(rec, indent=2))
    det = node.start_detached(argv, log_path=paths.log, pid_path=paths.pid, env=env, cwd=spec.workdir)
    node.write_text(paths.record, json.dumps(rec | {"pid": det.pid, "started_at": time.time()}, indent=2))
    return LaunchResult(spec.node, spec.index, spec.port, list(spec.gpus), det.pid, False, replaced, shown,
                        paths.log, time.monotonic() - t0, replaced_port)


@dataclass
class ReadyResult:
    node: str
    index: int
    url: str
    seconds: float
    verdict: LogVerdict
    log_excerpt: str = ""

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["verdict"] = self.verdict.as_dict()
        return d


def excerpt(text: str, head: int = 15, tail: int = 40, secrets: list[str | None] | None = None) -> str:
    """Head and tail of a log, secrets redacted: enough to diagnose, small enough for an artifact."""
    lines = text.splitlines()
    if len(lines) > head + tail:
        lines = lines[:head] + [f"… ({len(lines) - head - tail} lines omitted) …"] + lines[-tail:]
    return "\n".join(redact(lines, secrets or []))


def wait_ready(node: Node, cfg: FleetConfig, spec: ServerSpec, pid: int, *,
               timeout: float | None = None, poll_s: float = 0.5) -> ReadyResult:
    """Poll readiness while watching the process and its log; a death or a fatal line fails at once."""
    t0 = time.monotonic()
    profile = get_profile(cfg.engine.kind)
    paths = server_paths(spec.workdir, cfg.name, spec.index)
    url = node.local_url(spec.port, spec.connect_host)
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    deadline = t0 + (timeout or cfg.servers.ready_timeout_s)
    text = ""
    last_http = "no answer yet"
    with httpx.Client(timeout=5.0, headers=headers, verify=tls_context(url)) as client:
        while True:
            check_stop(f"the readiness wait of server {spec.index} on port {spec.port}")
            state, new = node.watch(pid, paths.log, len(text.encode()))
            text += new
            verdict = profile.classify(text)
            if verdict.fatal and _own_port_taken(verdict, spec.port):
                raise ServerFailed(
                    f"server {spec.index} on port {spec.port}: the port was taken after fleet's check, before the "
                    f"server bound it (address already in use, {time.monotonic() - t0:.1f} s after the launch)",
                    host=node.host, remedy=_taken_port_remedy(node, cfg, spec.port))
            if verdict.fatal:
                raise ServerFailed(
                    f"server {spec.index} on port {spec.port}: fatal log line after "
                    f"{time.monotonic() - t0:.1f} s: {(verdict.reason or '')[:300]}",
                    host=node.host, stderr=excerpt(text, 5, 25, [spec.api_key, *cfg.secrets()]),
                    remedy=f"read {paths.log} on the node; fix the cause (memory fraction, port, GPU) and re-run",
                )
            if state == "dead":
                raise ServerFailed(
                    f"server {spec.index} on port {spec.port}: process {pid} exited after "
                    f"{time.monotonic() - t0:.1f} s before becoming ready",
                    host=node.host, stderr=excerpt(text, 5, 25, [spec.api_key, *cfg.secrets()]),
                    remedy=f"read {paths.log} on the node for the cause",
                )
            if state == "stopped":
                # SIGSTOP: it serves nothing until someone continues it; a failed server (its peers
                # go on), never a wait of ready_timeout_s.
                raise ServerFailed(
                    f"server {spec.index} on port {spec.port}: process {pid} is stopped (SIGSTOP)",
                    host=node.host, stderr=excerpt(text, 5, 15, [spec.api_key, *cfg.secrets()]),
                    remedy=f"continue it (`kill -CONT -{pid}` on the node) or stop it (`fleet down`), then re-run",
                )
            try:
                r = client.get(url + profile.ready_path)
                if r.status_code == 200:
                    # The log above was read before this answer: lines printed in between (the
                    # KV cache size, max_running_requests come just before readiness) belong in
                    # the facts, so read up to now.
                    _, new = node.watch(pid, paths.log, len(text.encode()))
                    text += new
                    verdict = profile.classify(text)
                    return ReadyResult(spec.node, spec.index, url, time.monotonic() - t0, verdict,
                                       excerpt(text, secrets=[spec.api_key, *cfg.secrets()]))
                last_http = f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                last_http = type(exc).__name__
            if time.monotonic() > deadline:
                raise ServerNotReady(
                    f"server {spec.index} on port {spec.port}: alive but not ready after "
                    f"{time.monotonic() - t0:.0f} s ({profile.ready_path}: {last_http})",
                    host=node.host, stderr=excerpt(text, 5, 15, [spec.api_key, *cfg.secrets()]),
                    remedy="raise servers.ready_timeout_s if the model is large, or read the log for a stall",
                )
            time.sleep(poll_s)


@dataclass
class ServerState:
    node: str
    index: int
    port: int
    pid: int | None
    state: str            # running | dead | stopped
    up_s: float | None
    gpus: list[int] = field(default_factory=list)
    last_smoke: dict[str, Any] | None = None
    log: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_LIST_RECORDS = r"""
for f in "$1"/servers/"$2"-*.json; do [ -f "$f" ] || continue; echo "@@$f"; cat "$f"; echo; done
"""


def records(node: Node, workdir: str, fleet: str) -> list[dict[str, Any]]:
    """Every launch record of this fleet on the node (one round trip)."""
    from fleet.preflight import split_sections

    # A record or pid file in a directory another user can write is theirs to forge.
    if not ensure_workdir(node, workdir, create=False):
        return []
    res = node.run(["sh", "-c", _LIST_RECORDS, "fleet-records", workdir.rstrip("/"), fleet], check=False, timeout=60)
    out = []
    for _, body in sorted(split_sections(res.stdout).items()):
        try:
            out.append(json.loads(body))
        except json.JSONDecodeError:
            continue
    return sorted(out, key=lambda r: r.get("index", 0))


def states(node: Node, cfg: FleetConfig, node_cfg: NodeConfig) -> list[ServerState]:
    out = []
    now = time.time()
    for rec in records(node, node_cfg.workdir, cfg.name):
        paths = server_paths(node_cfg.workdir, cfg.name, int(rec.get("index", 0)))
        pid = node.read_pid(paths.pid, expect=_expect(rec))
        alive = pid is not None and node.is_alive(pid)
        state = "running" if alive else ("stopped" if pid is None else "dead")
        out.append(ServerState(node_cfg.name, int(rec.get("index", 0)), int(rec.get("port", 0)), pid, state,
                               (now - rec["started_at"]) if alive and rec.get("started_at") else None,
                               list(rec.get("gpus", [])), rec.get("smoke"), paths.log))
    return out


def _expect(rec: dict[str, Any]) -> str | None:
    """What the command line of a record's process must contain: its port."""
    return f"--port {int(rec['port'])}" if str(rec.get("port", "")).isdigit() else None


def record_smoke(node: Node, cfg: FleetConfig, spec: ServerSpec, smoke: dict[str, Any]) -> None:
    paths = server_paths(spec.workdir, cfg.name, spec.index)
    rec = read_record(node, paths)
    if rec:
        rec["smoke"] = smoke
        node.write_text(paths.record, json.dumps(rec, indent=2))


def stop_jobs(node: Node, cfg: FleetConfig, node_cfg: NodeConfig) -> list[dict[str, Any]]:
    """Stop every generation runner of this fleet alive on the node, before its servers: a live
    runner relaunches a server stopped under it, so a teardown that stopped only the servers left
    them running (and billed) again moments later. SIGTERM is the runner's clean stop (in-flight
    rows finish within its stop_grace_s, committed rows stay; the same `fleet generate` resumes);
    SIGKILL only past that grace. Idempotent. A workdir another user can write is refused first
    (ConfigError), as `records` refuses it: a runner.pid planted there would name what is killed."""
    out: list[dict[str, Any]] = []
    if not ensure_workdir(node, node_cfg.workdir, create=False):
        return out
    for job in live_jobs(node, node_cfg.workdir, cfg.name):
        result: dict[str, Any] = {"node": node_cfg.name, "pid": job.pid, "output": job.output}
        try:
            # a stopped (SIGSTOP) runner acts on SIGTERM only once continued: else it sat out the
            # whole grace and was SIGKILLed, never the clean stop
            node.run(["sh", "-c", 'kill -CONT "-$1" 2>/dev/null || kill -CONT "$1"', "fleet-cont", str(job.pid)],
                     check=False, timeout=30)
            st = node.stop(job.pid, grace_s=job.stop_grace_s + 15)
            result["action"] = "killed" if st.killed else ("stopped" if st.was_running else "already gone")
            result["seconds"] = round(st.seconds, 2)
        except FleetError as exc:
            result["action"] = f"error: {exc.one_line()}"
        out.append(result)
    return out


def stop_servers(node: Node, cfg: FleetConfig, node_cfg: NodeConfig) -> list[dict[str, Any]]:
    """Stop every server of this fleet on the node (whole process groups); idempotent."""
    out = []
    for rec in records(node, node_cfg.workdir, cfg.name):
        paths = server_paths(node_cfg.workdir, cfg.name, int(rec.get("index", 0)))
        pid = node.read_pid(paths.pid, expect=_expect(rec))
        result: dict[str, Any] = {"node": node_cfg.name, "index": rec.get("index"), "port": rec.get("port"),
                                  "pid": pid, "action": "none"}
        if pid is not None:
            try:
                st = node.stop(pid, grace_s=cfg.servers.stop_grace_s)
                result["action"] = "killed" if st.killed else ("stopped" if st.was_running else "already gone")
                result["seconds"] = round(st.seconds, 2)
            except FleetError as exc:
                result["action"] = f"error: {exc.one_line()}"
                out.append(result)
                continue
            node.run(["rm", "-f", paths.pid], check=False, timeout=30)
        out.append(result)
    return out
