"""Ctrl-C, SIGTERM and SIGHUP for every `fleet` command: out within seconds, one paragraph, no traceback.

Why not just let KeyboardInterrupt unwind: a command that runs the flow has worker threads
blocked in launches, smokes and HTTP calls (a launch waits up to `ready_timeout_s`), and
Prefect's engine joins them, logs the crash and flushes logs and events to its API before the
process can end — measured 174–225 s and hundreds of lines of tracebacks. The data plane does
not need any of that: servers and the generation runner are detached by design and keep going.

SIGTERM (`timeout`, `kill`, systemd, Slurm, Kubernetes) takes the very same path as the first
Ctrl-C and exits 143 (128 + 15). Prefect's flow engine installs its own SIGTERM handler while a
flow runs (it raises TerminationSignal in the main thread); that changes nothing here: the
C-level handler still writes the signal to the wakeup fd, and the watcher starts the shutdown.
SIGHUP (the terminal closed, an SSH session dropped: the commonest way a long command ends) is
the same stop again, exit 129; Python's default for it killed the command at once, its flow run
left Running and its node lock held until the next command reclaimed it. Its paragraph goes to a
terminal that may be gone (the write fails quietly); the records it leaves are what matters.

So the first SIGINT or SIGTERM does only what must happen before the process goes, each step
bounded in time, then `os._exit`:
1. silence the other threads (their output goes to /dev/null from now on),
2. run the registered cleanups — release the per-node lock (tasks/locks.py) and mark the flow
   run Crashed together (both only talk to the API: on a busy machine each may need most of the
   budget; the local Prefect server they talk to is not the command's and keeps running,
   flows/localserver.py) — all within one deadline,
3. print one paragraph: what still runs, how to re-attach, how to stop,
4. exit 130 (SIGINT), 143 (SIGTERM) or 129 (SIGHUP).
A second SIGINT exits at once; a repeated SIGTERM or SIGHUP changes nothing (Prefect re-sends one to the
process itself as it unwinds, and the shutdown is bounded anyway). The main thread may finish its work while the cleanups run (a
bring-up that completes a moment after the Ctrl-C): its exit waits for them, so a Ctrl-C always
ends with the paragraph and 130, never with a silent 0. The cleanups are registered by the code
that creates what they clean (`on_interrupt`), so this module knows nothing of Prefect.

Under a worker there is no `install`: Prefect's Cancel reaches the flow run's process as
SIGTERM, and Prefect's own handler raises TerminationSignal in the main thread. Its unwinding
joins the task threads before the run can be set Cancelled, and those threads sit in a launch's
readiness wait or a smoke (up to servers.ready_timeout_s): Prefect's runner then waited out its
30 s kill grace (57 s from Cancel to Cancelled, measured). So the flow calls `request_stop()` as
a cancel unwinds it, and every long wait in the core checks `check_stop()` on each turn and gives
up with `Stopped` — the threads end within a poll, and with them the run (which then sets itself
Cancelled, not waiting for Prefect's runner: flows/cancel.py).
"""

from __future__ import annotations

import atexit
import contextvars
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from fleet.errors import Stopped

EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM, what a shell reports for a process SIGTERM ended
EXIT_HANGUP = 129  # 128 + SIGHUP
# what each signal that starts the clean stop ends with, and the paragraph's first words
STOPS: dict[int, tuple[int, str]] = {signal.SIGINT: (EXIT_INTERRUPTED, "interrupted"),
                                     signal.SIGTERM: (EXIT_TERMINATED, "stopped (SIGTERM)"),
                                     signal.SIGHUP: (EXIT_HANGUP, "stopped (SIGHUP)")}
CLEANUP_DEADLINE_S = 4.0  # all cleanups together; the whole exit stays within ~5 s

_cleanups: list[tuple[int, str, Callable[[], None]]] = []
_lock = threading.Lock()
_paragraph: Callable[[], str] = lambda: ""
_started = threading.Event()
_begun = threading.Lock()  # a latch: taken by the first Ctrl-C, never given back
_exit_code = EXIT_INTERRUPTED  # 143 when SIGTERM started the shutdown, 129 SIGHUP
_what = "interrupted"  # the paragraph's first words, after the signal that started the shutdown
_err_fd = 2  # where our own words go: the original stderr, kept when the shutdown silences fd 2
_stop = threading.Event()  # set by request_stop() or the first Ctrl-C/SIGTERM: waits give up
_installed = threading.Event()  # install() ran: this process is a command, not a run under a worker


def on_interrupt(name: str, fn: Callable[[], None], *, order: int = 0) -> Callable[[], None]:
    """Run `fn` (bounded, best effort) when the user presses Ctrl-C; returns an unregister function.
    Lower `order` runs first; cleanups of the same order run at the same time. `fn` runs in the
    caller's context (contextvars): a cleanup that talks to Prefect reaches the server the flow
    used (a settings context, not only the environment), not a temporary one of its own."""
    entry = (order, name, functools.partial(contextvars.copy_context().run, fn))
    with _lock:
        _cleanups.append(entry)

    def unregister() -> None:
        with _lock:
            if entry in _cleanups:
                _cleanups.remove(entry)

    return unregister


def installed() -> bool:
    """True once a command took over SIGINT/SIGTERM (`install`): its shutdown owns how the run ends.
    False in a flow run's process under a worker, where Prefect's Cancel arrives as SIGTERM."""
    return _installed.is_set()


def interrupted() -> bool:
    """True once the first SIGINT, SIGTERM or SIGHUP arrived (code that acquires something should give it back at once)."""
    return _started.is_set()


def request_stop() -> None:
    """Ask every wait of this process to give up at its next turn (a cancelled flow run unwinding)."""
    _stop.set()


def clear_stop() -> None:
    """A new flow run in this process (tests run many in one): an earlier run's stop is not its."""
    if not _started.is_set():
        _stop.clear()


def stop_requested() -> bool:
    """True once the run was asked to stop: a cancel under a worker, or a Ctrl-C/SIGTERM of a command."""
    return _stop.is_set() or _started.is_set()


def stopped_by() -> str:
    """How the shutdown began, for records ("interrupted", "stopped (SIGHUP)"…); "" before it did."""
    return _what if _started.is_set() else ""


def check_stop(what: str) -> None:
    """Raise `Stopped` (naming `what` was given up) if the run was asked to stop; call on each turn of a wait."""
    if stop_requested():
        raise Stopped(f"{what}: given up, the run was asked to stop (cancel, SIGTERM or Ctrl-C)",
                      remedy="nothing to fix: re-run when wanted (what was started keeps running and is adopted)")


def install(paragraph: Callable[[], str]) -> None:
    """Take over SIGINT, SIGTERM and SIGHUP for this process (call from the main thread, before starting threads).

    Python runs signal handlers only in the main thread, and only when it is running Python
    code: a main thread blocked waiting for a task future (the flow waiting for a launch) and a
    signal delivered to another thread meant 20 s before anything happened. So nothing relies on
    the Python-level handler; the C-level handler writes the signal number to a wakeup fd at once, from
    whatever thread got it, and a watcher thread acts on it. The Python-level handler starts the
    same shutdown from the main thread (whichever comes first; the watcher alone counts Ctrl-Cs),
    so a main thread about to end the process cannot outrun a watcher not yet scheduled."""
    global _paragraph
    _paragraph = paragraph
    _installed.set()
    r, w = os.pipe()
    os.set_blocking(w, False)
    for signum in STOPS:
        signal.signal(signum, lambda signum, frame: _begin(signum))
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    atexit.register(_hold_exit)
    threading.Thread(target=_watch, args=(r,), name="fleet-signals", daemon=True).start()


SECOND_CTRL_C = ("\nfleet: second Ctrl-C: stopped at once, the cleanups cut short. The flow run may show "
                 "Running and keep its node lock until the next fleet command on this fleet, which reclaims the "
                 "lock of a run whose process is gone; servers and a started runner keep going (`fleet status -c "
                 "FILE`).\n")


def _watch(fd: int) -> None:
    seen = 0  # one byte per SIGINT: the count is exact, whoever started the shutdown
    while True:
        try:
            data = os.read(fd, 64)
        except InterruptedError:
            continue
        if not data:
            return
        for signum in data:
            if signum == signal.SIGINT:
                seen += 1
                if seen > 1:  # second Ctrl-C: now, and say what was cut short (it printed nothing)
                    try:
                        os.write(_err_fd, SECOND_CTRL_C.encode())
                    except OSError:
                        pass
                    os._exit(_exit_code)
                _begin(signum)
            elif signum in STOPS:
                _begin(signum)


def _begin(signum: int = signal.SIGINT) -> None:
    """Start the shutdown once (from the watcher or the main thread's handler, whichever is first)."""
    global _exit_code, _what
    if not _begun.acquire(blocking=False):
        return
    _exit_code, _what = STOPS.get(signum, STOPS[signal.SIGINT])
    _started.set()
    _stop.set()
    atexit.register(_hold_exit)  # again, so that it runs first (before the embedded server's stop)
    # the cleanups run in their own thread, so the watcher still sees a second Ctrl-C
    try:
        threading.Thread(target=_shutdown, name="fleet-interrupt", daemon=True).start()
    except RuntimeError:  # no new threads while the interpreter shuts down: do it here
        _shutdown()


def park() -> NoReturn:
    """Stop the calling thread here for good: a Ctrl-C came and the shutdown ends the process.
    For work that ends after the Ctrl-C: it must not report success over the interrupt (a flow
    run set Completed after it was marked Crashed). Call it only from plain Python code, holding
    no lock the cleanups need (bounded, should the shutdown thread be gone)."""
    time.sleep(CLEANUP_DEADLINE_S + 5.0)
    os._exit(_exit_code)


def _hold_exit() -> None:
    """atexit: the main thread finished its work (or failed) after a Ctrl-C, while the cleanups
    still run: the process must not end with the command's own status, silently — wait for the
    shutdown, which ends it with the paragraph and 130."""
    if _started.is_set():
        park()


def _silence() -> int:
    """Point fds 1 and 2 at /dev/null; return a dup of the original stderr for our own output."""
    global _err_fd
    sys.stdout.flush()
    sys.stderr.flush()
    err = _err_fd = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)
    return err


def _run_bounded(fns: list[Callable[[], None]], timeout: float) -> None:
    """Run `fns` at the same time; return when all are done or `timeout` has passed."""
    end = time.monotonic() + max(0.0, timeout)
    threads = [threading.Thread(target=fn, daemon=True) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))


def _shutdown() -> None:
    t0 = time.monotonic()
    try:
        err = _silence()
    except OSError:
        err = 2
    with _lock:
        cleanups = list(_cleanups)
    for order in sorted({e[0] for e in cleanups}):
        # each group gets at least a moment: the last one (stopping the embedded server) is a signal
        _run_bounded([fn for o, _name, fn in cleanups if o == order],
                     max(0.3, CLEANUP_DEADLINE_S - (time.monotonic() - t0)))
    try:
        text = _paragraph().strip()
    except Exception:  # the paragraph must never stand between the user and the exit
        text = ""
    msg = f"\nfleet: {_what}." + (" " + text if text else "") + "\n"
    try:
        os.write(err, msg.encode())
    except OSError:
        pass
    os._exit(_exit_code)


class ClosedSafe:
    """sys.stdout or sys.stderr of a command whose reader may go first (`fleet generate … | head -1`,
    `fleet status --json | head -c 10`). Python ignores SIGPIPE, so a write to the closed pipe raised
    BrokenPipeError: the command printing its final JSON after a whole job exited 1 with a traceback
    (and one whose only fault was the flush at exit, 120). From the first refused write on, the
    stream's fd points at /dev/null and the command goes on to the exit status it would have had:
    its result is in its records (progress.json, the manifest, the flow run), not in the pipe."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            n: int = self._stream.write(text)
            return n
        except BrokenPipeError:
            self._gone()
            return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._gone()

    def _gone(self) -> None:
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, self._stream.fileno())
            finally:
                os.close(null)
            self._stream.flush()  # what the refused write left in the buffer goes to /dev/null
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def guard_closed_output() -> None:
    """A closed stdout or stderr never changes a command's exit status nor prints a traceback (`ClosedSafe`)."""
    if not isinstance(sys.stdout, ClosedSafe) and sys.stdout is not None:
        sys.stdout = ClosedSafe(sys.stdout)
    if not isinstance(sys.stderr, ClosedSafe) and sys.stderr is not None:
        sys.stderr = ClosedSafe(sys.stderr)
