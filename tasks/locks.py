"""One Prefect global concurrency limit per node, so two runs never launch onto the same GPUs.

Every action that changes or probes what runs on a node (bringup, revalidate, teardown)
holds a slot of `fleet-node-<node>` for each node of its config, for the whole action.
The limit has one slot and is created on first use. The node's name in the lock is the
machine, not the fleet config: `<host>-<port>` for an SSH node, `block-<name>` for a node
given by a fleet-node block, `local-<hostname>` for the machine the flow runs on. So two
fleet configs that point at the same machine also wait for each other.

What a second run does while the first holds the node: it logs which run holds it and for
how long, shows as Running in the UI, and proceeds as soon as the slot is free (then adopts
what the first one launched: same launch spec, same pids). After `wait_s` it ends Failed
with "node busy", naming the holder.

A lock that heals. The slot count lives in the Prefect database, but the lease that would
free it when its holder dies lives in the memory of the server that granted it — and fleet's
embedded server dies with each command, a real server loses it on restart. So a slot whose
holder was killed stayed taken forever. Each holder therefore also writes a *holder record*
(a Prefect Variable `<limit>-holder`: flow run, host + machine id, pid and its start time,
lease id, since, heartbeat). A waiting run checks it: a holder whose process is gone (same
machine), whose flow run ended, or whose heartbeat stopped (another machine) is dead, and the
waiting run reclaims its slot and says so ("reclaimed the lock of run X, which is no longer
running"). Deleting the record by id is the claim: of several waiting runs exactly one
reclaims. A taken slot with no record (an older fleet, or a holder killed in the instant
between taking the slot and writing its record) is reclaimed after `ORPHAN_GRACE_S`, longer
than a Prefect lease, so a real server's own expiry always comes first. A release that leaves
the slot taken (Prefect answers the release of a lease it no longer has with 204, freeing
nothing) keeps its record, marked released: the next run frees that slot at once.

All limits live in the database the Prefect API uses: two `fleet` commands on one machine,
each with its own embedded server but the same PREFECT_HOME, exclude each other too.
"""

from __future__ import annotations

import contextvars
import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from typing import Any
from uuid import UUID

from fleet.config import FleetConfig, NodeConfig
from fleet.errors import TransientError

LOCK_PREFIX = "fleet-node-"
LEASE_S = 120.0       # Prefect lease of a held slot (renewed every BEAT_S)
BEAT_S = 20.0         # holder heartbeat: renew the lease, refresh the record
STALE_S = LEASE_S     # a holder on another machine whose record is older than this is dead
ORPHAN_GRACE_S = LEASE_S + 30.0  # a taken slot with no holder record is reclaimed after this
POLL_S = 1.0          # how often a waiting run looks again
CLEANUP_WAIT_S = 5.0  # the shutdown's cleanup waits this long for a release under way (`Once`)
_BAD = re.compile(r"[^a-z0-9-]+")


def node_lock_name(node_cfg: NodeConfig) -> str:
    """The concurrency limit that guards this machine (a-z, 0-9, -)."""
    if node_cfg.kind == "ssh":
        ident = f"block-{node_cfg.block}" if node_cfg.block and not node_cfg.host else f"{node_cfg.host}-{node_cfg.port}"
    else:
        ident = f"local-{socket.gethostname()}"
    return (LOCK_PREFIX + _BAD.sub("-", ident.lower()).strip("-"))[:100]


def lock_names(cfg: FleetConfig) -> list[str]:
    return sorted({node_lock_name(n) for n in cfg.nodes})


def ensure_limits(names: list[str]) -> None:
    """Create each one-slot limit unless it exists; warn when someone widened or disabled it."""
    from prefect import get_run_logger
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        for name in names:
            try:
                existing = client.read_global_concurrency_limit_by_name(name)
            except ObjectNotFound:
                try:
                    client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
                except ObjectAlreadyExists:
                    pass  # another run created it meanwhile
                continue
            if existing.limit != 1 or not existing.active:
                get_run_logger().warning(
                    "concurrency limit %s has limit=%s active=%s: runs may launch onto the same GPUs at once; "
                    "set it back with `prefect gcl update %s --limit 1 --enable`",
                    name, existing.limit, existing.active, name)


@dataclass(frozen=True)
class Holder:
    """Who holds a node lock: what a waiting run needs to tell whether it still runs."""

    run_id: str | None
    run_name: str
    purpose: str
    host: str
    machine: str    # /etc/machine-id: two machines may share a hostname
    pid: int
    pid_start: str  # field 22 of /proc/<pid>/stat: a reused pid is not the holder
    lease_id: str
    since: float    # epoch seconds

    def describe(self) -> str:
        return f"run {self.run_name!r} ({self.purpose}, pid {self.pid} on {self.host})"


def record_name(limit: str) -> str:
    return f"{limit}-holder"


def _machine_id() -> str:
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            return open(path).read().strip()
        except OSError:
            continue
    return ""


def _proc_stat(pid: int) -> list[str] | None:
    try:
        text = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # [0] state, [19] start time


def _pid_start(pid: int) -> str:
    st = _proc_stat(pid)
    return st[19] if st else ""


def _process_alive(pid: int, start: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    st = _proc_stat(pid)
    if st is None:
        return not os.path.isdir("/proc")  # no procfs (not Linux): os.kill said it exists
    return st[0] not in ("Z", "X") and (not start or st[19] == start)


def _why_gone(client: Any, h: Holder, age_s: float, released: bool = False) -> str | None:
    """Why the holder of a record is gone for good, or None while it may still run."""
    from prefect.exceptions import ObjectNotFound

    if released:   # its holder gave the slot back, and Prefect did not free it (`kept_records`)
        return "its holder released it, but the slot was not freed"
    if h.machine and h.machine == _machine_id() and h.host == socket.gethostname():
        if not _process_alive(h.pid, h.pid_start):
            return f"its process {h.pid} is gone"
    elif age_s > STALE_S:
        return f"its heartbeat stopped {age_s:.0f} s ago"
    if h.run_id:
        try:
            state = client.read_flow_run(UUID(h.run_id)).state
        except ObjectNotFound:
            return "its flow run is unknown to this Prefect server"
        if state is not None and state.is_final():
            return f"its flow run ended {state.name}"
    return None


def _status(exc: BaseException) -> int | None:
    return getattr(getattr(exc, "response", None), "status_code", None)


def _read_record(client: Any, limit: str) -> tuple[Any, Holder | None]:
    """(the Variable, its Holder) or (None, None)."""
    var = client.read_variable_by_name(record_name(limit))
    if var is None:
        return None, None
    try:
        value = var.value if isinstance(var.value, dict) else json.loads(var.value)
        return var, Holder(**{k: value[k] for k in Holder.__dataclass_fields__})
    except (TypeError, ValueError, KeyError):
        return var, None  # not ours / unreadable: treated as no holder record


def _delete_record(client: Any, var_id: Any) -> bool:
    """Delete one record by id; False if it was gone already (another run deleted it first)."""
    try:
        client.request("DELETE", "/variables/{id}", path_params={"id": var_id})
        return True
    except Exception as exc:
        if _status(exc) == 404:
            return False
        raise


def _active_slots(client: Any, limit: str) -> int:
    return int(client.read_global_concurrency_limit_by_name(limit).active_slots)


def kept_records(names: list[str], lease_id: str, active: Any, record_lease: Any) -> list[str]:
    """After a release: the limits whose slot may still be this lease's — still taken, and its holder
    record still this lease's (a new holder replaces the record as it takes the slot). Their records
    are kept, marked released (`release_marked`), so that the next run frees the slot at once, even
    while this process lives on (a job after its bring-up); deleted, the slot was an orphan that every
    run waited ORPHAN_GRACE_S (150 s) for. Seen on an idle CI run:
    a `fleet up` after a SIGTERM'd one found the slot taken with no record. Prefect answers a release
    of a lease it no longer has (its lease storage is the server's memory) with 204 and frees
    nothing; a failed release request does the same. A doubt (an error) counts as taken."""
    kept = []
    for name in names:
        try:
            if active(name) > 0 and record_lease(name) == lease_id:
                kept.append(name)
        except Exception:
            kept.append(name)
    return kept


def release_marked(value: dict[str, Any]) -> dict[str, Any]:
    """A kept holder record's value: its holder gave the slot back (`_why_gone` reclaims it at once)."""
    return {**value, "released": time.time()}


def _warn_kept(logger: Any, kept: list[str], error: BaseException | None) -> None:
    why = f"the release failed: {str(error).splitlines()[0][:200] if str(error) else type(error).__name__}" \
        if error is not None else "Prefect freed nothing for its lease"
    logger.warning("the node lock %s may still be taken after its release (%s): its holder record is kept, so "
                   "the next run frees it at once", ", ".join(kept), why)


def _reclaim_dead(client: Any, limit: str, var: Any, h: Holder, why: str, logger: Any) -> None:
    """Free the slot of a dead holder. Deleting its record (by id) is the claim: only one run wins."""
    if not _delete_record(client, var.id):
        return
    try:  # the lease still exists on this server: revoke it (a later expiry must not free it twice)
        client.renew_concurrency_lease(UUID(h.lease_id), LEASE_S)
        client.release_concurrency_slots_with_lease(UUID(h.lease_id))
    except Exception:
        # The lease died with the server that granted it: the slot is leaked, free it by hand
        # unless a new holder took the slot since (it writes its record right after).
        if _active_slots(client, limit) > 0 and _read_record(client, limit)[0] is None:
            client.release_concurrency_slots([limit], 1, max(1.0, time.time() - h.since))
    logger.warning("reclaimed the lock %s of %s, which is no longer running (%s); it held it since %s",
                   limit, h.describe(), why, time.strftime("%H:%M:%S", time.localtime(h.since)))
    _mark_crashed(client, h, why)


def _mark_crashed(client: Any, h: Holder, why: str) -> None:
    """A killed run stays Running in Prefect for ever: say what became of it (best effort)."""
    from prefect.states import Crashed

    if not h.run_id:
        return
    try:
        state = client.read_flow_run(UUID(h.run_id)).state
        if state is not None and not state.is_final():
            client.set_flow_run_state(UUID(h.run_id), Crashed(message=f"no longer running ({why}); its node lock "
                                                                      "was reclaimed by a later run"), force=True)
    except Exception:
        pass


def _reclaim_orphan(client: Any, limit: str, seen_s: float, logger: Any) -> None:
    """A taken slot with no holder record for ORPHAN_GRACE_S: free it, one run at a time."""
    from prefect.client.schemas.actions import VariableCreate
    from prefect.exceptions import ObjectAlreadyExists

    name = f"{limit}-reclaim"
    try:
        token = client.create_variable(VariableCreate(name=name, value={"pid": os.getpid(), "at": time.time()}))
    except ObjectAlreadyExists:
        var = client.read_variable_by_name(name)
        if var is not None and isinstance(var.value, dict) and time.time() - var.value.get("at", 0) > 60:
            _delete_record(client, var.id)  # its reclaimer died; the next turn tries again
        return
    try:
        if _active_slots(client, limit) > 0 and _read_record(client, limit)[0] is None:
            client.release_concurrency_slots([limit], 1, max(1.0, seen_s))
            logger.warning("reclaimed the lock %s, taken for %.0f s by a run that left no holder record (an older "
                           "fleet, or a run killed as it took the lock)", limit, seen_s)
    finally:
        _delete_record(client, token.id)


def _try_acquire(client: Any, names: list[str], run_id: str | None) -> str | None:
    """The lease id, or None while another run holds one of the limits (all or nothing)."""
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder

    holder = ConcurrencyLeaseHolder(type="flow_run", id=UUID(run_id)) if run_id else None
    try:
        resp = client.increment_concurrency_slots_with_lease(names, 1, "concurrency", LEASE_S, holder=holder)
    except Exception as exc:
        if _status(exc) == 423:
            return None
        raise
    return str(resp.json()["lease_id"])


class Once:
    """`fn` run once, in a thread of its own, every caller waiting for its end (the first up to
    `first_wait_s`, the others up to CLEANUP_WAIT_S). A lock's release runs in the main thread on a
    SIGTERM too (Prefect's handler raises there, `hold_nodes` releases on the way out), and `timeout`
    sends its SIGTERM twice (to the command, then to its group): the second one's exception, raised
    inside the release, cut it short, and the slot stayed taken with its record (the next `fleet up`
    reclaimed it: a test_timeout_stops_a_bringup_like_ctrl_c failure); and the shutdown's cleanup,
    finding the release begun, returned at once and ended the process in its middle. A caller's
    exception now ends only its wait; the release goes on, and the other callers wait for it."""

    def __init__(self, fn: Any, what: str, logger: Any = None, first_wait_s: float = 120.0) -> None:
        self._fn, self._what, self._logger, self._first_wait_s = fn, what, logger, first_wait_s
        self._lock = threading.Lock()
        self._started = False
        self._done = threading.Event()

    def __call__(self) -> None:
        with self._lock:
            first, self._started = not self._started, True
        if first:
            ctx = contextvars.copy_context()   # the settings context (an in-process flow's API), as the beat's

            def run() -> None:
                try:
                    ctx.run(self._fn)
                except Exception as exc:
                    if self._logger is not None:
                        self._logger.warning("%s failed: %s", self._what,
                                             str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
                finally:
                    self._done.set()

            try:
                threading.Thread(target=run, name="fleet-lock-release", daemon=True).start()
            except RuntimeError:   # no new threads while the interpreter shuts down: here, then
                run()
        self._done.wait(self._first_wait_s if first else CLEANUP_WAIT_S)


class _Taking:
    """The slot being taken, until `_Held` owns it. The server grants the slot before its answer
    reaches this process, and the holder record comes after: a SIGTERM landing in between
    (`timeout` firing during a busy machine's first steps) made Prefect's handler raise in the
    middle of the request, the lease id was never read, and the slot stayed taken with no record:
    the next command waited ORPHAN_GRACE_S to reclaim it. So during the request a SIGINT/SIGTERM
    is only noted (the main thread's handlers are swapped for a recorder), and acted on once the
    answer is in and its slot given back — never returning that slot as held; a cleanup registered
    before the request gives the slot back when the command's shutdown runs first (it waits,
    within the shutdown's deadline, for the answer in flight); and whatever leaves `hold_nodes`
    before `_Held` owns the slot gives it back (`give_back`). Every release of the lease, this
    one's and `_Held`'s, goes through one latch: two releases at once each decremented the limit,
    freeing another run's slot."""

    def __init__(self, names: list[str]) -> None:
        from fleet.interrupt import CLEANUP_DEADLINE_S, on_interrupt

        self.lease_id: str | None = None
        self._answered = threading.Event()
        self._answered.set()
        self.latch = threading.Lock()   # taken by the one release of the lease (here or `_Held`)
        self._wait_s = CLEANUP_DEADLINE_S * 0.75
        self._give_back = Once(self._give_back_once, "giving back the slot being taken")
        self._unregister = on_interrupt(f"give back the slot being taken of {', '.join(names)}", self.give_back,
                                        order=50)

    def take(self, client: Any, names: list[str], run_id: str | None) -> str | None:
        noted: list[int] = []
        with _signals_noted(noted) as handlers:
            self._answered.clear()
            try:
                self.lease_id = _try_acquire(client, names, run_id)
            finally:
                self._answered.set()
        handler = handlers.get(noted[0]) if noted else signal.SIG_IGN
        if handler != signal.SIG_IGN:   # the command is being stopped: give the slot back, then let the signal act
            try:
                self.give_back()
            finally:
                _deliver(noted[0], handler)
            # its handler did not raise (the command's own: its shutdown ends the process): go no further
            raise KeyboardInterrupt
        return self.lease_id

    def give_back(self) -> None:
        """Release the lease taken (or in flight), once; nothing when none was granted."""
        self._answered.wait(self._wait_s)
        if self.lease_id is not None:
            self._give_back()

    def _give_back_once(self) -> None:
        from prefect.client.orchestration import get_client

        if not self.latch.acquire(blocking=False):   # `_Held` released it
            return
        with get_client(sync_client=True) as client:   # its own: the main thread may be using its client
            client.release_concurrency_slots_with_lease(UUID(str(self.lease_id)))

    def done(self) -> None:
        """Taken and handed to `_Held`, or given up: this cleanup is no longer needed."""
        self._unregister()


@contextmanager
def _signals_noted(noted: list[int]) -> Iterator[dict[int, Any]]:
    """SIGINT, SIGTERM and SIGHUP only noted (appended to `noted`) for the body, in the main thread, where
    Python runs their handlers; elsewhere nothing changes (no handler runs there). Yields the
    handlers it put aside (what `_deliver` calls)."""
    if threading.current_thread() is not threading.main_thread():
        yield {}
        return
    before: dict[int, Any] = {s: signal.signal(s, lambda signum, frame: noted.append(signum))
                              for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield before
    finally:
        for s, handler in before.items():
            # None: set outside Python, cannot be put back; the default then, never the recorder for good
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def _deliver(signum: int, handler: Any) -> None:
    """Act on a signal noted earlier as its handler would have: call a Python handler (Prefect's
    raises TerminationSignal, Python's own KeyboardInterrupt). Not raised again at the process: the
    command's watcher already saw it once (fleet/interrupt.py), and would count a SIGINT sent twice
    as the second Ctrl-C that cuts the cleanups short."""
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        signal.raise_signal(signum)


class _Held:
    """A lease this process holds, its records, and the heartbeat that keeps both fresh."""

    def __init__(self, names: list[str], holder: Holder, record_ids: dict[str, Any], logger: Any,
                 latch: threading.Lock) -> None:
        from fleet.interrupt import on_interrupt

        self.names, self.holder, self.record_ids, self.logger = names, holder, record_ids, logger
        self._latch = latch   # shared with `_Taking`: the lease is released once
        self._stop = threading.Event()
        self._release_once = Once(self._release_then_unregister, f"releasing {', '.join(names)}", logger)
        # in this context: a plain thread starts with none, and Prefect's client there reads only the
        # environment — with the API set by a settings context (a flow called in-process under
        # `temporary_settings`) the heartbeat started a temporary server of its own and renewed the
        # lease there, not on the server that holds the lock
        self._beat = threading.Thread(target=contextvars.copy_context().run, args=(self._beat_loop,),
                                      name="fleet-lock-heartbeat", daemon=True)
        self._beat.start()
        # Ctrl-C ends the command with os._exit (fleet/interrupt.py): give the slot back first,
        # at the same time as the flow run is marked Crashed (flows/api.py, also order 50).
        self._unregister = on_interrupt(f"release {', '.join(names)}", self.release, order=50)

    def _beat_loop(self) -> None:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import VariableUpdate

        while not self._stop.wait(BEAT_S):
            try:
                with get_client(sync_client=True) as client:
                    client.renew_concurrency_lease(UUID(self.holder.lease_id), LEASE_S)
                    for name in self.names:
                        if self._stop.is_set():   # released meanwhile: its records are removed or marked
                            break
                        value = {**asdict(self.holder), "beat": time.time()}
                        client.update_variable(VariableUpdate(name=record_name(name), value=value))
            except Exception as exc:  # one failed beat is not fatal; the next one retries
                self.logger.warning("lock heartbeat for %s failed: %s", ", ".join(self.names),
                                    str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)

    def release(self) -> None:
        """Give the slot back, then remove the records (idempotent; also the Ctrl-C path)."""
        self._release_once()

    def _release_then_unregister(self) -> None:
        try:
            self._release()
        finally:
            self._unregister()   # only now: a shutdown that starts meanwhile waits for this release (`Once`)

    def _release(self) -> None:
        from prefect.client.orchestration import get_client

        self._stop.set()
        lease = self.holder.lease_id
        with get_client(sync_client=True) as client:
            error: BaseException | None = None
            if self._latch.acquire(blocking=False):
                try:
                    client.release_concurrency_slots_with_lease(UUID(lease))
                except Exception as exc:
                    error = exc
            kept = kept_records(self.names, lease, lambda n: _active_slots(client, n),
                                lambda n: getattr(_read_record(client, n)[1], "lease_id", None))
            if kept:
                _warn_kept(self.logger, kept, error)
            for name, var_id in self.record_ids.items():
                try:
                    if name in kept:   # by id: a record a new holder wrote since is not touched
                        client.request("PATCH", "/variables/{id}", path_params={"id": var_id},
                                       json={"value": release_marked(asdict(self.holder))})
                    else:
                        _delete_record(client, var_id)
                except Exception:
                    pass  # a record left behind names a process that is gone: the next run heals it


def _write_records(client: Any, names: list[str], holder: Holder) -> dict[str, Any]:
    """A fresh record (new id) per limit; a stale one of a run that is gone is replaced."""
    from prefect.client.schemas.actions import VariableCreate
    from prefect.exceptions import ObjectAlreadyExists

    ids = {}
    for name in names:
        value = {**asdict(holder), "beat": time.time()}
        for _ in range(3):
            try:
                ids[name] = client.create_variable(VariableCreate(name=record_name(name), value=value)).id
                break
            except ObjectAlreadyExists:
                old = client.read_variable_by_name(record_name(name))
                if old is not None:
                    _delete_record(client, old.id)
    return ids


def _wait_for_slot(client: Any, names: list[str], run_id: str | None, taking: _Taking, *, wait_s: float,
                   purpose: str, logger: Any) -> str:
    """Take a slot of every limit (all or nothing), waiting while another run holds one: its holder
    named in the log, a dead holder's or an orphan slot reclaimed; NodeBusy after `wait_s`."""
    t0 = time.monotonic()
    orphan_since: dict[str, float] = {}
    said, said_at = "", 0.0
    while True:
        lease_id = taking.take(client, names, run_id)
        if lease_id is not None:
            return lease_id
        holders = []
        for name in names:
            var, h = _read_record(client, name)
            if h is not None:
                orphan_since.pop(name, None)
                released = isinstance(var.value, dict) and bool(var.value.get("released"))
                why = (_why_gone(client, h, time.time() - var.updated.timestamp(), released)
                       if var.updated else None)
                if why:
                    _reclaim_dead(client, name, var, h, why, logger)
                    continue
                holders.append(f"{name} is held by {h.describe()} for {time.time() - h.since:.0f} s")
            elif _active_slots(client, name) > 0:
                seen = time.monotonic() - orphan_since.setdefault(name, time.monotonic())
                if seen > ORPHAN_GRACE_S:
                    _reclaim_orphan(client, name, seen, logger)
                    continue
                holders.append(f"{name} is taken by a run that left no holder record (reclaimed if still so "
                               f"after {ORPHAN_GRACE_S:.0f} s)")
        # Said before the give-up check: a run whose first look already took longer than wait_s
        # (a busy machine, a short node_wait_s) still names the holder in its log once.
        text = "; ".join(holders)
        if holders and (text.split(" for ")[0] != said.split(" for ")[0] or time.monotonic() - said_at > 60):
            logger.warning("%s: %s; waiting (up to %.0f s)", purpose, text, wait_s)
            said, said_at = text, time.monotonic()
        waited = time.monotonic() - t0
        if waited > wait_s:
            raise NodeBusy(f"{purpose}: node busy after waiting {wait_s:.0f} s: "
                           + ("; ".join(holders) or f"{', '.join(names)} refused a slot"),
                           remedy="wait for that run to end (`fleet status`, the Prefect UI), or raise the "
                                  "flow parameter node_wait_s")
        time.sleep(POLL_S if holders else 0.05)


@contextmanager
def hold_nodes(cfg: FleetConfig, *, wait_s: float, purpose: str) -> Iterator[list[str]]:
    """Hold every node of `cfg` for the body (all limits at once: no deadlock between multi-node fleets)."""
    from prefect import get_run_logger
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    from fleet.interrupt import interrupted, park

    logger = get_run_logger()
    names = lock_names(cfg)
    ensure_limits(names)
    ctx = FlowRunContext.get()
    run_id = str(ctx.flow_run.id) if ctx and ctx.flow_run else None
    run_name = ctx.flow_run.name if ctx and ctx.flow_run else f"pid {os.getpid()}"
    taking = _Taking(names)
    try:
        with get_client(sync_client=True) as client:
            lease_id = _wait_for_slot(client, names, run_id, taking, wait_s=wait_s, purpose=purpose, logger=logger)
            holder = Holder(run_id=run_id, run_name=run_name, purpose=purpose, host=socket.gethostname(),
                            machine=_machine_id(), pid=os.getpid(), pid_start=_pid_start(os.getpid()),
                            lease_id=lease_id, since=time.time())
            records = _write_records(client, names, holder)
        held = _Held(names, holder, records, logger, taking.latch)
    except BaseException:
        # anything that leaves before `_Held` owns the slot (a failed record, a Cancel's TerminationSignal
        # under a worker, where no shutdown cleanup runs) gives it back
        with suppress(Exception):   # the error that brought us here is the one to report
            taking.give_back()
        raise
    finally:
        taking.done()   # from here `held` gives the slot back (also on a Ctrl-C)
    try:
        if interrupted():  # Ctrl-C came while we waited: the process is on its way out
            raise KeyboardInterrupt
        logger.info("%s: holding %s", purpose, ", ".join(names))
        yield names
    finally:
        try:
            held.release()
        finally:
            if interrupted():
                # The work ended after a Ctrl-C (a bring-up that finished, or failed, while the
                # cleanups ran): stop here, or the flow run would end Completed (or Failed) over
                # the Crashed the cleanups set. The shutdown ends the process.
                park()


class NodeBusy(TransientError):
    """Another run held the node longer than this run would wait."""
