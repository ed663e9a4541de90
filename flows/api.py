"""The CLI's Prefect layer: the Prefect API a `fleet` command talks to, and running the flow.

With `PREFECT_API_URL` set (or a profile that sets it) fleet uses that server and starts
nothing. Otherwise Prefect would start a temporary ("ephemeral") server inside each command;
fleet uses its own local server instead (flows/localserver.py), for reasons seen in use:
- one server per PREFECT_HOME, started by the first command and reused by the next ones: a
  server start cost 11–30 s per command on a busy 2-core machine, for flows that take seconds;
- Prefect's server runs in the terminal's process group, so Ctrl-C killed it first and the flow,
  still running, then spent minutes failing to talk to it (tracebacks, a lock never released).
  Ours runs in its own session: Ctrl-C reaches only the command, whose cleanups (release the
  node lock, mark the run Crashed) talk to a server that is still there (fleet/interrupt.py);
- Prefect gives it 20 s to answer; a loaded 2-core machine needs more. Ours is waited for as
  long as it progresses (CPU time or log moving), saying so on stderr; a server that exits is
  reported at once with its log, one that stands still for
  `PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS` (default 90 s here) is given up; tried twice;
- a failure is one line with the remedy, not a RuntimeError with the server's stdout.
"""

from __future__ import annotations

import os
from typing import Any

from fleet.interrupt import on_interrupt
from flows.localserver import attach


def prefect_env() -> None:
    """Defaults for every command that uses Prefect (the user's own settings win)."""
    # Offline machines log telemetry errors otherwise; users can still opt in.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "fleet")


def ensure_api() -> str:
    """The URL of the Prefect API this process uses: the configured one, or this PREFECT_HOME's
    local server (flows/localserver.py: found running, or started now). Must run before the flow
    is called."""
    prefect_env()
    from prefect.settings import get_current_settings

    configured = get_current_settings().api.url
    if configured:
        return str(configured)
    url = attach()
    _use_api(url)
    return url


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

    from flows.cancel import watch_command_run

    unregister = on_interrupt("mark the flow run crashed", lambda: _mark_crashed(run_ids), order=50)
    stop_watch = watch_command_run(run_ids)   # a Cancel from Prefect: no worker watches this run
    # Set on the flow itself for this call rather than through `with_options`, which builds a new
    # Flow and with it the parameter schema of the whole config again (≈ 0.1 s of CPU per command).
    flow.flow_run_name = named
    try:
        return flow(**params, return_state=True)
    finally:
        flow.flow_run_name = name_it
        stop_watch()
        unregister()


def _mark_crashed(run_ids: list[Any]) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    from fleet.interrupt import stopped_by

    if not run_ids:
        return
    how = stopped_by() or "interrupted"  # "interrupted" (Ctrl-C), "stopped (SIGTERM)", "stopped (SIGHUP)"
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run_ids[-1], Crashed(message=f"{how} (the command; detached servers and "
                                                               "runners keep running)"), force=True)
