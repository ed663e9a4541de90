"""A simulated SGLang server: same endpoints, same log lines, no GPU.

Used by tests, benchmarks and dry runs in place of real SGLang. The package imports
nothing outside the Python standard library (>= 3.10) and must keep it that way: the
launcher ships it to a node as one zip file (``fleet.sim.bundle``) and runs it with a bare
interpreter:

    python fleet_sim.pyz --port 30000 [--startup-s 1.0] [--tokens-per-s 2000] ...

Here it runs as ``python -m fleet.sim`` or ``fleet sim``; ``main(argv)`` is the entry point.

What it imitates (see DESIGN.md, "Facts: SGLang"):

* Startup (``startup``): SGLang-shaped log lines (``Load weight end``, ``KV Cache is
  allocated``, ``Capture cuda graph begin/end``, ``max_total_num_tokens=...``, uvicorn's
  lines, ``The server is fired up and ready to roll!``) spread over ``--startup-s``. The
  port is bound at once (a real server binds late); until ready, ``/health`` and
  ``/health_generate`` answer 503 and generation endpoints answer 503.
* Serving (``app``, ``generation``): ``/health``, ``/health_generate``, ``/model_info``,
  ``/get_model_info``, ``/server_info``, ``/get_server_info``, ``/v1/models``, ``/metrics``,
  ``/v1/chat/completions`` (also streamed), ``/v1/completions``, ``/generate``.
  Every generation is deterministic from ``--seed`` and a hash of the prompt
  (``determinism``); it takes ``completion_tokens / --tokens-per-s`` seconds and holds one
  of ``--max-running-requests`` slots (``engine``; the rest queue, first come first served).
* While running: ``Prefill batch. ...`` and ``Decode batch. ...`` lines once a second.
* Faults (``faults``): ``--oom-at-start``, ``--hang-at-start``, ``--crash-after N``,
  ``--hang-requests``, ``--hang-after N``, ``--error-rate F``; SIGUSR1 starts a burst of
  ``--burst-5xx N`` HTTP 500 answers.

Where real SGLang differs between versions, the older dotted form is printed
(``Decode batch. #running-req``; newer versions print ``Decode batch, #running-req``), so
log classifiers should match the prefix ``Decode batch``.

The HTTP layer (``http_front``) is a small asyncio.Protocol (HTTP/1.1, keep-alive,
pipelining, Content-Length bodies, chunked responses for streaming) rather than asyncio
streams: it serves thousands of requests per second on one core.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from typing import Any

from fleet.sim import faults
from fleet.sim.app import App
from fleet.sim.engine import Engine
from fleet.sim.http_front import HttpConnection
from fleet.sim.log import Log
from fleet.sim.options import VERSION, build_parser, check_args
from fleet.sim.startup import startup

__all__ = ["VERSION", "build_parser", "main"]


async def _serve(args: argparse.Namespace, log: Log) -> int:
    loop = asyncio.get_running_loop()
    engine = Engine(args, log)
    app = App(args, log, engine)
    try:
        server = await loop.create_server(lambda: HttpConnection(app), args.host, args.port,
                                          reuse_address=True, backlog=2048)
    except OSError as exc:
        log.info(f"ERROR:    [Errno {exc.errno}] error while attempting to bind on address "
                 f"({args.host!r}, {args.port}): {(exc.strerror or str(exc)).lower()}")
        return 1

    stop = _stop_on_signals(loop, args, engine, log)
    shown = {k: v for k, v in faults.summary(args).items() if v}
    log.info(f"sim: simulated SGLang server {VERSION}, pid {os.getpid()}, faults: {shown or 'none'}")
    started = loop.create_task(startup(args, log, engine))
    sched = loop.create_task(engine.scheduler_log())
    code = 0
    try:
        first: set[asyncio.Future[Any]] = {started, stop}
        done, _ = await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        if started in done and started.result() == 1:
            code = 1
        else:
            await stop
            log.info("INFO:     Shutting down")
    finally:
        for task in (started, sched):
            task.cancel()
        server.close()
        for conn in list(app.conns):
            conn.transport.abort()
        if code == 0:
            log.info("INFO:     Waiting for application shutdown.")
            log.info("INFO:     Application shutdown complete.")
            log.info(f"INFO:     Finished server process [{os.getpid()}]")
    return code


def _stop_on_signals(loop: asyncio.AbstractEventLoop, args: argparse.Namespace, engine: Engine,
                     log: Log) -> asyncio.Future[str]:
    """SIGTERM and SIGINT resolve the returned future (a clean shutdown); SIGUSR1 starts a burst."""
    stop: asyncio.Future[str] = loop.create_future()

    def on_signal(signame: str) -> None:
        if not stop.done():
            stop.set_result(signame)

    for signame in ("SIGTERM", "SIGINT"):
        try:
            loop.add_signal_handler(getattr(signal, signame), on_signal, signame)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread (embedded use): the caller stops us
    try:
        loop.add_signal_handler(signal.SIGUSR1, faults.start_burst, args, engine, log)
    except (NotImplementedError, RuntimeError, ValueError, AttributeError):
        pass
    return stop


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    # fleet hands the key over in the environment, never in argv (/proc/<pid>/cmdline is
    # world-readable); dropped from the environment once read, like the SGLang shim does.
    env_key = os.environ.pop("FLEET_ENGINE_API_KEY", "")
    if args.api_key is None and env_key:
        args.api_key = env_key
    check_args(parser, args)
    log = Log()
    try:
        return asyncio.run(_serve(args, log))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
