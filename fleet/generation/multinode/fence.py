"""Only a chunk's counted attempt adds to a multi-node job's output: a late node adds nothing, and is stopped.

Why: a node frozen mid-chunk was lost and its chunk re-run elsewhere; continued after the job had
been merged, it finished its old chunk and put 500 rows of parts into the store, orphan objects
nothing cleaned, and its runner (GPU time paid for) and servers kept running with nothing telling
the operator (issue 35). The fence, by the job's state:

- every attempt writes under its own prefix: `_parts/<node>/<name of its working copy>`, the
  working copy being `chunk-NNNNN` for a node's first attempt at a chunk and `chunk-NNNNN.K` for
  its K-th (`attempt_name`, `attempt_part`): two attempts of one chunk on one node never share one;
- `counted_attempts`: per done chunk, the one attempt whose part is the chunk's output (the first
  to finish). Its part holds every row of the chunk on its own (a runner seeded from earlier
  attempts publishes the seeded shards too: fleet.generation.job.publish), so the merge — or a
  listing of parts — reads no other prefix, and what a late attempt puts anywhere is never read;
- `stop_abandoned`: the runners of a node's attempts that are over by the state (lost, failed, or
  not counted) stopped: when the node answers again (rejoin), and at the job's end on every node;
- `remove_leftovers`: at the end of a complete job, every part that is not a counted one removed
  from the store — after `<output>/_control/ended.json` (`ENDED_FILE`) names the counted parts: a
  runner that could not be stopped (its node did not answer at the end) reads it after it puts
  something in the store and, its part not named there, removes its own prefix and stops
  (fleet.generation.job.publish `Publisher`). A part put before the removal's listing is removed by
  it, one put after is removed by its runner: no late node leaves objects behind, and none waits
  for the next run of the command to be cleaned;
- what could not be stopped (a node that does not answer) is named in the job's report, with the
  nodes whose servers still run (`Fence.lines`).
"""

from __future__ import annotations

import logging
import posixpath
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fleet.generation.job.publish import ENDED_FILE, PARTS_DIR   # the parts' place, the end marker (layer below)
from fleet.jobs import LIVE_PID_SH

if TYPE_CHECKING:
    from fleet.config import FleetConfig
    from fleet.generation.multinode.chunks import Assignments, Attempt, Chunk
    from fleet.node import Node

__all__ = ["Fence", "attempt_name", "attempt_part", "counted_attempts", "abandoned_on", "stop_abandoned", "stop_abandoned_on",
           "remove_leftovers", "PARTS_DIR", "ENDED_FILE"]

log = logging.getLogger("fleet.generation.multinode.fence")


# For each job directory: "=== DIR PID" when its runner is alive.
_LIVE = LIVE_PID_SH + r'''
for j in "$@"; do p=$(live_pid "$j/runner.pid") && echo "=== $j $p"; done
exit 0
'''


def attempt_name(chunk: Chunk, nth: int) -> str:
    """The working copy's (and the part's) name of a node's `nth` attempt (1-based) at `chunk`."""
    return chunk.name if nth <= 1 else f"{chunk.name}.{nth}"


def attempt_part(output: str, node: str, working_copy: str) -> str:
    """Where the attempt of `node` whose working copy is `working_copy` puts its commits, under the
    job's --output URL `output`: its own prefix, named by its working copy."""
    return f"{output.rstrip('/')}/{PARTS_DIR}/{node}/{posixpath.basename(working_copy.rstrip('/'))}"


def counted_attempts(assign: Assignments) -> dict[int, Attempt]:
    """{chunk index: the attempt whose output is the chunk's} for every done chunk: the first attempt that
    finished it. The only attempt a merge or a listing of the job's parts reads for that chunk."""
    out: dict[int, Attempt] = {}
    for chunk, attempts in assign.sources():   # the one that finished first comes first
        if attempts and attempts[0].outcome == "done":
            out[chunk.index] = attempts[0]
    return out


def abandoned_on(assign: Assignments, node: str) -> list[tuple[int, Attempt]]:
    """(chunk, attempt) of every attempt of `node` that is over by the state and does not count: lost,
    failed, or done after another attempt had finished the chunk. Its runner must not run."""
    counted = counted_attempts(assign)
    found = []
    with assign._lock:
        for i, c in sorted(assign.chunks.items()):
            for a in c.attempts:
                if a.node == node and a.outcome is not None and counted.get(i) is not a:
                    found.append((i, a))
    return found


def stop_abandoned(cfg: FleetConfig, node: Node, node_name: str, attempts: list[tuple[int, Attempt]]) -> list[int]:
    """Stop the live runners of `attempts` (node `node_name`'s, `abandoned_on`) on `node`: one round trip
    to look, one per live runner to stop its process group. The chunks whose runner was stopped."""
    from fleet.jobs import job_dir

    if not attempts:
        return []
    node_cfg = cfg.node(node_name)
    dirs = {job_dir(node_cfg, cfg, a.output): i for i, a in attempts}
    text = node.run(["sh", "-c", _LIVE, "fleet-fence", *dirs], timeout=60).stdout
    stopped = []
    for line in text.splitlines():
        if not line.startswith("=== "):
            continue
        d, _, pid = line[4:].rpartition(" ")
        if d in dirs and pid.isdigit():
            node.stop(int(pid), grace_s=5.0)
            stopped.append(dirs[d])
    return sorted(stopped)


def stop_abandoned_on(cfg: FleetConfig, assign: Assignments, name: str, connect: Any) -> list[int]:
    """Node `name`'s abandoned runners stopped (`stop_abandoned`) over a connection of its own: the chunks
    whose runner was stopped; none when the node does not answer (tried again at the job's end, and named
    there if it still does not)."""
    try:
        node = connect(cfg.node(name))
        try:
            return stop_abandoned(cfg, node, name, abandoned_on(assign, name))
        finally:
            node.close()
    except Exception as exc:
        log.warning("could not stop the abandoned runners on %s: %s", name, exc)
        return []


def remove_leftovers(output: str, assign: Assignments) -> int:
    """Every part under `<output>/_parts/` that is not a done chunk's counted attempt, removed (a complete
    job's: each chunk's rows are in its counted part). The objects removed."""
    from fleet.generation.data.objstore import Store

    import json
    import time

    counted = counted_attempts(assign)
    if len(counted) != len(assign.chunks):
        return 0   # a chunk not done: an abandoned attempt's shards still seed its next attempt
    keep = {attempt_part(output, a.node, a.output) for a in counted.values()}
    root = output.rstrip("/") + "/"
    Store(output).write_bytes(ENDED_FILE, json.dumps({"counted": sorted(u[len(root):] for u in keep),
                                                      "at": time.time()}).encode())
    parts = Store(output).child(PARTS_DIR)
    n = 0
    for node in parts.names():
        for name in parts.child(node).names():
            url = f"{output.rstrip('/')}/{PARTS_DIR}/{node}/{name}"
            if url in keep:
                continue
            n += Store(url).remove_tree()
    return n


@dataclass
class Fence:
    """What the job's end did about late nodes, for its report."""

    stopped: dict[str, list[int]] = field(default_factory=dict)        # node -> chunks whose runner was stopped
    unreachable: dict[str, list[int]] = field(default_factory=dict)    # node -> chunks whose runner may still run
    servers_up: list[str] = field(default_factory=list)               # nodes whose servers are kept up
    servers_maybe: list[str] = field(default_factory=list)            # nodes lost: their servers may still run
    removed_objects: int = 0

    def lines(self) -> list[str]:
        """One line per node that still costs: a runner that may still run, servers that still run."""
        out = self.warnings()
        if self.servers_up:
            out.append(f"servers still run on {', '.join(sorted(self.servers_up))} (`fleet down` stops them)")
        return out

    def warnings(self) -> list[str]:
        """The lines of nodes that did not answer: what may still run there, out of the operator's sight."""
        out = []
        for node in sorted(set(self.unreachable) | set(self.servers_maybe)):
            chunks = self.unreachable.get(node, [])
            runner = (f"runner of chunk{'s' if len(chunks) > 1 else ''} {', '.join(map(str, chunks))} may still run; "
                      if chunks else "")
            out.append(f"{node}: {runner}its servers may still run (it does not answer; `fleet down` once it does)")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"stopped": self.stopped, "unreachable": self.unreachable, "servers_up": sorted(self.servers_up),
                "servers_may_run": sorted(self.servers_maybe), "removed_objects": self.removed_objects,
                "lines": self.lines()}


def fence_job(cfg: FleetConfig, assign: Assignments, states: dict[str, str], output: str | None,
              connect: Any = None) -> Fence:
    """At the job's end: every node's abandoned runners stopped (a node that does not answer is named, with
    its chunks), the leftovers of a complete store job (`output`) removed, the nodes whose servers still
    run named. `states`: each node of the job as the controller last saw it (lost / gone: did not answer)."""
    if connect is None:
        from fleet.node import connect
    fence = Fence()
    names = sorted(set(states) | {a.node for c in assign.chunks.values() for a in c.attempts})
    for name in names:
        attempts = abandoned_on(assign, name)
        lost = states.get(name) in ("lost", "gone")
        up = name in states and states[name] != "set aside"   # its servers came up for this job
        if not attempts and not lost:
            if up:
                fence.servers_up.append(name)
            continue
        try:   # a lost node too: when it answers now, its servers (frozen, or slow) do run
            node = connect(cfg.node(name))
            try:
                stopped = stop_abandoned(cfg, node, name, attempts)
            finally:
                node.close()
        except Exception as exc:   # it does not answer: what may still run there is said, not hidden
            log.warning("could not stop the abandoned runners on %s: %s", name, exc)
            if attempts:
                fence.unreachable[name] = sorted({i for i, _ in attempts})
            if up or lost:
                fence.servers_maybe.append(name)
            continue
        if stopped:
            fence.stopped[name] = stopped
        if up or lost:
            fence.servers_up.append(name)
    if output is not None:
        try:
            fence.removed_objects = remove_leftovers(output, assign)
        except Exception as exc:   # leftovers cost storage, never rows: said, not a failure
            log.warning("could not remove the abandoned attempts' parts from %s: %s", output, exc)
    return fence
