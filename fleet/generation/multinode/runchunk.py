"""One chunk attempt of a multi-node job on one node (Prefect-free): `ChunkRuns`, `Controller`'s base.

`run_chunk` puts the chunk's input on the node, starts the ordinary detached runner (or re-attaches to
the one running there), watches its progress.json (`RunnerLiveness`: lost when it stops moving),
gathers committed shards as it goes, and collects the chunk when the runner ends: done, failed or
lost (controller.py's docstring). Also the early start of a draining node's next chunk (`_prestart`).
"""

from __future__ import annotations

import json
import logging
import posixpath
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleet.config import FleetConfig, NodeConfig
from fleet.errors import FleetError, InputChanged
from fleet.generation.data.manifest import MANIFEST_FILE
from fleet.generation.data.objstore import Store
from fleet.generation.job.progress import PROGRESS_FILE
from fleet.generation.multinode.chunks import Assignments, Chunk, Plan
from fleet.generation.multinode.nodecheck import last_words
from fleet.generation.multinode.nodework import (NodeLost, ChunkFailed, NodeWork, RunnerLiveness, _Asking, _draining,
                                                 _unreachable, _retry, look_every)
from fleet.node import LocalNode, Node, connect

if TYPE_CHECKING:
    from fleet.generation.job.remote import JobHandle

log = logging.getLogger("fleet.generation.multinode.controller")

LOGS_DIR = "_logs"   # under a store job's --output: the runner logs of failed attempts (`_keep_log`)
LOG_KEPT_BYTES = 256 * 1024


class ChunkRuns:
    """The per-chunk part of `Controller` (its base class): run one chunk attempt on one node, watch its
    runner, gather and collect what it wrote. The attributes and methods named under TYPE_CHECKING are
    the controller's own (controller.py)."""

    if TYPE_CHECKING:
        cfg: FleetConfig
        chunk_cfg: FleetConfig
        plan_dir: Path
        output: str
        nodes: dict[str, NodeWork]
        node_lost_s: float
        runner_start_s: float
        poll_s: float
        fetch_every_s: float
        say: Callable[[int, str], None]
        store: Store | None
        plan: Plan | None
        assign: Assignments | None
        _stop: threading.Event
        _connections: dict[str, Node]
        _conn_lock: threading.Lock

        def node_cfg(self, name: str) -> NodeConfig: ...
        def chunk(self, index: int) -> Chunk: ...
        def chunk_output(self, node: str, chunk: Chunk) -> str: ...
        def part_url(self, node: str, out: str) -> str: ...
        def store_args(self, node: str, index: int, out: str) -> dict[str, Any]: ...
        def gathered(self, node: str, chunk: Chunk) -> Path: ...
        def _refused(self, name: str, sooner: bool) -> _Asking: ...
        def _answered(self, name: str) -> None: ...
        def _may_ask(self, name: str) -> bool: ...
        def min_rest(self) -> int: ...
        def next_size(self, name: str) -> tuple[int | None, bool]: ...

    def _mark_output(self, node: Node) -> None:
        """`<output>/multinode.json` on the node: the output holds a multi-node job's chunks (its
        top level is one directory per node, which `fleet generate`'s output check accepts by this)."""
        if self.store is not None:   # the node's copies live under its workdir, not under --output
            return
        path = f"{self.output}/multinode.json"
        if not node.exists(path):
            node.write_text(path, json.dumps({"fleet": self.cfg.name, "plan_dir": str(self.plan_dir)}))

    def _put_input(self, node: Node, node_cfg: NodeConfig, chunk: Chunk) -> str:
        if not chunk.file:   # a byte (JSONL) or row (Parquet) range of the input, read in place (store_args names it)
            assert self.plan is not None
            return self.plan.input
        local = self.plan_dir / chunk.file
        if self.store is not None:   # the runner reads it from the store itself
            name = f"_inputs/{posixpath.basename(chunk.file)}"
            if not self.store.exists(name):
                self.store.put_file(str(local), name)
            return self.store.url(name)
        if isinstance(node, LocalNode):
            return str(local)
        remote = f"{node_cfg.workdir.rstrip('/')}/inputs/{self.plan_dir.name}/{posixpath.basename(chunk.file)}"
        if not node.exists(remote):
            node.put(local, remote)
        return remote

    def _seed(self, node: Node, index: int, out: str) -> int:
        """Shards gathered from earlier attempts of this chunk, put into a fresh output dir on `node`:
        the runner's resume skips their ids (rows committed and fetched are not generated again)."""
        from fleet.generation.data.results import shard_paths

        assert self.assign is not None
        if self.store is not None:   # the runner seeds itself from the store (store_args)
            return 0
        res = node.run(["sh", "-c", 'ls "$1"/shards 2>/dev/null | grep -c "^part-" || true', "x", out], check=False)
        if res.stdout.strip() not in ("", "0"):
            return 0   # this node already has shards of its own for the chunk: its runner resumes from them
        chunk = self.chunk(index)
        n = 0
        for a in self.assign.chunks[index].attempts:
            if not a.fetched or a.output == out:
                continue
            for shard in shard_paths(self.gathered(a.node, chunk)):
                n += 1
                node.put(shard, f"{out}/shards/part-{n:06d}.parquet")
        return n

    @staticmethod
    def _fetch_shards(node: Node, out: str, dest: Path) -> int:
        """Copy the committed shards not yet here (shards are renamed into place whole)."""
        res = node.run(["sh", "-c", 'ls "$1"/shards 2>/dev/null || true', "x", out], check=False)
        new = 0
        for name in res.stdout.split():
            if not (name.startswith("part-") and name.endswith(".parquet")):
                continue
            target = dest / "shards" / name
            if target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(name + ".tmp")
            node.get(f"{out}/shards/{name}", tmp)
            tmp.replace(target)
            new += 1
        return new

    def run_chunk(self, name: str, index: int) -> dict[str, Any]:
        """Run (or re-attach to) chunk `index` on node `name` until it is done; NodeLost / ChunkFailed else."""
        chunk = self.chunk(index)
        node_cfg = self.node_cfg(name)
        work = self.nodes[name]
        out = self.chunk_output(name, chunk)
        dest = self.gathered(name, chunk)
        t0 = time.monotonic()
        node = self._connection(name, node_cfg)
        ended = False
        try:
            handle = self._start_chunk(node, name, index, out)
            work.state, work.chunk = "running", index
            self.say(logging.INFO, f"chunk {index} ({chunk.lines} lines) "
                                   f"{'re-attached' if handle.attached else 'started'} on {name}, runner pid {handle.pid}")
            if not self._watch_runner(node, name, index, handle.pid, out, dest):
                return {"chunk": index, "node": name, "state": "detached"}
            res = self._collect(node, name, index, handle, out, dest, t0)
            ended = True
            return res
        except NodeLost:
            work.busy_s += time.monotonic() - t0
            raise
        except FleetError as exc:   # the seam's reachability errors anywhere in the run (the start, a
            # gather, the collect after the runner ended): the node is lost, probed and rejoins. Only the
            # start's were before, and an SSH outage after it quarantined the job's only node as its own
            # fault ("chunk 0 could not start there: SSH handshake …"). A bare OSError is the controller's
            # own (its disk, the store's refusal): a node lost for it would be lost again at each rejoin,
            # for ever; it ends the job with its cause instead.
            if _unreachable(exc):
                work.busy_s += time.monotonic() - t0
                raise NodeLost(f"chunk {index}: {exc.one_line()}") from exc
            raise
        finally:
            if not ended:   # lost, failed, or the controller stops: the next attempt connects afresh
                self.drop_connection(name)

    def _connection(self, name: str, node_cfg: NodeConfig) -> Node:
        """The node's connection, kept from one chunk attempt to the next: a new one per attempt cost the
        controller a handshake (≈ 0.2 s of wall, milliseconds of CPU) and the node's checks again (the
        workdir's, the runner venv's stamp and import, the runner's 1.3 MB zip put again: `runner_command`
        keeps what it proved on the connection). A connection that drops reconnects by itself (SSHNode);
        an attempt that ends in any other way than done drops it (`drop_connection`)."""
        with self._conn_lock:
            node = self._connections.get(name)
            if node is not None:
                return node
        try:
            node = connect(node_cfg)
        except Exception as exc:
            raise NodeLost(f"cannot connect: {exc}") from exc
        with self._conn_lock:
            self._connections[name] = node
        return node

    def drop_connection(self, name: str) -> None:
        """Close node `name`'s kept connection (its detached runners go on); the next attempt connects afresh."""
        with self._conn_lock:
            node = self._connections.pop(name, None)
        if node is not None:
            try:
                node.close()
            except Exception as exc:   # a connection that is going away anyway
                log.debug("closing the connection to %s: %s", name, exc)

    def _start_chunk(self, node: Node, name: str, index: int, out: str) -> JobHandle:
        """Put the chunk's input on the node and start its runner there (or find the one running)."""
        from fleet.generation.job.remote import start_job

        assert self.assign is not None
        node_cfg = self.node_cfg(name)
        work = self.nodes[name]
        self._mark_output(node)
        remote_input = self._put_input(node, node_cfg, self.chunk(index))
        self.assign.start(index, name, out)
        # a fresh attempt (no runner has written here yet) starts from what other nodes committed
        seeded = self._seed(node, index, out) if not node.exists(f"{out}/{PROGRESS_FILE}") else 0
        if seeded:
            self.say(logging.INFO, f"chunk {index} on {name} starts from {seeded} shard(s) gathered from "
                                   "earlier attempts")
        return start_job(node, self.chunk_cfg, node_cfg, input_path=remote_input, output=out,
                         specs=work.specs, facts=work.facts, exclusive=True,   # under ControllerLock
                         **self.store_args(name, index, out))

    def _watch_runner(self, node: Node, name: str, index: int, pid: int, out: str, dest: Path) -> bool:
        """Follow the chunk's runner until it exits (True) or the controller stops (False): its
        progress read every `poll_s`, shards gathered every `fetch_every_s`, the next chunk started
        while this one drains. NodeLost when the node, the runner or all its servers stop answering
        for `node_lost_s`, or the runner writes no first progress within `runner_start_s`."""
        from fleet.generation.job.remote import look_at_runner

        work = self.nodes[name]
        last_contact = last_fetch = time.monotonic()
        live = RunnerLiveness(pid, self.node_lost_s, max(self.runner_start_s, self.node_lost_s), since=last_contact)
        prestarted = False
        while True:
            now = time.monotonic()
            try:
                prog, alive = look_at_runner(node, out, pid)
                last_contact = now
            except Exception as exc:
                if now - last_contact > self.node_lost_s:
                    raise NodeLost(f"no answer for {now - last_contact:.0f} s ({exc})") from exc
                node.close()
                self._stop.wait(self.poll_s)
                continue
            live.saw(now, prog)
            if prog is not None:
                work.progress = prog
            if not alive:
                return True
            why = live.lost(now)
            if why:
                self._stop_runner(node, pid)
                self._gather_partial(node, index, out, dest)
                raise NodeLost(why)
            if prog is not None and not prestarted and _draining(prog) and self._may_ask(name):
                # told to wait: asked again at the first change it waits on or its back-off's end, not every poll
                prestarted = self._prestart(node, name)
                if prestarted:
                    self._answered(name)
            if now - last_fetch > self.fetch_every_s:
                last_fetch = now
                self._gather_partial(node, index, out, dest)
            wait = look_every(self.poll_s, prog, next_started=prestarted)
            if self._stop.wait(min(wait, self.fetch_every_s)):
                return False

    def _collect(self, node: Node, name: str, index: int, handle: JobHandle, out: str, dest: Path,
                 t0: float) -> dict[str, Any]:
        """The runner exited: fetch a done chunk's whole output and count it to the node, or gather
        what it committed and raise ChunkFailed with the runner's last words."""
        from fleet.generation.data.manifest import read_manifest
        from fleet.generation.job.remote import fetch, read_exit, read_progress

        assert self.assign is not None
        work = self.nodes[name]
        manifest_text = _retry(lambda: node.read_text(f"{out}/{MANIFEST_FILE}"))
        manifest = json.loads(manifest_text) if manifest_text else {}
        final = _retry(lambda: read_progress(node, out)) or {}
        if self.store is not None:   # done means done in the store: its manifest is put there last
            from fleet.generation.data.storeerrors import translated

            part = Store(self.part_url(name, out))
            with translated(part.root, "reading"):
                stored = _retry(lambda: part.read_bytes(MANIFEST_FILE))
            manifest = json.loads(stored) if stored else {}
        if manifest.get("complete") and manifest.get("state") == "done" and \
                final.get("state") == "done":
            m = manifest
            if self.store is None:
                if dest.exists():
                    shutil.rmtree(dest)
                _retry(lambda: fetch(node, out, dest))
                m = read_manifest(dest) or manifest
            self.assign.finish(index, name, "done", fetched=True)
            accounted = int(m.get("accounted") or 0)
            work.rows_done += accounted
            run = m.get("this_run") or {}
            work.session_rows += int(run.get("completed") or 0) + int(run.get("errors") or 0)
            work.tokens += int((m.get("throughput") or {}).get("completion_tokens") or 0)
            work.busy_s += time.monotonic() - t0
            work.progress, work.chunk = None, None
            return {"chunk": index, "node": name, "state": "done", "rows": accounted,
                    "seconds": round(time.monotonic() - t0, 2)}
        self._gather_partial(node, index, out, dest)
        failure = (_retry(lambda: read_exit(node, handle)) or {}).get("failure") or final.get("error") or {}
        detail = final.get("detail") or final.get("state") or failure.get("cause") or "exited without a manifest"
        self.assign.finish(index, name, "failed", detail)
        work.progress, work.chunk = None, None
        if failure.get("kind") == "input_changed":   # the same on any node, at any attempt: the job ends
            err = InputChanged(str(failure.get("cause")), remedy=failure.get("remedy"))
            err.logged = True   # node_loop says it once (fail_job): no task traceback for it
            raise err
        # a store the runner could not use (kind "store") may be this node's own (its credentials): a failed
        # chunk, so the node is set aside and the chunk goes to the others; when every node fails so, the
        # job ends with each one's cause (quarantine.py)
        tail = node.read_text(handle.log, tail_bytes=LOG_KEPT_BYTES) if handle.log else ""
        kept = self._keep_log(name, index, tail)
        cause = (f"{failure['cause']} — {failure.get('remedy')}" if failure.get("cause") else
                 f"its log ends: {last_words(tail[-4000:])}")
        raise ChunkFailed(f"runner of chunk {index} ended: {detail}; {cause}" + (f" (the log: {kept})" if kept else ""))

    def _keep_log(self, name: str, index: int, tail: str) -> str | None:
        """A failed attempt's runner log (its last LOG_KEPT_BYTES) put under `<output>/_logs/` of a store job:
        the nodes' job directories are removed once the job is merged, and a quarantined node's logs with them."""
        if self.store is None or not tail:
            return None
        assert self.assign is not None
        rel = f"{LOGS_DIR}/{name}/{self.chunk(index).name}-{len(self.assign.chunks[index].attempts)}.log"
        try:
            self.store.write_bytes(rel, tail.encode())
            return self.store.url(rel)
        except Exception as exc:   # the cause of the failure is what matters: the log stays on the node
            log.warning("could not keep the log of chunk %d on %s in the store: %s", index, name, exc)
            return None

    def _prestart(self, node: Node, name: str) -> bool:
        """Start the node's next chunk while the current one drains (its input all sent, the last rows in
        flight): the servers stay busy across the runner's exit and the next one's start. The next
        `run_chunk` of this node re-attaches to it like a new controller would.

        False while a faster node would end the next chunk sooner: the caller asks again at its next
        poll (that node may take it meanwhile, or this one's drain makes it the sooner one). Asked only
        once, a slow node's next chunk waited for its runner's exit and a whole runner start (the
        bench's slow node, chunks 8 and 10). True once decided: started, nothing left, or a failed
        start (the chunk stays claimed; the node's next `run_chunk` starts it the usual way)."""
        from fleet.generation.job.remote import start_job

        assert self.assign is not None
        with self.assign._lock:   # the answer and what to wait for at once (`_refused`)
            rows, go = self.next_size(name)
            if not go:
                self._refused(name, sooner=True)
                return False
            nxt = self.assign.claim(name, lambda i: self.chunk_output(name, self.chunk(i)), another=True, rows=rows,
                                    min_rest=self.min_rest())
        if nxt is None:
            return True
        chunk = self.chunk(nxt)
        out = self.chunk_output(name, chunk)
        try:
            remote_input = self._put_input(node, self.node_cfg(name), chunk)
            if not node.exists(f"{out}/{PROGRESS_FILE}"):
                self._seed(node, nxt, out)
            h = start_job(node, self.chunk_cfg, self.node_cfg(name), input_path=remote_input, output=out,
                          specs=self.nodes[name].specs, facts=self.nodes[name].facts, exclusive=True,
                          **self.store_args(name, nxt, out))
            self.say(logging.INFO, f"chunk {nxt} started on {name} while the previous one drains, runner pid {h.pid}")
        except Exception as exc:  # it stays claimed: the node's next run_chunk starts it the usual way
            log.warning("could not start chunk %d early on %s: %s", nxt, name, exc)
        return True

    def _gather_partial(self, node: Node, index: int, out: str, dest: Path) -> None:
        assert self.assign is not None
        if self.store is not None:   # the runner put its commits in the store itself
            return
        try:
            self._fetch_shards(node, out, dest)
            self.assign.mark_fetched(index, out)
        except Exception as exc:  # a node that is going away: what was gathered before stays
            log.warning("could not gather the shards of chunk %d from %s: %s", index, out, exc)

    def _stop_runner(self, node: Node, pid: int) -> None:
        try:
            node.stop(pid, grace_s=5.0)
        except Exception as exc:
            log.warning("could not stop runner %d: %s", pid, exc)
