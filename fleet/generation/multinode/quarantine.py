"""Nodes set aside during a job: a node whose chunk failed for a reason of its own is quarantined.

Why: a node that could not use the store's credentials failed each chunk it took, each chunk's three
tries landed on the broken nodes, and the job failed while a healthy node sat idle (issue 35). Now a
node whose chunk failed (its runner ended without finishing, or could not be started) takes no chunk
until it passes the node check again (`nodecheck.check_node`; for a job without a store, it answers);
its chunk goes back to the queue for the others. It is probed after `probe_s`, then at doubling
intervals up to `MAX_PROBE_S` while it keeps failing; a node that passes rejoins. The job fails only
when no node is healthy (every node quarantined or gone, none lost — a lost node may come back), with
every node's cause. A node whose chunk failed while no other node can work is checked at once instead:
when its check passes it goes on (a runner killed once must not end a one-node job), else it is
quarantined and the job ends. A chunk that fails `MAX_FAILED_ATTEMPTS` times (on whichever nodes) still ends the
job: then the chunk, not a node, is the likely cause.

`Quarantine` is the bookkeeping (the caller passes the clock); `set_aside` and `wait_and_check` are
what the controller's node loop does with it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fleet.errors import FatalError

if TYPE_CHECKING:
    from fleet.generation.multinode.controller import Controller

MAX_PROBE_S = 120.0
HEALTHY = ("idle", "running", "finished")


@dataclass
class Held:
    cause: str
    since: float
    next_probe: float
    wait_s: float
    times: int = 1


class Quarantine:
    def __init__(self, probe_s: float, max_probe_s: float = MAX_PROBE_S) -> None:
        self.probe_s = probe_s
        self.max_probe_s = max(probe_s, max_probe_s)
        self.held: dict[str, Held] = {}
        self.times: dict[str, int] = {}   # per node: how often it was quarantined in this job
        self._lock = threading.Lock()

    def add(self, name: str, cause: str, now: float) -> Held:
        """Quarantine `name` for `cause`; a node quarantined again waits twice as long for its next probe."""
        with self._lock:
            n = self.times[name] = self.times.get(name, 0) + 1
            wait = min(self.max_probe_s, self.probe_s * 2 ** (n - 1))
            h = self.held[name] = Held(cause, now, now + wait, wait, n)
            return h

    def holds(self, name: str) -> bool:
        with self._lock:
            return name in self.held

    def wait_s(self, name: str, now: float) -> float:
        """Seconds until node `name`'s next probe (0: due now)."""
        with self._lock:
            h = self.held.get(name)
            return max(0.0, h.next_probe - now) if h is not None else 0.0

    def failed_probe(self, name: str, cause: str, now: float) -> None:
        """Its probe failed: the cause is the probe's now; the next probe waits twice as long."""
        with self._lock:
            h = self.held.get(name)
            if h is not None:
                h.cause, h.wait_s = cause, min(self.max_probe_s, 2 * h.wait_s)
                h.next_probe = now + h.wait_s

    def release(self, name: str) -> None:
        with self._lock:
            self.held.pop(name, None)

    def causes(self) -> list[tuple[str, str]]:
        with self._lock:
            return sorted((n, h.cause) for n, h in self.held.items())


def no_healthy_node(states: dict[str, str]) -> bool:
    """Whether no node can take a chunk now nor later: none healthy, none lost (a lost node may rejoin)."""
    return not any(s in HEALTHY or s == "lost" for s in states.values())


def set_aside(ctl: Controller, name: str, cause: str) -> None:
    """Quarantine node `name` of `ctl` (its chunk is back in the queue already); FatalError when no healthy
    node is left, with every node's cause."""
    work = ctl.nodes[name]
    if not any(w.state in HEALTHY for n, w in ctl.nodes.items() if n != name):
        # the only node that can work now: quarantined, it would end the job at its first failed chunk (a
        # runner killed once). Its check decides: passed, it retries the chunk (bounded by MAX_FAILED_ATTEMPTS)
        why = ctl.node_check(name)
        if why is None:
            ctl.say(logging.WARNING, f"node {name}: {cause}; no other node can work now and its check passes: "
                                     "it goes on")
            return
        cause = f"{cause}; its check: {why}"
    held = ctl.quarantine.add(name, cause, time.monotonic())
    work.state, work.progress, work.chunk = "quarantined", None, None
    ctl.say(logging.WARNING, f"node {name} quarantined: {cause}; its chunks go to the other nodes "
                             f"(checked again in {held.wait_s:.0f} s)")
    if no_healthy_node({n: w.state for n, w in ctl.nodes.items()}):
        ctl.stop()
        logs = "under <output>/_logs/ and " if ctl.store is not None else ""
        raise FatalError("no healthy node left: " + " | ".join(f"{n}: {c}" for n, c in ctl.quarantine.causes()),
                         remedy=f"fix each node's cause (its runner logs are {logs}under the node's workdir/jobs), "
                                "then run the same command again: finished chunks are kept")


def wait_and_check(ctl: Controller, name: str) -> bool:
    """Node `name` of `ctl` is quarantined: wait for its next check (or the job's end), run it; True when
    it passed and the node rejoins."""
    assert ctl.assign is not None
    ctl.nodes[name].state = "quarantined"
    ev = threading.Event()
    ctl.assign.watch(name, ev, frozenset())   # the job's end (and `stop`) wake it early
    try:   # a stop (or the job's end) before the watch above woke no one: seen here, not after the wait
        if not (ctl._stop.is_set() or ctl.assign.all_done()):
            ctl._wait(ev, ctl.quarantine.wait_s(name, time.monotonic()))
    finally:
        ctl.assign.unwatch(name)
    if ctl._stop.is_set() or ctl.assign.all_done() or ctl.quarantine.wait_s(name, time.monotonic()) > 0:
        return False
    cause = ctl.node_check(name)
    if cause is not None:
        ctl.quarantine.failed_probe(name, cause, time.monotonic())
        ctl.say(logging.INFO, f"node {name} stays quarantined: {cause}")
        return False
    ctl.quarantine.release(name)
    ctl.nodes[name].state = "idle"
    ctl.say(logging.WARNING, f"node {name} passed its check again: it rejoins the job")
    return True
