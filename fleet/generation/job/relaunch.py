"""The job's servers seen from the runner, on their node: is one alive (its pid), and bring one
back when the dispatcher takes it out (`JobServers.on_down`): relaunch it with its spec on the
same GPUs, or, without a spec (a server fleet did not start: an `[[endpoints]]` entry), wait
until it answers its health check and a smoke again — never relaunched."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

from fleet.config import FleetConfig
from fleet.generation.hotpath.serverstate import Endpoint
from fleet.generation.hotpath.health import READMITTED
from fleet.generation.job.jobspec import ServerEntry
from fleet.net import tls_context

__all__ = ["JobServers"]

log = logging.getLogger("fleet.generation")

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
        r = httpx.get(ep.url + "/health_generate", timeout=timeout, headers=headers, verify=tls_context(ep.url))
        if r.status_code == 404:
            r = httpx.get(ep.url + "/health", timeout=timeout, headers=headers, verify=tls_context(ep.url))
        return r.status_code == 200
    except httpx.HTTPError:
        return False


def _healthy(ep: Endpoint, timeout: float = 10.0) -> bool:
    """/health answers 200; a server without one (a plain OpenAI server) when /v1/models does.
    An endpoint given no model takes the first id /v1/models lists (none listed: not usable)."""
    import httpx

    from fleet.generation.hotpath.probes import first_model

    headers = {"Authorization": f"Bearer {ep.api_key}"} if ep.api_key else None
    try:
        status = httpx.get(ep.url + "/health", timeout=timeout, headers=headers, verify=tls_context(ep.url)).status_code
        if status >= 500 or status < 200:   # 503: starting or shutting down; 4xx: no /health here
            return False
        if status == 200 and ep.model:
            return True
        r = httpx.get(ep.url + "/v1/models", timeout=timeout, headers=headers, verify=tls_context(ep.url))
    except httpx.HTTPError:
        return False
    if r.status_code != 200:
        return False
    ep.model = ep.model or first_model(r.content) or ""
    return bool(ep.model)


class JobServers:
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

    async def on_down(self, ep: Endpoint) -> bool | Literal["readmitted"]:
        """True: relaunched (a restart); READMITTED: fine again without one; False: not yet."""
        e = self.entries[ep.name]
        if not self.relaunch or not e.spec:
            return READMITTED if await _in_daemon_thread(self._healthy_and_smoked, ep) else False
        return await _in_daemon_thread(self._relaunch, ep, e)

    def _healthy_and_smoked(self, ep: Endpoint) -> bool:
        from fleet.errors import FleetError
        from fleet.smoke import smoke

        if not _healthy(ep):
            return False
        try:
            smoke(ep.url, ep.model, self.cfg.smoke, node=ep.name, api_key=ep.api_key,
                  temperature=self.cfg.generation.temperature)
        except FleetError as exc:
            log.warning("server %s answers /health but fails its smoke: %s", ep.name, exc.one_line())
            return False
        return True

    def _relaunch(self, ep: Endpoint, e: ServerEntry) -> bool | Literal["readmitted"]:
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
                return READMITTED
            log.warning("server %s: process %d %s: stopping it", ep.name, pid,
                        "is stopped (SIGSTOP)" if stopped else "alive but not serving")
            try:
                os.killpg(pid, signal.SIGCONT)   # a stopped group acts on SIGTERM only once continued
            except OSError:
                pass
            node.stop(pid, grace_s=self.cfg.servers.stop_grace_s)
        # A teardown stopped this fleet here on purpose: a runner that outlived it, or one a
        # multi-node controller started after it (the stopped chunk goes back to the queue), must
        # not bring the GPUs back. A bring-up removes the marker (fleet.torndown.marker_path).
        if Path(spec.workdir, "teardown", f"{self.cfg.name}.json").exists():
            log.warning("server %s not relaunched: the fleet was torn down on this node (fleet up brings it back)",
                        ep.name)
            return False
        log.warning("relaunching server %s on GPUs %s", ep.name, list(spec.gpus))
        res = launch(node, self.cfg, spec)
        wait_ready(node, self.cfg, spec, res.pid)
        result = smoke(ep.url, ep.model, self.cfg.smoke, node=spec.node, index=spec.index, api_key=ep.api_key,
                       temperature=self.cfg.generation.temperature)
        record_smoke(node, self.cfg, spec, result.as_dict())
        log.warning("server %s relaunched (pid %d) and smoked in %.1f s", ep.name, res.pid,
                    res.seconds + (result.latency_s or 0))
        return True
