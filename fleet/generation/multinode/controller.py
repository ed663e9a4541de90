"""The controller of a multi-node job: hands chunks to nodes, watches them, survives its own death.

Prefect-free: `tasks/multinode.py` wraps `Controller.node_loop` (one Prefect task per node)
and `Controller.run_chunk` (one Prefect task run per chunk attempt). See `chunks.py` for the
plan, the assignment state and the merge rule.

Per node, in a loop: claim a chunk (the node's own running chunk first: that is how a new
controller re-attaches; else the next one, cut to the node's measured rate and left to a faster
node that would end it sooner — `next_size`), put its input on the node, start the ordinary detached runner into
`<output>/<node>/chunk-NNNNN` (or re-attach to the one running there), and watch its
progress.json. While it runs, committed shards are gathered every `fetch_every_s`, so what a
node committed survives the node. A chunk ends:

- done: the runner wrote a complete manifest; the whole output is gathered locally;
- failed: the runner exited without finishing (killed, crashed); the chunk goes back to the
  queue (resume on whichever node claims it next), at most `MAX_FAILED_ATTEMPTS` times;
- lost: the node did not answer, or its runner's progress file stopped changing, or none of
  its servers was up, for `node_lost_s` (a runner that has not written its first progress yet
  gets `runner_start_s`: `RunnerLiveness`). The chunk goes back to the queue at once; the next
  attempt on another node starts from the shards gathered from the lost one (copied into its
  output directory, so the runner's own resume skips those ids). The lost node is probed
  every `probe_s`; when it answers again it rejoins and claims chunks like the others.

With an --output on object storage (`self.store`) nothing of the data passes through here: each
runner reads its chunk from the store (a byte range of a JSONL input, the rows of a Parquet one,
a chunk object under `<output>/_inputs/` for a gzip one), works in a copy under its node's workdir, and puts its commits under
`<output>/_parts/<node>/<chunk>/` itself (fleet.generation.job.publish); a chunk is done when its
manifest is there; a next attempt is seeded by its runner from the earlier attempts' parts; the
merge reads the parts and writes the job's output at `<output>` (`merge_job(store=…)`).

The code lives in four modules, their public names re-exported here: controller.py (`Controller`: the
per-node loop, the sizes, the probes, the job's progress), nodework.py (`NodeWork`, `RateView`,
`RunnerLiveness`, `NodeLost` / `ChunkFailed`), runchunk.py (`ChunkRuns`, `Controller`'s base: one chunk
attempt run, watched, collected) and jobend.py (`merge_job`, `part_url`, `fetch_job`, `find_plan_dir`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import posixpath
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fleet.config import FleetConfig, NodeConfig
from fleet.errors import ConfigError, FatalError, FleetError, InputChanged, JobConflict, StoreError, Stopped
from fleet.generation.data.durable import write_json_atomic
from fleet.generation.data.objstore import Store, is_url
from fleet.generation.job.progress import PROGRESS_FILE
from fleet.generation.multinode.chunks import MIN_CHUNK_S, Assignments, Chunk, Plan, chunk_rows_for, load_plan, split_input
from fleet.generation.multinode.fence import attempt_name, attempt_part, stop_abandoned_on
from fleet.generation.multinode.jobend import (  # noqa: F401
    STORE_FILE, _Rows, _attempt_source, _job_cost, _job_sources, _node_rates, fetch_job, find_plan_dir, merge_job, part_url, plan_root)
from fleet.generation.multinode.journal import CONTROL_DIR, pull
from fleet.generation.multinode.nodework import (  # noqa: F401
    ChunkFailed, NodeLost, NodeWork, PRESTART_LEAD_S, RateView, RunnerLiveness, _Asking, _draining, _retry, _unreachable)
from fleet.generation.multinode.progress import job_eta
from fleet.generation.multinode.quarantine import Quarantine, set_aside, wait_and_check
from fleet.generation.multinode.runchunk import LOG_KEPT_BYTES, LOGS_DIR, ChunkRuns  # noqa: F401
from fleet.node import Node, connect

log = logging.getLogger("fleet.generation.multinode.controller")

__all__ = ["Controller", "NodeWork", "NodeLost", "ChunkFailed", "RateView", "RunnerLiveness", "ChunkRuns", "merge_job",
           "part_url", "plan_root", "find_plan_dir", "fetch_job", "MAX_FAILED_ATTEMPTS", "IDLE_MAX_S", "PRESTART_LEAD_S",
           "STORE_FILE", "LOGS_DIR", "LOG_KEPT_BYTES"]

MAX_FAILED_ATTEMPTS = 3
IDLE_MAX_S = 8.0   # the longest an idle node waits before asking again when nothing it waits on changed


class Controller(ChunkRuns):
    def __init__(self, cfg: FleetConfig, plan_dir: str | Path, output: str, nodes: dict[str, NodeWork], *,
                 node_lost_s: float | None = None, probe_s: float = 10.0, poll_s: float = 1.0,
                 fetch_every_s: float = 30.0, rejoin_s: float = 3600.0, idle_max_s: float = IDLE_MAX_S,
                 say: Callable[[int, str], None] | None = None) -> None:
        self.cfg = cfg
        self.plan_dir = Path(plan_dir)
        self.output = output.rstrip("/")
        self.nodes = nodes
        self.node_lost_s = node_lost_s if node_lost_s is not None else cfg.generation.node_lost_s
        self.runner_start_s = cfg.generation.runner_start_s
        self.probe_s, self.poll_s, self.rejoin_s = probe_s, poll_s, rejoin_s
        self.idle_max_s = max(poll_s, idle_max_s)
        self._asking: dict[str, _Asking] = {}
        self._sooner: dict[str, str | None] = {}   # per node: the faster node its last "wait" left the chunk to
        # gather committed shards often enough that a node lost now costs little
        self.fetch_every_s = min(fetch_every_s, max(1.0, self.node_lost_s / 4))
        # where the controller's own lines go (the Prefect layer passes its run logger)
        self.say: Callable[[int, str], None] = say or (lambda level, msg: log.log(level, msg))
        # An output on object storage: the runners read their chunks from it and put their commits there
        # (`part_url`); the controller gathers nothing, and the merge goes from the store to the store.
        self.store = Store(self.output) if is_url(self.output) else None
        self.plan: Plan | None = None
        self.assign: Assignments | None = None
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._connections: dict[str, Node] = {}   # each node's connection, kept across its chunk attempts
        self._conn_lock = threading.Lock()
        # what ended the job before its chunks were done, when it is not a chunk's own failure: the input
        # changed under it, the store refused; one line with its remedy (flows/multinode.py says it)
        self.failure: FleetError | None = None
        self._view = RateView(list(nodes))
        # nodes whose chunks failed for a reason of their own: no chunk until their check passes (quarantine.py)
        self.quarantine = Quarantine(probe_s)
        self.set_aside: dict[str, str] = {}   # nodes left out before the job (their store check failed): the cause
        # the job's cost per node (cost.py): when the nodes were taken (the bring-up's start, wall clock; None:
        # the state's start), the GPUs of every node taken (set aside ones too), when each set-aside one was let go
        self.held_since: float | None = None
        self.node_gpus: dict[str, int] = {n: w.gpus for n, w in nodes.items()}
        self.aside_at: dict[str, float] = {}
        self.node_check: Callable[[str], str | None] = self._node_check
        for w in nodes.values():
            w.changed = self._view.dirty
        # The chunk runners read the whole chunk: the job's --limit was applied when cutting.
        self.chunk_cfg = cfg.model_copy(deep=True)
        self.chunk_cfg.generation.limit = None

    # -- setup

    def prepare(self, input_path: str) -> Plan:
        """The plan and the state: read back (from the store's `_control/` for a job there: the copy a
        controller on any machine reads), else cut now (a gzip input on the store staged here first: `_staged`)."""
        self.plan_dir.mkdir(parents=True, exist_ok=True)
        mirror = self.store.child(CONTROL_DIR) if self.store is not None else None
        pulled = False
        if mirror is not None:
            pulled = pull(mirror, self.plan_dir)
            if pulled:
                self.say(logging.INFO, f"the job's plan and state read from {mirror.root}")
        from fleet.generation.data.storeerrors import translated

        with translated(input_path, "reading"):   # a store's refusal in one line (InputChanged as it is)
            input_path = self._staged(input_path)
            self.plan = split_input(input_path, self.plan_dir, sorted(self.nodes),
                                    chunk_rows=self.cfg.generation.chunk_rows, limit=self.cfg.generation.limit)
        self.assign = Assignments(self.plan_dir, self.plan, mirror)
        if mirror is not None and not pulled:
            # a new job, or one begun before the store's copy: the plan and the whole state go there
            # first (its log lines alone would lack what this machine's state held before them)
            self.assign.compact()
        if self.store is not None:   # `fleet fetch` merges from the store: it needs the URL
            write_json_atomic(self.plan_dir / STORE_FILE, {"output": self.output})
        return self.plan

    def _staged(self, url: str) -> str:
        """The input to cut: itself, or for a gzip on the store (not read in place) a copy downloaded once
        into the plan directory and cut there. A job already cut from such a copy resumes only where the
        copy is: refused here, before the download, when it is not on this machine."""
        from fleet.errors import ConfigError
        from fleet.generation.data.ranges import in_place
        from fleet.generation.job.publish import stage_input

        if not is_url(url) or in_place(url):
            return url
        old = load_plan(self.plan_dir)
        if old is not None and not (Path(old.input).is_relative_to(self.plan_dir) and Path(old.input).is_file()):
            raise ConfigError(f"this output belongs to a multi-node job cut from {old.input}, which is not on "
                              f"this machine in {self.plan_dir} (a gzip input on the store is staged and cut on "
                              f"the controller's machine); the input now is {url}",
                              remedy="resume the job on the machine that began it (the same command there), or "
                                     "run the input as JSONL or Parquet (read in place: resumable from any "
                                     "machine) under another --output")
        return stage_input(url, self.plan_dir / "source")

    def node_cfg(self, name: str) -> NodeConfig:
        return self.cfg.node(name)

    def chunk(self, index: int) -> Chunk:
        assert self.plan is not None
        return self.plan.chunks[index]

    def chunk_output(self, node: str, chunk: Chunk) -> str:
        """The chunk's output directory on the node (with a store: a working copy under the node's workdir)."""
        if self.store is not None:   # one per attempt (fence.py): the node's running one, else a new name
            key = hashlib.sha256(self.output.encode()).hexdigest()[:10]
            return f"{self.node_cfg(node).workdir.rstrip('/')}/objstore/{key}/{node}/{self._attempt_name(node, chunk)}"
        return f"{self.output}/{node}/{chunk.name}"

    def _attempt_name(self, node: str, chunk: Chunk) -> str:
        """The working copy's name of node `node`'s running attempt at `chunk`, or of its next one."""
        assert self.assign is not None
        with self.assign._lock:
            c = self.assign.chunks.get(chunk.index)
            mine = [a for a in (c.attempts if c is not None else []) if a.node == node]
            if mine and mine[-1].outcome is None and c is not None and c.state == "running" and c.node == node:
                return posixpath.basename(mine[-1].output)
            return attempt_name(chunk, len(mine) + 1)

    def part_url(self, node: str, out: str) -> str:
        """Where node `node`'s attempt whose working copy is `out` puts its committed output in the store."""
        return attempt_part(self.output, node, out)

    def store_args(self, node: str, index: int, out: str) -> dict[str, Any]:
        """start_job's store arguments: where this attempt publishes, and the earlier attempts (other
        nodes, or this node into another directory) whose shards a fresh run starts from."""
        if self.store is None:
            return {}
        assert self.assign is not None
        chunk = self.chunk(index)
        mine = self.part_url(node, out)
        earlier = [self.part_url(a.node, a.output) for a in self.assign.chunks[index].attempts if a.output != out]
        assert self.plan is not None
        rows = [chunk.first_line - 1, chunk.first_line - 1 + chunk.lines] \
            if not chunk.file and self.plan.fmt == "parquet" else None   # rows of a Parquet input, read in place
        pin = self.plan.input_id if not chunk.file else None   # read in place: the version the plan was cut from
        return {"store": mine, "seed": sorted(set(earlier) - {mine}), "input_span": chunk.span, "input_rows": rows,
                "input_pin": pin}

    def gathered(self, node: str, chunk: Chunk) -> Path:
        return self.plan_dir / "gathered" / node / chunk.name

    def fail_job(self, exc: FleetError) -> None:
        """End the job now with `exc` (the first such failure is kept): every node stops claiming."""
        if self.failure is None:
            self.failure = exc
            self.say(logging.ERROR, f"the job stops: {exc.one_line()}")
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self.assign is not None:
            self.assign.wake_all()

    def _wait(self, event: threading.Event, timeout: float) -> bool:
        """Wait up to `timeout` s for `event` (the scale bench runs this clock faster)."""
        return event.wait(timeout)

    # -- when an idle node asks again

    def _refused(self, name: str, sooner: bool) -> _Asking:
        """Node `name` was told to wait: it asks again at the first change of itself or of the faster node
        it left the chunk to (`sooner`: told so by `next_size`), a chunk handed back, the job's end — or
        when its back-off ends (what no change here announces: the chunks getting smaller as others
        claim them, a faster node's live rate moving). Called under the state's lock, with the answer:
        a change between the two would wake nobody (or, watched from before the question, everybody)."""
        assert self.assign is not None
        prev = self._asking.get(name)
        wait = min(self.idle_max_s, 2 * prev.wait_s) if prev is not None and prev.wait_s else self.poll_s
        node = self._sooner.get(name) if sooner else None
        a = self._asking[name] = _Asking(threading.Event(), wait, time.monotonic() + wait)
        self.assign.watch(name, a.event, frozenset((node,)) if node else frozenset())
        return a

    def _answered(self, name: str) -> None:
        """Node `name` got work (or a decision): its next question is asked when it needs one."""
        assert self.assign is not None
        self._asking.pop(name, None)
        self.assign.unwatch(name)

    def _idle(self, a: _Asking) -> None:
        """Wait, with nothing to run, until the node told to wait should ask again (`_refused`) or the job
        stops (`stop` sets _stop, then every watched event)."""
        if not self._stop.is_set():
            self._wait(a.event, max(0.0, a.until - time.monotonic()))

    def _may_ask(self, name: str) -> bool:
        """Whether node `name`, told to wait while its chunk drains, should ask again at this poll."""
        a = self._asking.get(name)
        return a is None or a.event.is_set() or time.monotonic() >= a.until

    # -- one node

    def node_loop(self, name: str, run_chunk: Callable[[str, int], dict[str, Any]] | None = None) -> dict[str, Any]:
        """Pull chunks for node `name` until every chunk is done; rejoin after a loss. Returns the node's share."""
        assert self.assign is not None
        run = run_chunk or self.run_chunk
        work = self.nodes[name]
        lost_since: float | None = None
        while not self._stop.is_set() and not self.assign.all_done():
            if self.quarantine.holds(name) and not self._quarantined(name):
                continue
            if lost_since is not None:
                if self._stop.wait(self.probe_s):
                    break
                if not self._probe(name):
                    if time.monotonic() - lost_since > self.rejoin_s:
                        work.state = "gone"
                        break
                    continue
                self.say(logging.WARNING, f"node {name} answers again: it rejoins the job")
                self._stop_abandoned(name)
                lost_since = None
            try:
                lost_since = self._turn(name, run, work, lost_since)
            except (InputChanged, StoreError) as exc:   # the job's own (its input, the controller's store): it ends
                self.fail_job(exc)
                break
        self.drop_connection(name)
        if work.state not in ("gone", "quarantined"):
            work.state = "finished"
        return {"node": name, "rows": work.rows_done, "tokens": work.tokens, "busy_s": round(work.busy_s, 2),
                "state": work.state}

    def _turn(self, name: str, run: Callable[[str, int], dict[str, Any]], work: NodeWork,
              lost_since: float | None) -> float | None:
        """One turn of `node_loop`: claim a chunk (or wait), run it; the node's lost-since time after it."""
        assert self.assign is not None
        self.assign.node_ok(name)
        rows: int | None = None
        index: int | None = None
        waiting: _Asking | None = None
        with self.assign._lock:   # the answer and what to wait for at once (`_refused`)
            go = True
            if not self.assign.running_on(name):
                rows, go = self.next_size(name)
            if not go:   # a faster node would end the next chunk sooner: leave it to that node
                waiting = self._refused(name, sooner=True)
            else:
                index = self.assign.claim(name, lambda i: self.chunk_output(name, self.chunk(i)), rows=rows,
                                          min_rest=self.min_rest())
                if index is None:   # nothing pending: others hold the last chunks; a loss may hand one back
                    waiting = self._refused(name, sooner=False)
        if waiting is not None or index is None:   # (index is None only when told to wait)
            work.state = "idle"
            if waiting is not None:
                self._idle(waiting)
            return lost_since
        self._answered(name)
        try:
            run(name, index)
        except NodeLost as exc:
            self.assign.node_lost(name, str(exc))
            work.state, work.progress, work.chunk = "lost", None, None
            lost_since = time.monotonic()
            self.say(logging.WARNING, f"node {name} lost ({exc.one_line()}): chunk {index} goes back to the queue")
            # a chunk started there while the lost one drained goes back too: its runner must not go on
            # generating (and publishing) for nothing — stopped now when the node still answers, else at rejoin
            self._stop_abandoned(name)
        except ChunkFailed as exc:
            self.say(logging.WARNING, f"chunk {index} failed on {name}: {exc.one_line()}")
            if self.assign.attempts_failed(index) >= MAX_FAILED_ATTEMPTS:
                self.stop()
                raise FatalError(f"chunk {index} failed {MAX_FAILED_ATTEMPTS} times (last on {name}: "
                                 f"{exc.one_line()})",
                                 remedy="read the runner logs under the nodes' workdir/jobs, fix the cause, "
                                        "then run the same command again: finished chunks are kept") from exc
            self._set_aside(name, f"chunk {index} failed there: {exc.one_line()}")
        except (JobConflict, Stopped, ConfigError, InputChanged, StoreError):
            raise   # the job's, not the node's: another controller runs it, a stop, a setting, its input, its store
        except FleetError as exc:   # the node's own: its runner could not be started there
            if self.assign.chunks[index].state == "running" and self.assign.chunks[index].node == name:
                self.assign.finish(index, name, "failed", exc.one_line())
            work.progress, work.chunk = None, None
            if self.assign.attempts_failed(index) >= MAX_FAILED_ATTEMPTS:
                self.stop()
                raise FatalError(f"chunk {index} could not start {MAX_FAILED_ATTEMPTS} times (last on {name}: "
                                 f"{exc.one_line()})") from exc
            self._set_aside(name, f"chunk {index} could not start there: {exc.one_line()}")
        return lost_since

    def _stop_abandoned(self, name: str) -> None:
        """Node `name` was just lost, or answers again: the runners of its attempts that are over (a chunk
        started there while the lost one drained; a chunk that went elsewhere) are stopped now, before it
        takes a chunk (fence.py). A node that does not answer: tried again at rejoin and at the job's end."""
        assert self.assign is not None
        stopped = stop_abandoned_on(self.cfg, self.assign, name, connect)
        if stopped:
            self.say(logging.WARNING, f"node {name}: stopped the runner(s) of chunk(s) {', '.join(map(str, stopped))}, "
                                      "which went to other nodes while it was lost")

    def _node_check(self, name: str) -> str | None:
        """Why node `name` cannot take chunks now (None: it can): with a store, the node check of its
        runner's store access (nodecheck.py); else whether it answers."""
        assert self.plan is not None
        if self.store is not None:
            from fleet.generation.multinode.nodecheck import check_node

            return check_node(self.cfg, self.node_cfg(name), self.plan.input, self.output,
                              timeout_s=max(self.node_lost_s, 60.0))
        return None if self._probe(name) else "it does not answer"

    def _set_aside(self, name: str, cause: str) -> None:
        set_aside(self, name, cause)

    def _quarantined(self, name: str) -> bool:
        return wait_and_check(self, name)

    def node_rate(self, name: str) -> float | None:
        """The node's measured rate (input lines/s): the lines of the chunks it finished over the time it
        had one of them running (state.json, so a new controller knows it too), else its running chunk's
        runner's own rate; None before either. Busy time is the union of the attempts' spans: a chunk
        started early overlaps the one draining, and summing spans counted that overlap twice (a fast
        node of 250-row chunks measured at half its rate, and the slow node then took the last chunk)."""
        assert self.assign is not None
        rows, secs = self.assign.finished_on(name)
        if rows and secs > 0:
            return rows / secs
        w = self.nodes.get(name)
        live = float((w.progress or {}).get("rows_per_s") or 0.0) if w is not None and w.chunk is not None else 0.0
        return live or None

    def _free_in(self, name: str, rate: float) -> float:
        """Seconds until node `name` has no chunk left to work, at `rate` (`_rows_left`)."""
        return self._rows_left(name) / rate

    def _rows_left(self, name: str) -> int:
        """Rows node `name` has still to work: what is left of the chunk it watches (its progress) plus
        every other chunk running on it (one started early while the first drains, or one a new
        controller has not re-attached to yet) whole. Counting only the watched chunk made a node that
        had just started its next chunk look free at once, and the slow node then left every chunk to
        it and idled (the bench's slow node, a runner start per chunk)."""
        assert self.assign is not None
        w = self.nodes[name]
        left = 0
        for i in self.assign.running_on(name):
            rows = self.chunk(i).lines
            if i == w.chunk and w.progress:
                rows = int(w.progress.get("rows_total") or rows) - int(w.progress.get("rows_done") or 0)
            left += max(0, rows)
        return left

    def _rates_now(self) -> RateView:
        """Every node's rate and rows left as of now, evaluated again only for the nodes a change of the
        state touched or whose progress moved since the last question (`RateView`)."""
        assert self.assign is not None
        with self.assign._lock:
            v = self._view
            v.dirty.update(self.assign.take_touched())
            while v.dirty:
                name = v.dirty.pop()
                if name in self.nodes:
                    lost = self.assign.nodes.get(name, {}).get("state") == "lost"
                    v.update(name, self.node_rate(name), self._rows_left(name), lost)
            return v

    def min_rest(self) -> int:
        """The shortest rest a cut may leave: MIN_CHUNK_S of work at the slowest measured rate. A shorter
        rest is a chunk that is mostly its runner's start (the bench's 102-row rests); at the fastest
        rate the bar also refused useful cuts (a 234-row rest), and the slow node then ran 1,000 rows."""
        assert self.assign is not None
        with self.assign._lock:   # the view's heap is popped here: one thread at a time
            slowest = self._rates_now().slowest()
        return math.ceil(MIN_CHUNK_S * slowest) if slowest else 0

    def next_size(self, name: str) -> tuple[int | None, bool]:
        """(rows of node `name`'s next chunk, whether it should take one now): `chunk_rows_for` from the
        measured rates, `finishes_first`'s rule against the faster nodes (`RateView.sooner`). The rates, rows left
        and their sum come from `RateView`: no node is evaluated that did not change since. Under the
        state's lock: another node's thread updates the view (and `Assignments.nodes`) meanwhile, and a
        dict iterated while it changes raises (the 1,000-node bench's "dictionary changed size")."""
        assert self.assign is not None
        with self.assign._lock:
            v = self._rates_now()
            rate = v.rate.get(name) if name not in v.lost else None
            first = self.assign.first_pending()
            if first is None:
                return None, True
            rows = chunk_rows_for(rate, {}, self.assign.rows_pending(), total=float(v.total))
            nxt = self.chunk(first).lines
            take = min(nxt, rows) if rows and nxt - rows > max(1, rows // 4, self.min_rest()) else nxt
            if not rate:
                return rows, True
            sooner = self._sooner[name] = v.sooner(name, rate, take, v.left[name] / rate,
                                                    self.assign.rows_pending())
            return rows, sooner is None

    def _probe(self, name: str) -> bool:
        try:
            node = connect(self.node_cfg(name))
            try:
                node.run(["true"], timeout=self.node_lost_s)
            finally:
                node.close()
            return True
        except Exception:  # unreachable is the expected answer here, whatever form it takes
            return False

    # -- the whole job

    def progress(self) -> dict[str, Any]:
        """The job's progress over every node: total, each node's share, rate and ETA.

        Rows are input lines: a done chunk counts whole (from state.json, so a new controller
        counts what an old one finished), a running one by its runner's rows_done. Rates are
        this controller's: rows finished since it started, over the time since it started."""
        assert self.plan is not None and self.assign is not None
        total = self.plan.total_lines
        elapsed = max(1e-6, time.monotonic() - self.started)
        with self.assign._lock:
            done_by: dict[str, int] = {}
            chunks_by: dict[str, int] = {}   # one pass: a count per node was O(nodes × chunks) per write
            for i, c in self.assign.chunks.items():
                if c.state == "done" and c.node:
                    done_by[c.node] = done_by.get(c.node, 0) + self.plan.chunks[i].lines
                    chunks_by[c.node] = chunks_by.get(c.node, 0) + 1
        nodes = []
        done_all = 0
        rate_all = 0.0
        tok_s_all = 0.0
        running: list[dict[str, Any]] = []   # the progress files of the chunks running now
        for name in sorted(set(self.nodes) | set(done_by)):
            w = self.nodes.get(name)
            p = (w.progress or {}) if w is not None and w.chunk is not None else {}
            if p:
                running.append(p)
            rows = done_by.get(name, 0) + min(int(p.get("rows_done") or 0), self.plan.chunks[w.chunk].lines
                                                  if w is not None and w.chunk is not None else 0)
            run = p.get("this_run") or {}
            session = (w.session_rows if w is not None else 0) + int(run.get("completed") or 0) + \
                int(run.get("errors") or 0)
            rate = session / elapsed
            tok_s = float(p.get("tok_s") or 0.0)
            done_all += rows
            rate_all += rate
            tok_s_all += tok_s
            nodes.append({"node": name, "state": w.state if w is not None else "not up", "chunk": w and w.chunk,
                          "rows_done": rows, "share": round(rows / total, 4) if total else None,
                          "rows_per_s": round(rate, 2), "tok_s": round(tok_s, 1), "servers_up": p.get("servers_up"),
                          "gpus": w.gpus if w is not None else None,
                          "chunks_done": chunks_by.get(name, 0)})
        remaining = max(0, total - done_all)
        eta, basis = job_eta(remaining, running, tok_s=tok_s_all, rows_per_s=rate_all,
                             max_tokens=self.cfg.generation.max_tokens)
        oldest = [p["oldest_in_flight_s"] for p in running if p.get("oldest_in_flight_s") is not None]
        counts = self.assign.counts()
        states = [n["state"] for n in nodes if n["node"] in self.nodes]
        return {"state": "done" if self.assign.all_done() else "running", "rows_total": total,
                "nodes_up": sum(1 for s in states if s in ("idle", "running", "finished")),
                "nodes_lost": sum(1 for s in states if s in ("lost", "gone")),
                "nodes_quarantined": sum(1 for s in states if s == "quarantined"),
                "nodes_set_aside": dict(sorted(self.set_aside.items())),
                "rows_done": min(done_all, total), "percent": round(100 * min(done_all, total) / total, 2) if total else None,
                "rows_per_s": round(rate_all, 2), "tok_s": round(tok_s_all, 1),
                "eta_s": round(eta) if eta is not None else None, "eta_basis": basis,
                "rows_in_flight": sum(int(p.get("rows_in_flight") or 0) for p in running),
                "oldest_in_flight_s": max(oldest) if oldest else None,
                "elapsed_s": round(elapsed, 1), "chunks": counts,
                "chunks_total": len(self.plan.chunks), "nodes": nodes, "updated_at": time.time()}

    def write_progress(self) -> dict[str, Any]:
        """The job's progress.json in the plan directory and, for a store job, at `<output>/_control/`:
        where anyone with the store's credentials sees the whole job, whichever machine runs the controller."""
        p = self.progress()
        write_json_atomic(self.plan_dir / PROGRESS_FILE, p)
        if self.store is not None:
            try:
                self.store.write_bytes(f"{CONTROL_DIR}/{PROGRESS_FILE}", json.dumps(p).encode())
            except Exception as exc:   # progress must never stop the job; the local copy is written
                log.warning("could not put the job's progress in the store: %s", exc)
        return p

    def finalize(self, dest: str | Path) -> dict[str, Any]:
        """Merge every chunk's gathered output into `dest` and write the job's manifest there."""
        assert self.plan is not None and self.assign is not None
        self.assign.compact()   # the whole state in state.json (and the store's copy) at the job's end
        return merge_job(self.cfg, self.plan_dir, self.plan, self.assign, dest,
                         store=self.output if self.store is not None else None, holds=self.holds())

    def holds(self) -> list[Any]:
        """Each node's hold (cost.py) as of now, the first `since` of an earlier controller kept; written
        to the plan directory's held.json (what `fleet fetch` and a next controller read)."""
        from fleet.generation.multinode.cost import record_holds

        assert self.assign is not None
        now, mono = time.time(), time.monotonic()
        with self.assign._lock:
            lost = {n: float(r.get("since") or now) for n, r in self.assign.nodes.items()
                    if r.get("state") == "lost" and n in self.nodes}
        quarantined = {n: now - (mono - h.since) for n, h in self.quarantine.held.items()}
        gpus = {**self.node_gpus, **{n: w.gpus for n, w in self.nodes.items()}}
        return record_holds(self.plan_dir, gpus, self.held_since or self.assign.started_at, now,
                            set_aside=self.aside_at, quarantined=quarantined, lost=lost)
