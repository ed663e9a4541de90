"""The assignment state on disk: a snapshot and an append-only log of the changes since it.

The state used to be one `state.json` rewritten whole on every change: O(chunks) bytes per change,
≈ 5 MB × hundreds of changes a minute at 1,000 nodes (bench/bench_controller_scale.py). Now:

- `state.jsonl`: one JSON line per change, `{"seq": n, "chunks": {...}, "nodes": {...}, "event":
  {...}}` with every entity the change touched *as it is after it* (replaying a line twice is
  harmless). It is appended, flushed and fsync'd before the change is acknowledged (the method that
  made it returns, and only then does the controller act on it). A kill mid-write leaves a torn
  last line: it is ignored on reading and cut off before the next append.
- `state.json`: the snapshot, with the `seq` of the last change it holds. It is rewritten
  (atomically) once the log has grown to the snapshot's size, then the log is replaced by an empty
  one: each change costs O(1) bytes amortized (its line, plus at most its line's worth of the next
  snapshot), and a reload reads at most twice the snapshot. A reader takes the log first, then the
  snapshot, and replays the lines after the snapshot's seq: a compaction between its two reads
  loses nothing.
- A mirror on object storage (a job whose --output is there: `<output>/_control/`), so that a
  controller started on another machine with the same --output resumes the job: `plan.json`, the
  snapshot `state.json`, and the log as numbered segments `log/<first seq>.jsonl`. S3 has no
  append: the current segment is put whole on every change (one PUT, at most SEGMENT_BYTES) until
  it holds SEGMENT_BYTES, then the next one starts; a compaction puts the snapshot and deletes the
  segments it holds. A cut of a chunk is a line of the log too (its head and rest: `Assignments._cut`);
  plan.json is rewritten here and put there only at a compaction (or when the plan grows), before the
  snapshot, so it holds every cut the snapshot's lines had (replaying a cut twice changes nothing).
  The first upload puts the snapshot before the plan: a plan in the store says the state is there.
  With a mirror a change is acknowledged once its segment is in the store; a line appended here
  whose PUT failed was never acted on, and is put again with the next one.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleet.errors import FatalError
from fleet.generation.data.durable import atomic_write, fsync

if TYPE_CHECKING:
    from fleet.generation.data.objstore import Store

__all__ = ["StateLog", "pull", "LOG_FILE", "SNAPSHOT_FILE", "SEGMENT_BYTES", "CONTROL_DIR"]

SNAPSHOT_FILE = "state.json"
LOG_FILE = "state.jsonl"
PLAN_FILE = "plan.json"
CONTROL_DIR = "_control"      # under a job's --output on object storage
SEGMENT_BYTES = 16 << 10      # a log segment in the store is put whole per change: this bounds a PUT
MIN_COMPACT_BYTES = 64 << 10  # a tiny snapshot is not rewritten every few changes
PUT_TRIES = 3
PULL_TRIES = 8                # reads of the store's log until it has no gap (see _read_whole)
PULL_PAUSE_S = 0.5
_AFRESH = ("restore the job directory from a backup, or move it aside to start the job's state afresh "
           "(finished chunks then run again)")


class StateLog:
    """The snapshot + log of one job's state in `directory` (and its mirror in the store, if any).

    Not thread-safe by itself: `Assignments` calls it under its lock. The counters are the bench's
    (bytes written here and put in the store, by what)."""

    def __init__(self, directory: str | Path, mirror: Store | None = None) -> None:
        self.dir = Path(directory)
        self.mirror = mirror
        self.seq = 0                 # the last change's number (snapshot or log)
        self.snapshot_bytes = 0
        self.log_bytes = 0           # of whole lines in the log file
        self._log: Any = None        # the open append handle (the writer's, opened at its first append)
        self._segment: tuple[int, list[bytes]] | None = None   # the mirror's current segment: first seq, lines
        self._plan_stamp: tuple[int, int] | None = None       # plan.json as last put in the store
        self.counters: dict[str, int] = {"appends": 0, "log_bytes": 0, "snapshots": 0, "snapshot_bytes": 0,
                                         "puts": 0, "put_bytes": 0, "plan_puts": 0, "plan_put_bytes": 0}

    # -- reading

    def load(self) -> dict[str, Any]:
        """The state: the snapshot with every later log line applied (log read first, see above); a gap in
        their seqs raises FatalError (changes lost: never resumed from silently)."""
        lines = self.read_log()
        try:
            raw = (self.dir / SNAPSHOT_FILE).read_bytes()
        except FileNotFoundError:
            raw = b""
        snap: dict[str, Any] = json.loads(raw) if raw else {}
        self.snapshot_bytes = len(raw)
        base = int(snap.get("seq") or 0)
        state: dict[str, Any] = {"started_at": snap.get("started_at"), "chunks": dict(snap.get("chunks") or {}),
                                 "nodes": dict(snap.get("nodes") or {}), "events": list(snap.get("events") or [])}
        self.seq = base
        for rec in lines:
            if rec["seq"] <= base:
                continue
            if rec["seq"] != self.seq + 1:
                raise FatalError(f"{self.dir / LOG_FILE}: change {rec['seq']} follows change {self.seq}: the "
                                 f"changes between are missing", remedy=_AFRESH)
            apply(state, rec)
            self.seq = rec["seq"]
        return state

    def read_log(self) -> list[dict[str, Any]]:
        """The whole lines of the log; the byte length they span is `log_bytes` (a torn tail is after it)."""
        try:
            data = (self.dir / LOG_FILE).read_bytes()
        except FileNotFoundError:
            data = b""
        out: list[dict[str, Any]] = []
        end = 0
        for raw in data.splitlines(keepends=True):
            try:
                rec = json.loads(raw) if raw.endswith(b"\n") else None
            except ValueError:
                rec = None
            if not isinstance(rec, dict) or not isinstance(rec.get("seq"), int):
                if end + len(raw) < len(data):   # only the last line can be torn by a kill
                    raise FatalError(f"{self.dir / LOG_FILE}: line {len(out) + 1} is damaged, not the last one",
                                     remedy=_AFRESH)
                break
            out.append(rec)
            end += len(raw)
        self.log_bytes = end
        return out

    # -- writing

    def append(self, record: dict[str, Any]) -> int:
        """Append one change (fsync'd; put in the store when mirrored); its seq."""
        if self._log is None:
            self._open_for_append()
        self.seq += 1
        line = (json.dumps({"seq": self.seq, **record}, default=str, separators=(",", ":")) + "\n").encode()
        self._log.write(line)
        self._log.flush()
        os.fsync(self._log.fileno())
        self.log_bytes += len(line)
        self.counters["appends"] += 1
        self.counters["log_bytes"] += len(line)
        if self.mirror is not None:
            self._push(line)
        return self.seq

    def _open_for_append(self) -> None:
        """Open the log for appending, a torn last line (a kill mid-write) cut off first: the next line
        must not be glued to it."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / LOG_FILE
        f = open(path, "ab")
        if f.tell() != self.log_bytes:
            f.truncate(self.log_bytes)
            f.seek(self.log_bytes)
        self._log = f

    def due(self) -> bool:
        """The log has grown to the snapshot's size: time to compact."""
        return self.log_bytes >= max(self.snapshot_bytes, MIN_COMPACT_BYTES)

    def compact(self, snapshot: dict[str, Any]) -> None:
        """Write `snapshot` (the whole state as of `seq`) and start an empty log. Killed between the two:
        the old log's lines are all at or before the snapshot's seq, and skipped on reading."""
        data = json.dumps({**snapshot, "seq": self.seq}, default=str, separators=(",", ":")).encode()
        atomic_write(self.dir / SNAPSHOT_FILE, data)
        empty = self.dir / f".{LOG_FILE}.tmp"
        empty.write_bytes(b"")
        if self._log is not None:
            self._log.close()
            self._log = None
        os.replace(empty, self.dir / LOG_FILE)
        fsync(self.dir)
        self.snapshot_bytes, self.log_bytes = len(data), 0
        self.counters["snapshots"] += 1
        self.counters["snapshot_bytes"] += len(data)
        if self.mirror is not None:
            if self._plan_stamp is None and not self.mirror.exists(PLAN_FILE):
                # the first upload: plan.json is what says "the store holds the state" (`pull`), so it
                # goes last; killed or failed between the two PUTs, the next run keeps its state here
                self._put("state.json", data)
                self._put_plan()
            else:   # the plan first: the snapshot may name a cut's new chunk
                self._put_plan()
                self._put("state.json", data)
            for name in self.mirror.names("log"):
                self.mirror.fs.rm(self.mirror._p(f"log/{name}"))
            self._segment = None

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    # -- the mirror

    def _push(self, line: bytes) -> None:
        """Put the current segment, this line added, in the store (the plan first when it changed)."""
        self._put_plan()
        if self._segment is None:
            self._segment = (self.seq, [])
        first, lines = self._segment
        lines.append(line)
        self._put(f"log/{first:012d}.jsonl", b"".join(lines))
        if sum(len(x) for x in lines) >= SEGMENT_BYTES:
            self._segment = None

    def _put_plan(self) -> None:
        try:
            st = (self.dir / PLAN_FILE).stat()
        except FileNotFoundError:
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._plan_stamp:
            data = (self.dir / PLAN_FILE).read_bytes()
            self._put(PLAN_FILE, data)
            self._plan_stamp = stamp
            self.counters["plan_puts"] += 1
            self.counters["plan_put_bytes"] += len(data)

    def _put(self, name: str, data: bytes) -> None:
        assert self.mirror is not None
        for i in range(PUT_TRIES):
            try:
                self.mirror.write_bytes(name, data)
                break
            except Exception as exc:   # the store's errors have no common type (botocore, aiohttp, OSError)
                if i == PUT_TRIES - 1:
                    from fleet.generation.data.storeerrors import store_error

                    err = store_error(exc, self.mirror.url(name), "writing the job's state to")
                    if err is None:
                        raise
                    err.logged = True   # the controller says it once, as the job's end (Controller.fail_job)
                    raise err from None
                time.sleep(0.5 * (i + 1))
        self.counters["puts"] += 1
        self.counters["put_bytes"] += len(data)


def apply(state: dict[str, Any], rec: dict[str, Any]) -> None:
    """One log line onto the state (entities replaced whole: replaying a line twice is harmless)."""
    if rec.get("started_at") and not state.get("started_at"):
        state["started_at"] = rec["started_at"]
    state["chunks"].update(rec.get("chunks") or {})
    state["nodes"].update(rec.get("nodes") or {})
    if rec.get("event"):
        state["events"].append(rec["event"])


def _read_mirror(mirror: Store) -> tuple[bytes | None, list[bytes]]:
    """(the snapshot, the log lines after it in order). The segments are read first, the snapshot
    last, as a local reader does: a compaction between them puts the snapshot before it deletes."""
    lines: dict[int, bytes] = {}
    for name in mirror.names("log"):
        try:   # one GET: the current segment is replaced while a controller runs (a ranged read fails then)
            data: bytes = mirror.fs.cat_file(mirror._p(f"log/{name}"))
        except FileNotFoundError:   # deleted by a compaction since the listing: the snapshot holds it
            continue
        for raw in data.splitlines(keepends=True):
            if raw.endswith(b"\n"):
                lines[json.loads(raw)["seq"]] = raw
    snap = mirror.read_bytes("state.json")
    base = int(json.loads(snap).get("seq") or 0) if snap else 0
    return snap, [lines[k] for k in sorted(lines) if k > base]


def _local_plan_ahead(local: Path, stored: bytes) -> bool:
    """The plan here has chunks the store's lacks: plan.json rewritten here (a compaction holding cuts,
    a grown plan) whose PUT failed. A plan only grows (a cut shortens a chunk and adds its rest), and a
    cut of chunk files rewrote them here: the store's older plan would send the head's file as the whole
    chunk. The store's state never names the newer chunks, so they are pending: keep this plan (the
    store's cut lines, replayed onto it by `load_plan`, change nothing it holds)."""
    try:
        here = json.loads(local.read_bytes())
    except (FileNotFoundError, ValueError):
        return False
    return len(here.get("chunks") or []) > len(json.loads(stored).get("chunks") or [])


def pull(mirror: Store, directory: str | Path) -> bool:
    """Copy the job's state from the store into `directory` (plan.json, the snapshot, the log lines after
    it), replacing what is there but a plan ahead of the store's (`_local_plan_ahead`); False, and nothing
    here touched, when the store holds no plan (a new job, or one begun before the copy existed) or a plan
    without any state (an older controller put the plan first and failed before the snapshot: the state
    here is the only one, and is put there again). The store's copy is the truth for a job on object
    storage: what a controller appended only locally was never acknowledged. The plan is read last: it is
    put before any line that needs it. A log with a gap after PULL_TRIES reads raises FatalError."""
    if not mirror.exists(PLAN_FILE):
        return False
    snap, lines = _read_whole(mirror)
    if snap is None and not lines:
        return False
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    plan = mirror.read_bytes(PLAN_FILE)
    assert plan is not None   # never deleted once put
    if not _local_plan_ahead(d / PLAN_FILE, plan):
        atomic_write(d / PLAN_FILE, plan)
    if snap is not None:
        atomic_write(d / SNAPSHOT_FILE, snap)
    else:
        (d / SNAPSHOT_FILE).unlink(missing_ok=True)
    atomic_write(d / LOG_FILE, b"".join(lines))
    return True


def _read_whole(mirror: Store) -> tuple[bytes | None, list[bytes]]:
    """`_read_mirror` until the lines follow the snapshot without a gap: a compaction between the reads
    (an observer's pull while a controller runs) is read again at once, then after a pause; a gap that
    stays is a damaged copy, never resumed from (the changes in it would be lost)."""
    for attempt in range(PULL_TRIES):
        snap, lines = _read_mirror(mirror)
        base = int(json.loads(snap).get("seq") or 0) if snap else 0
        seqs = [json.loads(raw)["seq"] for raw in lines]
        if seqs == list(range(base + 1, base + 1 + len(seqs))):
            return snap, lines
        if attempt >= PULL_TRIES // 2:
            time.sleep(PULL_PAUSE_S)
    raise FatalError(f"{mirror.root}: the job's state log has a gap (snapshot at change {base}, log lines "
                     f"{seqs[:3]}{' …' if len(seqs) > 3 else ''}): changes are missing",
                     remedy="make sure no other controller runs this job and run it again; if the gap stays, "
                            f"move {mirror.root} aside to start the job's state afresh (finished chunks then run "
                            "again)")
