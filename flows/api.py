"""The CLI's Prefect layer: the Prefect API a `fleet` command talks to, and running the flow.

Prefect starts its own temporary ("ephemeral") server when no `PREFECT_API_URL` is set. fleet
starts it itself instead, for three reasons seen in use:
- Prefect's server runs in the terminal's process group, so Ctrl-C killed it first and the flow,
  still running, then spent minutes failing to talk to it (tracebacks, a lock never released).
  Ours runs in its own session: Ctrl-C reaches only the command, which releases its lock through
  a server that is still there, then stops it (fleet/interrupt.py).
- Prefect gives it 20 s to answer; a loaded 2-core machine needs more, so two commands started
  at once died with "Timed out while attempting to connect to ephemeral Prefect API server".
  Ours gets `PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS` (default 90 s here), is watched
  while it starts (a server that exits is reported at once with its log), and is tried twice.
- a failure is one line with the remedy, not a RuntimeError with the server's stdout.
Each command gets its own server (a random free port, the same database in PREFECT_HOME as
Prefect's own); it dies with the command (SIGTERM at exit, and PR_SET_PDEATHSIG on Linux when
the command is killed). With `PREFECT_API_URL` set (or a profile that sets it) fleet uses that
server and starts nothing.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fleet.errors import FleetError
from fleet.interrupt import on_interrupt

DEFAULT_STARTUP_TIMEOUT_S = 90.0
ATTEMPTS = 2
REMEDY = ("set PREFECT_API_URL to a running server (`prefect server start`, then "
          "PREFECT_API_URL=http://127.0.0.1:4200/api), or raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")


class PrefectApiUnavailable(FleetError):
    """The Prefect API fleet needs could not be started or reached."""


def prefect_env() -> None:
    """Defaults for every command that uses Prefect (the user's own settings win)."""
    # Offline machines log telemetry errors otherwise; users can still opt in.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "fleet")


class EmbeddedServer:
    """`uvicorn prefect.server.api.server:create_app` as Prefect's SubprocessASGIServer runs it,
    but in its own session, with a log file, a pdeathsig and a stop that is only a signal."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.log = Path(tempfile.mkstemp(prefix="fleet-prefect-server-", suffix=".log")[1])

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def start(self, timeout: float) -> None:
        import importlib.util

        spec = importlib.util.find_spec("prefect")
        assert spec and spec.origin
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
        env.update(PREFECT_UI_ENABLED="0", PREFECT__SERVER_EPHEMERAL="1", PREFECT__SERVER_FINAL="1")
        argv = [sys.executable, "-m", "uvicorn", "--app-dir", str(Path(spec.origin).parent.parent), "--factory",
                "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
                "--log-level", "error", "--lifespan", "on"]
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        self._wait_healthy(timeout)

    def _wait_healthy(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5) as client:
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise PrefectApiUnavailable(
                        f"the embedded Prefect server exited with code {self.proc.returncode}: {self.log_tail()}")
                try:
                    if client.get(f"{self.api_url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise PrefectApiUnavailable(
                        f"the embedded Prefect server did not answer within {timeout:g} s "
                        f"(machine busy?){': ' + self.log_tail() if self.log_tail() else ''}")
                time.sleep(0.2)

    def log_tail(self) -> str:
        """The line of the server's log that says why: its last exception line, else its last line."""
        import re

        try:
            lines = [ln.strip() for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        why = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception)\b", ln)]
        return (why or lines or [""])[-1][:300]

    def stop(self, wait_s: float = 5.0) -> None:
        """SIGTERM; with wait_s=0 only the signal (the Ctrl-C path must not wait)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            if wait_s:
                try:
                    proc.wait(timeout=wait_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    try:
                        proc.wait(timeout=5)  # SIGKILL: at once, unless the kernel holds it
                    except subprocess.TimeoutExpired:
                        pass
        if wait_s:
            self.log.unlink(missing_ok=True)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the command dies, even by SIGKILL (Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the server outlives a killed command (a normal exit still stops it)


_server: EmbeddedServer | None = None


def ensure_api() -> str:
    """The URL of the Prefect API this process uses: the configured one, or an embedded server
    started now (once per process). Must run before the flow is called."""
    global _server
    prefect_env()
    from prefect.settings import get_current_settings

    configured = get_current_settings().api.url
    if configured:
        return str(configured)
    if _server is not None and _server.proc is not None:
        return _server.api_url
    timeout = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS") or DEFAULT_STARTUP_TIMEOUT_S)
    last: PrefectApiUnavailable | None = None
    for _ in range(ATTEMPTS):
        server = EmbeddedServer()
        try:
            server.start(timeout)
        except PrefectApiUnavailable as exc:
            last = exc
            server.stop()
            continue
        _server = server
        atexit.register(server.stop)
        on_interrupt("stop the embedded Prefect server", lambda: server.stop(wait_s=0), order=100)
        _use_api(server.api_url)
        return server.api_url
    assert last is not None
    raise PrefectApiUnavailable(f"{last.reason} (tried {ATTEMPTS} times)", remedy=REMEDY)


def _use_api(url: str) -> None:
    """Point this process's Prefect settings at `url` (the root settings are read at import)."""
    os.environ["PREFECT_API_URL"] = url
    os.environ.setdefault("PREFECT_UI_URL", "")  # it serves no UI: no "View at <url>" line pointing nowhere
    import prefect.context

    prefect.context.refresh_global_settings_context()


def run_flow(flow: Any, **params: Any) -> Any:
    """Call the flow in-process and return its final state; on Ctrl-C its run is marked Crashed
    ("interrupted") rather than left Running, so nobody mistakes it for a live run."""
    ensure_api()
    run_ids: list[Any] = []
    name_it = flow.flow_run_name

    def named() -> str:
        # Prefect calls this in the run as it starts: the one place to learn the run's id
        # without a hook (hooks log two lines each) or the main thread's context.
        from prefect.runtime import flow_run

        run_ids.append(flow_run.id)
        if callable(name_it):
            return name_it()
        return name_it.format(**flow_run.parameters) if isinstance(name_it, str) else f"{flow.name}-{flow_run.id}"

    unregister = on_interrupt("mark the flow run crashed", lambda: _mark_crashed(run_ids), order=50)
    try:
        return flow.with_options(flow_run_name=named)(**params, return_state=True)
    finally:
        unregister()


def _mark_crashed(run_ids: list[Any]) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    if not run_ids:
        return
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run_ids[-1], Crashed(message="interrupted (Ctrl-C or SIGTERM); detached "
                                                               "servers and runners keep running"), force=True)
