"""The generation runner: the data-plane process that pushes one job through the servers.

    python -m fleet.generation.runner --job JOB.json

It runs next to the servers (on the GPU node), started detached like them, so it keeps
going when the controlling flow or the SSH connection dies. It owns the output directory
(the store's lock), skips ids already done, streams the rest of the input through the
`Dispatcher`, commits shards every `flush_interval_s`, and rewrites `<out>/progress.json`
every `progress_interval_s` for whoever watches (the flow's task, `fleet status`, a human
with `cat`). SIGTERM/SIGINT: stop taking rows, let the in-flight ones finish (bounded by
`stop_grace_s`), commit, write the manifest, exit 0. SIGKILL is the crash case: whatever
was committed stays, resume sends the rest again.

JOB.json (`JobSpec`):

    {
      "config": {...},                 # FleetConfig as a dict (servers.api_key left out)
      "input": "/data/prompts.jsonl",
      "output": "/data/out",
      "servers": [                     # one per server, see `ServerEntry`
        {"node": "gpu1", "index": 0, "url": "http://127.0.0.1:30000", "model": "qwen",
         "api_key_env": "FLEET_API_KEY", "gpus": [0], "max_running_requests": 64,
         "spec": {...ServerSpec fields but api_key...}}      # spec: only to relaunch it
      ],
      "retry_errors": false,
      "relaunch": true,                # relaunch a dead server with its spec (else: wait for it)
      "flush_interval_s": 30, "progress_interval_s": 2, "console_interval_s": 5,
      "stop_grace_s": 60,
      "dispatch": {"down_after": 3, "backoff_s": 1.0}   # optional Dispatcher options
    }

The API key is never in the file: it comes from the environment variable each server
entry names (default FLEET_API_KEY).

Exit codes: 0 every row fed ended in results/errors/rejects, or a clean stop on a
signal; 1 the job failed (a store that cannot write, an unreadable input, every row
refused alike); 2 it could not start (bad job file, output locked by another runner).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from fleet.config import FleetConfig
from fleet.generation.dispatch import Dispatcher, Endpoint, Summary
from fleet.generation.jobdir import EXIT_FILE

if TYPE_CHECKING:
    from fleet.generation.manifest import RunFacts
    from fleet.generation.store import ResultStore

log = logging.getLogger("fleet.generation")

__all__ = ["JobSpec", "ServerEntry", "main", "run_job", "run_local"]

PROGRESS_FILE = "progress.json"


@dataclass
class ServerEntry:
    """One server of the job, as JOB.json lists it."""

    node: str
    index: int
    url: str                                   # base URL as seen from the runner (on the node)
    model: str                                 # the "model" requests carry (engines.get_profile(kind).request_model(spec))
    api_key_env: str = "FLEET_API_KEY"         # environment variable that holds the API key
    gpus: list[int] = field(default_factory=list)
    max_running_requests: int | None = None    # from the launch log, when /server_info does not say
    spec: dict[str, Any] | None = None         # ServerSpec fields except api_key: enables relaunch

    @property
    def name(self) -> str:
        return f"{self.node}/{self.index}"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ServerEntry:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


@dataclass
class JobSpec:
    config: dict[str, Any]
    input: str
    output: str
    servers: list[ServerEntry]
    retry_errors: bool = False
    relaunch: bool = True
    flush_interval_s: float = 30.0
    progress_interval_s: float = 2.0
    console_interval_s: float = 5.0
    stop_grace_s: float = 60.0
    dispatch: dict[str, Any] = field(default_factory=dict)   # Dispatcher keyword options (backoff_s, down_after, ...)

    @classmethod
    def load(cls, path: str | Path) -> JobSpec:
        d = json.loads(Path(path).read_text())
        d["servers"] = [ServerEntry.from_dict(s) for s in d.get("servers") or []]
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _fleet_config(data: dict[str, Any]) -> FleetConfig:
    """The job's config, with the API key put back from the environment (never from the file)."""
    data = json.loads(json.dumps(data))
    servers = data.setdefault("servers", {})
    servers.pop("api_key", None)
    key = os.environ.get("FLEET_API_KEY")
    if key:
        servers["api_key"] = key
    # engine.env values arrive masked in the file; the real ones come from the environment
    # (fleet.generation.remote.runner_secret_env), so a relaunch gets the real HF_TOKEN & co.
    env_json = os.environ.get("FLEET_ENGINE_ENV")
    if env_json:
        data.setdefault("engine", {})["env"] = json.loads(env_json)
    return FleetConfig(**data)


# ---------------------------------------------------------------------------- the node side


_T = TypeVar("_T")


async def _in_daemon_thread(fn: Callable[..., _T], *args: Any) -> _T:
    """Run blocking `fn` in a daemon thread: unlike asyncio.to_thread, a stop never waits for it
    (a relaunch can sit in wait_ready for minutes; the server it starts is detached anyway)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[_T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            (fut.set_result if ok else fut.set_exception)(value)

    def target() -> None:
        try:
            res = fn(*args)
        except BaseException as exc:  # handed to the awaiting task
            try:
                loop.call_soon_threadsafe(settle, False, exc)
            except RuntimeError:   # the loop is gone: nobody is waiting any more
                pass
            return
        try:
            loop.call_soon_threadsafe(settle, True, res)
        except RuntimeError:
            pass

    threading.Thread(target=target, daemon=True, name=f"fleet-{getattr(fn, '__name__', 'call')}").start()
    return await fut


def _pid_state(pid: int) -> str | None:
    """The process state letter from /proc (R, S, D, T stopped, Z zombie, ...), None when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:][:1]


def _pid_alive(pid: int) -> bool:
    return _pid_state(pid) not in (None, "Z", "X")


def _generation_answers(ep: Endpoint, timeout: float = 20.0) -> bool:
    """Does the server run a generation now? /health_generate (SGLang), else /health."""
    import httpx

    headers = {"Authorization": f"Bearer {ep.api_key}"} if ep.api_key else None
    try:
        r = httpx.get(ep.url + "/health_generate", timeout=timeout, headers=headers)
        if r.status_code == 404:
            r = httpx.get(ep.url + "/health", timeout=timeout, headers=headers)
        return r.status_code == 200
    except httpx.HTTPError:
        return False


class _Servers:
    """Liveness and relaunch of the job's servers, on this node (the runner runs on it)."""

    def __init__(self, cfg: FleetConfig, entries: list[ServerEntry], relaunch: bool) -> None:
        self.cfg = cfg
        self.entries = {e.name: e for e in entries}
        self.relaunch = relaunch

    def _pid_path(self, e: ServerEntry) -> Path | None:
        if not e.spec or "workdir" not in e.spec:
            return None
        from fleet.servers import server_paths

        return Path(server_paths(e.spec["workdir"], self.cfg.name, e.index).pid)

    def is_alive(self, ep: Endpoint) -> bool | None:
        e = self.entries[ep.name]
        path = self._pid_path(e)
        if path is None:
            return None
        try:
            text = path.read_text().strip()
        except OSError:
            return None   # no pid file: cannot tell (stopped by hand, or not launched by fleet)
        first = text.split()[0] if text else ""   # "PID STARTTIME" (older files: "PID")
        return _pid_alive(int(first)) if first.isdigit() else None

    async def on_down(self, ep: Endpoint) -> bool:
        e = self.entries[ep.name]
        if not self.relaunch or not e.spec:
            return await _in_daemon_thread(self._healthy_and_smoked, ep)
        return await _in_daemon_thread(self._relaunch, ep, e)

    def _healthy_and_smoked(self, ep: Endpoint) -> bool:
        import httpx

        from fleet.errors import FleetError
        from fleet.smoke import smoke

        try:
            if httpx.get(ep.url + "/health", timeout=10).status_code != 200:
                return False
        except httpx.HTTPError:
            return False
        try:
            smoke(ep.url, ep.model, self.cfg.smoke, node=ep.name, api_key=ep.api_key,
                  temperature=self.cfg.generation.temperature)
        except FleetError as exc:
            log.warning("server %s answers /health but fails its smoke: %s", ep.name, exc.one_line())
            return False
        return True

    def _relaunch(self, ep: Endpoint, e: ServerEntry) -> bool:
        """Same launch spec, same GPU: stop what is left, launch, wait ready, smoke."""
        from fleet.engines import ServerSpec
        from fleet.node import LocalNode
        from fleet.servers import launch, record_smoke, server_paths, wait_ready
        from fleet.smoke import smoke

        assert e.spec is not None
        spec_fields = {k: v for k, v in e.spec.items() if k in ServerSpec.__dataclass_fields__}
        spec_fields["gpus"] = tuple(spec_fields.get("gpus") or ())
        spec_fields["extra_args"] = tuple(spec_fields.get("extra_args") or ())
        spec = ServerSpec(**{**spec_fields, "api_key": ep.api_key})
        node = LocalNode(spec.node)
        paths = server_paths(spec.workdir, self.cfg.name, spec.index)
        pid = node.read_pid(paths.pid, expect=f"--port {spec.port}")
        if pid is not None and node.is_alive(pid):
            # Alive but taken out (stopped, hung, or answering garbage): is it fine after all?
            # A stopped process (SIGSTOP) cannot be; a wedged one fails a generation probe in
            # seconds (never wait for a smoke's first-request timeout on it).
            stopped = _pid_state(pid) == "T"
            if not stopped and _generation_answers(ep) and self._healthy_and_smoked(ep):
                log.info("server %s is healthy again without a relaunch", ep.name)
                return True
            log.warning("server %s: process %d %s: stopping it", ep.name, pid,
                        "is stopped (SIGSTOP)" if stopped else "alive but not serving")
            try:
                os.killpg(pid, signal.SIGCONT)   # a stopped group acts on SIGTERM only once continued
            except OSError:
                pass
            node.stop(pid, grace_s=self.cfg.servers.stop_grace_s)
        log.warning("relaunching server %s on GPUs %s", ep.name, list(spec.gpus))
        res = launch(node, self.cfg, spec)
        wait_ready(node, self.cfg, spec, res.pid)
        result = smoke(ep.url, ep.model, self.cfg.smoke, node=spec.node, index=spec.index, api_key=ep.api_key,
                       temperature=self.cfg.generation.temperature)
        record_smoke(node, self.cfg, spec, result.as_dict())
        log.warning("server %s relaunched (pid %d) and smoked in %.1f s", ep.name, res.pid,
                    res.seconds + (result.latency_s or 0))
        return True


# ---------------------------------------------------------------------------- progress


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1, default=str))
        os.replace(tmp, path)
    except OSError as exc:
        if not exc.filename:   # a failed write() names no file: say which one (disk full at which file)
            exc.filename = str(path)
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "?"
    s = int(s)
    if s >= 86400:
        return f"{s // 86400}d{s % 86400 // 3600}h"
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s"


class _Progress:
    """progress.json and the console line, from the dispatcher's counters and the store's."""

    def __init__(self, job: JobSpec, store: Any, started_at: float) -> None:
        self.job = job
        self.store = store
        self.rows_total: int | None = None
        self.started_at = started_at
        self.path = Path(job.output) / PROGRESS_FILE

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
        eta = remaining / rows_per_s if remaining is not None and rows_per_s > 0 else None
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
            "in_flight": snap["in_flight"], "queued": snap["queued"],
            "tok_s": snap["tok_s"], "tok_s_avg": snap["tok_s_avg"],
            "rows_per_s": round(rows_per_s, 2), "eta_s": round(eta) if eta is not None else None,
            "prompt_tokens": snap["prompt_tokens"], "completion_tokens": snap["completion_tokens"],
            "servers_up": snap["servers_up"], "servers": snap["servers"],
        }

    def write(self, disp: Dispatcher, state: str | None = None) -> dict[str, Any]:
        data = self.build(disp, state)
        write_json_atomic(self.path, data)
        return data

    @staticmethod
    def line(p: dict[str, Any]) -> str:
        total = p["rows_total"]
        pct = f" ({p['percent']:.1f}%)" if p["percent"] is not None else ""
        return (f"[fleet generate] {p['detail']} | {p['rows_done']:,}/{total:,}{pct}" if total is not None else
                f"[fleet generate] {p['detail']} | {p['rows_done']:,}/?") + (
            f" | ok {p['completed']:,} err {p['errors']:,} rej {p['rejects']:,}"
            + (f" gated {p['quality_rejects']:,}" if p.get("quality_rejects") else "")
            + f" | in flight {p['in_flight']}"
            # two rates, named: the last minute's (tok_s) and this run's average (tok_s_avg), which
            # in the final line is the manifest's throughput.completion_tok_s
            + (f" | avg {p['tok_s_avg']:,.0f} tok/s" if p["state"] in ("done", "stopped", "failed") else
               f" | {p['tok_s']:,.0f} tok/s now, avg {p['tok_s_avg']:,.0f}") + f" | ETA {_fmt_s(p['eta_s'])}"
            f" | servers up {p['servers_up']}/{len(p['servers'])}")


# ---------------------------------------------------------------------------- failures

RESERVE_FILE = ".reserve.tmp"    # a little space set aside so a full disk still gets its manifest
RESERVE_BYTES = 512 * 1024
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


@dataclass
class Failure:
    """Why a job stopped failed: what progress.json, the manifest and exit.json say, and the CLI prints."""

    kind: str            # disk_full | output_removed | output_unwritable | input | conflict | internal
    cause: str           # one line: what failed, where (file, line, byte)
    remedy: str          # one line: what to do, then "run the same command again to resume"
    file: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class OutputRemoved(OSError):
    """The output directory is gone (or replaced by another) under the running job."""


def _os_error(exc: BaseException) -> OSError | None:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
    return None


def _target(path: str | None) -> str | None:
    """The file a temp file stands for: .progress.json.123.tmp -> progress.json, part-1.parquet.tmp -> part-1.parquet."""
    if not path:
        return path
    p = Path(path)
    name = p.name
    if name.endswith(".tmp"):
        name = name[:-4]
        if name.startswith("."):
            name = name[1:].rsplit(".", 1)[0] if name.rsplit(".", 1)[-1].isdigit() else name[1:]
    return str(p.with_name(name))


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def classify(exc: BaseException, out: Path, *, committed: int | None = None) -> Failure:
    """Turn any exception of a runner task into a Failure with its cause and remedy."""
    from fleet.errors import FleetError, InputError, JobConflict

    resume = "then run the same command again to resume" + (
        f": the {committed:,} committed rows are kept" if committed else ": committed rows are kept")
    if isinstance(exc, InputError):
        return Failure("input", exc.reason, exc.remedy or "fix the input, then run the same command again")
    if isinstance(exc, JobConflict):
        return Failure("conflict", exc.reason, exc.remedy or "give this job its own --output")
    oserr = _os_error(exc)
    path = _target(getattr(exc, "path", None) or (oserr.filename if oserr is not None else None))
    if isinstance(oserr, OutputRemoved) or (oserr is not None and not out.is_dir()):
        return Failure("output_removed", f"output directory {out} was removed while the job ran",
                       f"run the same command again: the job starts over in a new {out} (the rows of the "
                       "removed directory are gone)", str(out))
    text = f"{exc} {oserr or ''}"
    if oserr is not None and (oserr.errno in _DISK_FULL or "No space left" in text or "errno 28" in text.lower()):
        try:
            st = os.statvfs(out)
            free = f"{_fmt_bytes(st.f_bavail * st.f_frsize)} free of {_fmt_bytes(st.f_blocks * st.f_frsize)}"
        except OSError:
            free = "free space unknown"
        return Failure("disk_full", f"disk full: no space left on device writing {path or out} ({free} on the "
                                    f"filesystem of {out})",
                       f"free space there (`df -h {out}`), {resume}; rows not committed are generated again",
                       path)
    if oserr is not None and oserr.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return Failure("output_unwritable", f"cannot write {path or out}: {oserr.strerror}",
                       f"make {out} writable (or pick another --output), {resume}", path)
    if oserr is not None:
        return Failure("output_unwritable", f"writing {path or out} failed: {oserr.strerror or oserr}",
                       f"fix the output filesystem, {resume}", path)
    if isinstance(exc, FleetError):
        return Failure("internal", exc.reason, exc.remedy or f"read the runner's log, {resume}")
    return Failure("internal", f"runner error: {type(exc).__name__}: {exc}"[:500],
                   f"a bug: the traceback is in the runner's log; {resume}")


def _reserve(out: Path) -> Path | None:
    """Set RESERVE_BYTES aside in the output directory (OSError: the disk is already full)."""
    path = out / RESERVE_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, RESERVE_BYTES)
    except OSError as exc:
        os.close(fd)
        path.unlink(missing_ok=True)
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return None   # a filesystem without fallocate: no reserve, the rest still works
        exc.filename = str(out / "shards")
        raise
    os.close(fd)
    return path


def write_exit(path: Path | None, pid: int, rc: int, state: str, failure: Failure | None,
               extra: dict[str, Any] | None = None) -> None:
    """<job dir>/exit.json: the runner's last word, outside the output directory (which may be full or gone)."""
    if path is None:
        return
    try:
        write_json_atomic(path, {"pid": pid, "rc": rc, "state": state, "at": time.time(),
                                 "failure": failure.as_dict() if failure else None, **(extra or {})})
    except OSError as exc:
        log.error("cannot write %s: %s", path, exc)


class _GuardedStore:
    """The store as the dispatcher sees it: any write that raises is recorded as the job's failure."""

    def __init__(self, store: Any, on_error: Any) -> None:
        self._store = store
        self._on_error = on_error

    def _call(self, name: str, *args: Any, **kw: Any) -> Any:
        try:
            return getattr(self._store, name)(*args, **kw)
        except Exception as exc:
            self._on_error(exc)
            raise

    def add_result(self, row: dict[str, Any]) -> Any:
        return self._call("add_result", row)

    def add_error(self, id: str, **kw: Any) -> Any:
        return self._call("add_error", id, **kw)

    def add_reject(self, reject: Any) -> Any:
        return self._call("add_reject", reject)

    def add_quality_reject(self, row: dict[str, Any], reasons: list[str], **kw: Any) -> Any:
        return self._call("add_quality_reject", row, reasons, **kw)

    def flush(self) -> None:
        self._call("flush")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


# ---------------------------------------------------------------------------- the job

_SIGNALS = ("SIGTERM", "SIGINT")


def _endpoints(entries: list[ServerEntry]) -> list[Endpoint]:
    """The dispatcher's endpoints, each with the API key its entry names (from the environment)."""
    endpoints = []
    for e in entries:
        key = os.environ.get(e.api_key_env) if e.api_key_env else None
        endpoints.append(Endpoint(name=e.name, url=e.url.rstrip("/"), model=e.model, api_key=key,
                                  max_running_requests=e.max_running_requests, gpus=max(1, len(e.gpus)),
                                  extra={"entry": e}))
    return endpoints


class _Run:
    """One run of a job, step by step (see `run_job`): its store, dispatcher and progress, and
    its first failure. Any part (the progress ticker, the input feeder's thread, the store, the
    dispatcher) records a failure with `fail`; the first one wins and stops the dispatcher."""

    def __init__(self, job: JobSpec, cfg: FleetConfig, out: Path, out_ino: int, fingerprint: str,
                 store: ResultStore, started_at: float, t0: float) -> None:
        self.job = job
        self.cfg = cfg
        self.gen = cfg.generation
        self.out = out
        self.out_ino = out_ino
        self.fingerprint = fingerprint
        self.store = store
        self.started_at = started_at
        self.t0 = t0
        self.loop = asyncio.get_running_loop()
        self.failure: Failure | None = None
        self.reserve: Path | None = None
        self._disp: Dispatcher | None = None
        self._signals = 0

    @classmethod
    async def open(cls, job: JobSpec) -> _Run:
        """The config, the output directory (created) and its store (locked, checked against the input)."""
        from fleet.generation.inputs import input_fingerprint
        from fleet.generation.store import ResultStore
        from fleet.generation.validate import job_params

        cfg = _fleet_config(job.config)
        out = Path(job.output)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            from fleet.errors import InputError

            raise InputError(f"cannot create output directory {out}: {exc.strerror}",
                             remedy="pass an --output directory you can write to") from exc
        out_ino = out.stat().st_ino
        started_at = time.time()
        t0 = time.monotonic()
        fingerprint = await asyncio.to_thread(input_fingerprint, job.input)
        store = ResultStore(out, shard_rows=cfg.generation.shard_rows, input_fingerprint=fingerprint,
                            job_params=job_params(cfg))
        return cls(job, cfg, out, out_ino, fingerprint, store, started_at, t0)

    @property
    def disp(self) -> Dispatcher:
        assert self._disp is not None, "prepare() builds the dispatcher"
        return self._disp

    def fail(self, exc: BaseException, *, stop: bool = True) -> None:
        """Record the job's first failure and stop the dispatcher at once (from any thread)."""
        if self.failure is None:
            self.failure = classify(exc, self.out, committed=self.store.counts().get("committed"))
            if self.failure.kind == "internal":
                log.error("job failing: %s", self.failure.cause, exc_info=exc)
            else:
                log.error("job failing: %s", self.failure.cause)
        disp = self._disp
        if stop and disp is not None:
            try:
                in_loop = asyncio.get_running_loop() is self.loop
            except RuntimeError:
                in_loop = False
            if in_loop:
                disp.request_stop(0.0, reason=self.failure.cause)
            else:   # a store flush in a worker thread: the dispatcher is the loop's
                self.loop.call_soon_threadsafe(disp.request_stop, 0.0, self.failure.cause)

    # -- before the first row

    def prepare(self) -> None:
        """Set the disk reserve aside, load the ids done, build the dispatcher and the progress."""
        from fleet.generation.inputs import InputStats

        try:
            self.reserve = _reserve(self.out)
        except OSError as exc:
            self.fail(exc)
        if self.job.retry_errors and self.failure is None:
            # errors.jsonl is set aside (kept for the audit) and its ids are no longer done
            retried = self.store.retry_errors()
            log.info("retrying %d rows from the errors file", len(retried))
        self.done = self.store.done_ids()   # live: grows as rows end, read by the input thread
        if len(self.done):
            log.info("resuming: %d ids already done are skipped", len(self.done))
        self.endpoints = _endpoints(self.job.servers)
        servers = _Servers(self.cfg, self.job.servers, self.job.relaunch)
        self.guarded = _GuardedStore(self.store, self.fail)
        self._disp = Dispatcher(self.endpoints, self.guarded, self.gen, on_server_down=servers.on_down,
                                is_alive=servers.is_alive, **self.job.dispatch)
        if self.failure is not None:
            self._disp.request_stop(0.0, reason=self.failure.cause)
        self.progress = _Progress(self.job, self.store, self.started_at)
        self.stats = InputStats()

    # -- the rows

    async def dispatch(self, *, install_signals: bool, console: bool) -> Summary:
        """Stream the input through the dispatcher until it ends, a stop or a failure."""
        disp = self.disp
        counter = asyncio.ensure_future(self._count_rows())
        if install_signals:
            for signame in _SIGNALS:
                self.loop.add_signal_handler(getattr(signal, signame), self._on_signal, signame)
        try:
            self.progress.write(disp, "starting")   # at once: never leave a previous run's state for the watcher
        except Exception as exc:
            self.fail(exc)
        ticker = asyncio.ensure_future(self._tick(console))
        try:
            if self.failure is not None:   # failed before the first row (a full disk at start): nothing to run
                summary: Summary = disp.summary()
            else:
                summary = await disp.run(self._items())
        except Exception as exc:   # the dispatcher itself: still a manifest, a cause, a remedy
            self.fail(exc)
            summary = disp.summary()
        finally:
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)
            if install_signals:
                for signame in _SIGNALS:
                    self.loop.remove_signal_handler(getattr(signal, signame))
        await counter
        if disp.task_error is not None:
            self.fail(disp.task_error, stop=False)
        return summary

    async def _count_rows(self) -> None:
        from fleet.generation.inputs import count_rows

        try:
            n = await asyncio.to_thread(count_rows, self.job.input)
            self.progress.rows_total = n if self.gen.limit is None else min(n, self.gen.limit)
        except Exception as exc:   # the feeder meets the same corruption, after the rows before it
            log.warning("counting the input's rows failed: %s", exc)

    def _on_signal(self, signame: str) -> None:
        self._signals += 1
        grace = self.job.stop_grace_s if self._signals == 1 else 0.0
        log.warning("%s: stopping (grace %.0f s; in flight %d)", signame, grace, self.disp.in_flight)
        self.disp.request_stop(grace, reason=f"stopped by {signame}")   # a second one: no more grace

    def _check_output(self) -> None:
        try:
            same = self.out.stat().st_ino == self.out_ino
        except FileNotFoundError:
            same = False
        if not same:
            raise OutputRemoved(errno.ENOENT, "output directory removed", str(self.out))

    async def _tick(self, console: bool) -> None:
        """Every progress_interval_s: the output still there, a timed flush, progress.json, the console line."""
        job = self.job
        last_flush = last_console = time.monotonic()
        while True:
            await asyncio.sleep(job.progress_interval_s)
            try:
                now = time.monotonic()
                self._check_output()
                if now - last_flush >= job.flush_interval_s:
                    await asyncio.to_thread(self.guarded.flush)   # thread-safe store; the loop keeps serving
                    last_flush = now
                p = self.progress.write(self.disp)
                if console and now - last_console >= job.console_interval_s:
                    print(_Progress.line(p), flush=True)
                    last_console = now
            except Exception as exc:   # a ticker that dies must not leave the job running blind
                self.fail(exc)
                return

    def _items(self) -> Iterator[Any]:
        """The input, stopping cleanly at a corrupt/unreadable point: the rows before it still run."""
        from fleet.generation.inputs import iter_input

        try:
            yield from iter_input(self.job.input, self.gen, skip_ids=self.done.__contains__, stats=self.stats)
        except Exception as exc:
            self.fail(exc, stop=False)   # this runs in the feeder's thread: no dispatcher call from here

    # -- after the last row

    async def finish(self, summary: Summary, *, console: bool) -> tuple[str, str | None, dict[str, int]]:
        """Commit, then write the manifest and the final progress.json; the job's state, reason and counts."""
        from fleet.generation.manifest import MANIFEST_FILE, build_manifest

        state, reason = self._settle(summary)
        counts = dict(self.store.counts())
        wall = time.monotonic() - self.t0
        final = self.progress.build(self.disp, state)
        final["state"] = state
        final["reason"] = reason
        if state == "failed":
            final["detail"] = f"failed: {reason}"
        if self.failure is not None:
            final["error"] = self.failure.as_dict()
        manifest = build_manifest(self._facts(summary, state, reason, counts, wall))
        await self._add_checks(manifest, summary)
        final["manifest"] = str(self.out / MANIFEST_FILE)
        final["tok_s_avg"] = manifest["throughput"]["completion_tok_s"] or 0.0   # one number, two places
        state = self._write_final(manifest, final, state)
        if console:
            print(_Progress.line(final), flush=True)
        return state, reason, counts

    def _settle(self, summary: Summary) -> tuple[str, str | None]:
        """Note a broken input, commit the buffer, refuse an input without one valid row; the state and reason."""
        if self.failure is not None and self.failure.kind == "input":
            try:   # a repaired copy of the input may continue this job (the store accepts it)
                self.store.note_input_broken(self.failure.cause)
            except OSError as exc:
                log.warning("cannot note the broken input in %s: %s", self.out, exc)
        if self.failure is None or self.failure.kind not in ("disk_full", "output_removed"):
            try:
                self.store.flush()
            except Exception as exc:
                self.fail(exc, stop=False)
        stats = self.stats
        if self.failure is None and summary.state == "done" and stats.requests + stats.skipped == 0:
            from fleet.errors import InputError

            self.fail(InputError(f"input {self.job.input} holds no valid row ({stats.rows:,} rows read, "
                                 f"{stats.rejects:,} rejects; see rejects.jsonl)",
                                 remedy="fix the rows, then run the same command again"), stop=False)
        state = "failed" if self.failure is not None or summary.state == "failed" else summary.state
        reason = self.failure.cause if self.failure is not None else summary.reason
        return state, reason

    def _facts(self, summary: Summary, state: str, reason: str | None, counts: dict[str, int],
               wall: float) -> RunFacts:
        """What the manifest says of this run, and the runs before it (from the manifest there)."""
        from fleet.generation.manifest import RunFacts, ServerFacts
        from fleet.generation.manifest import read_manifest

        try:
            runs = list((read_manifest(self.out) or {}).get("runs") or [])
        except (OSError, ValueError):
            runs = []
        return RunFacts(
            state=state, reason=reason, failure=self.failure.as_dict() if self.failure is not None else None,
            summary=summary, input_path=str(self.job.input), input_fingerprint=self.fingerprint,
            rows_total=self.progress.rows_total, output=str(self.out), counts=counts,
            config=self.cfg.model_dump(mode="json", exclude={"servers": {"api_key"}}),
            config_fingerprint=self.cfg.fingerprint(), price_per_gpu_hour=self.gen.price_per_gpu_hour,
            servers=[ServerFacts(ep.name, ep.url, ep.model, ep.gpus, srv.info)
                     for ep, srv in zip(self.endpoints, self.disp.servers)],
            started_at=self.started_at, finished_at=time.time(), wall_s=wall, previous_runs=runs,
            runner={"pid": os.getpid(), "retry_errors": self.job.retry_errors, "python": sys.version.split()[0]},
        )

    async def _add_checks(self, manifest: dict[str, Any], summary: Summary) -> None:
        from fleet.generation.checks import data_checks, quality_summary

        if self.failure is not None and self.failure.kind in ("disk_full", "output_removed"):
            return
        try:
            manifest["checks"] = await asyncio.to_thread(data_checks, self.out)
        except Exception as exc:  # checks must never cost the job its manifest
            manifest["checks"] = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            manifest["quality"] = await asyncio.to_thread(quality_summary, self.out, summary.gates)
        except Exception as exc:
            manifest["quality"] = {"error": f"{type(exc).__name__}: {exc}"}

    def _write_final(self, manifest: dict[str, Any], final: dict[str, Any], state: str) -> str:
        """manifest.json, then progress.json (on a full disk the reserve makes room); the state."""
        from fleet.generation.manifest import write_manifest

        if self.failure is not None and self.failure.kind == "output_removed":
            return state
        for attempt in range(2):
            try:
                write_manifest(self.out, manifest)
                # last: a watcher that sees the final state finds the manifest already there
                write_json_atomic(self.progress.path, final)
                break
            except OSError as exc:
                if attempt == 0 and self.reserve is not None:
                    self.reserve.unlink(missing_ok=True)
                    self.reserve = None
                    continue
                log.error("cannot write the final manifest/progress in %s: %s", self.out, exc)
                if self.failure is None:
                    self.fail(exc, stop=False)
                    state = "failed"
        return state

    def close(self) -> None:
        if self.reserve is not None:
            self.reserve.unlink(missing_ok=True)
        try:
            self.store.close()
        except Exception as exc:   # a full disk again: the rows not committed are generated on resume
            log.error("closing the store: %s", exc)

    def exit_code(self, state: str, reason: str | None, counts: dict[str, int], exit_file: Path | None,
                  *, console: bool) -> int:
        """The process exit code, logged and written to exit.json."""
        rc = 1 if state == "failed" else 0
        failure = self.failure
        if failure is not None:
            log.error("job failed: %s — %s", failure.cause, failure.remedy)
            if console:
                print(f"fleet runner: FAILED: {failure.cause} — {failure.remedy}", file=sys.stderr, flush=True)
        elif state == "failed":
            log.error("job failed: %s", reason)
        write_exit(exit_file, os.getpid(), rc, state, failure, {"counts": counts})
        return rc


async def run_job(job: JobSpec, *, install_signals: bool = True, console: bool = True,
                  exit_file: Path | None = None) -> int:
    """Run one job to its end (or a stop); return the process exit code.

    Any exception of any part (the progress ticker, the input feeder, the store, the
    dispatcher) stops the job as `failed` with a `Failure` — cause and remedy — written to
    progress.json, the manifest and `exit_file`; see `classify`."""
    run = await _Run.open(job)
    try:
        run.prepare()
        summary = await run.dispatch(install_signals=install_signals, console=console)
        state, reason, counts = await run.finish(summary, console=console)
    finally:
        run.close()
    return run.exit_code(state, reason, counts, exit_file, console=console)


def run_local(cfg: FleetConfig, input: str | Path, output: str | Path, servers: list[ServerEntry | dict[str, Any]],
              *, retry_errors: bool = False, relaunch: bool = True, flush_interval_s: float = 30.0,
              progress_interval_s: float = 2.0, console_interval_s: float = 5.0, stop_grace_s: float = 60.0,
              install_signals: bool = False, console: bool = False, dispatch: dict[str, Any] | None = None) -> int:
    """Run a job in this process (tests, `fleet generate` on a local node without detaching)."""
    job = JobSpec(
        config=cfg.model_dump(mode="json", exclude={"servers": {"api_key"}}), input=str(input), output=str(output),
        servers=[s if isinstance(s, ServerEntry) else ServerEntry.from_dict(s) for s in servers],
        retry_errors=retry_errors, relaunch=relaunch, flush_interval_s=flush_interval_s,
        progress_interval_s=progress_interval_s, console_interval_s=console_interval_s, stop_grace_s=stop_grace_s,
        dispatch=dict(dispatch or {}),
    )
    from fleet.generation.remote import runner_secret_env

    saved = {k: os.environ.get(k) for k in ("FLEET_API_KEY", "FLEET_ENGINE_ENV")}
    os.environ.update(runner_secret_env(cfg))
    try:
        return asyncio.run(run_job(job, install_signals=install_signals, console=console))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fleet.generation.runner",
                                description="Run one fleet generation job (the data-plane process).")
    p.add_argument("--job", required=True, help="JOB.json: config, input, output, servers")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from fleet.errors import FleetError

    exit_file = Path(args.job).resolve().parent / EXIT_FILE
    try:
        job = JobSpec.load(args.job)
        if not job.servers:
            raise ValueError("the job lists no servers")
    except (OSError, ValueError, TypeError, KeyError) as exc:
        print(f"fleet runner: cannot read the job file {args.job}: {exc}", file=sys.stderr)
        write_exit(exit_file, os.getpid(), 2, "failed",
                   Failure("internal", f"cannot read the job file {args.job}: {exc}", "run `fleet generate` again"))
        return 2
    try:
        return asyncio.run(run_job(job, exit_file=exit_file))
    except FleetError as exc:   # a locked output, an unreadable input, another job's directory
        print(f"fleet runner: {exc}", file=sys.stderr)
        write_exit(exit_file, os.getpid(), 2, "failed", classify(exc, Path(job.output)))
        return 2
    except Exception as exc:
        from pydantic import ValidationError

        if isinstance(exc, ValidationError):
            print(f"fleet runner: the job's config is invalid: {exc}", file=sys.stderr)
            write_exit(exit_file, os.getpid(), 2, "failed",
                       Failure("internal", f"the job's config is invalid: {str(exc).splitlines()[0]}",
                               "fix the config, then run the same command again"))
            return 2
        failure = classify(exc, Path(job.output))
        write_exit(exit_file, os.getpid(), 1, "failed", failure)
        if failure.kind in ("disk_full", "output_removed", "output_unwritable"):   # not a bug: no traceback
            print(f"fleet runner: FAILED: {failure.cause} — {failure.remedy}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
