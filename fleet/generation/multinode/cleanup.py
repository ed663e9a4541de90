"""A finished object-storage job's working copies removed from its nodes, once nothing in them is only there.

With `--output` on object storage each chunk attempt runs in a working copy on its node
(`<workdir>/objstore/<key>/<node>/chunk-NNNNN`: the runner's lock, shards, progress and record
files), beside the chunk's input read from the store (`.chunk-NNNNN.input/`) and the runner's job
directory (`<workdir>/jobs/<fleet>-<key>`: job.json, runner.log, its env file). Once the job is
merged in the store they are only disk used: a hundred nodes keep every chunk they ran.

`clean_nodes` removes them, but never a row that is not yet in the store. It does nothing unless
the job's merged manifest in the store says complete; then, per attempt, it removes the copy, its
input and its job directory only when:

- its runner is not alive (a lost node's runner that came back may still be writing);
- every committed shard in it is in the store: in that attempt's part (`_parts/<node>/<chunk>/`,
  where the runner put it) or one it was seeded with from an earlier attempt's part — or the
  attempt is abandoned (its chunk counts another attempt: fence.py), so nothing in it is needed;
- its record files (errors, rejects, quality rejects), if it holds any, are in the store: the
  part's manifest is there (the runner puts them before it).

Anything else is kept, with the reason, and reported; so is a node that does not answer.
One round trip per node to look, one to remove.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fleet.generation.data.manifest import MANIFEST_FILE
from fleet.generation.data.objstore import Store
from fleet.generation.data.results import SHARDS_DIR
from fleet.jobs import LIVE_PID_SH

if TYPE_CHECKING:
    from fleet.config import FleetConfig
    from fleet.generation.multinode.chunks import Assignments
    from fleet.node import Node

__all__ = ["Copy", "Cleaned", "clean_nodes", "input_dir", "job_copies"]

RECORD_FILES = ("errors.jsonl", "rejects.jsonl", "quality_rejects.jsonl")

# For each (copy, job dir) pair: whether it exists, whether its runner lives, its shards, the shards it
# was seeded with, and which record files hold anything.
_SURVEY = LIVE_PID_SH + r'''
while [ $# -gt 1 ]; do
  o="$1"; j="$2"; shift 2
  echo "=== $o"
  [ -d "$o" ] && echo exists
  live_pid "$j/runner.pid" >/dev/null && echo alive
  for s in "$o"/shards/part-*.parquet; do [ -f "$s" ] && echo "shard ${s##*/}"; done
  [ -f "$o/.seeded.json" ] && { printf 'seeded '; tr -d '\n' < "$o/.seeded.json"; echo; }
  for f in ''' + " ".join(RECORD_FILES) + r'''; do [ -s "$o/$f" ] && echo "records $f"; done
done
exit 0
'''


@dataclass(frozen=True)
class Copy:
    """One chunk attempt's working copy on a node, and where that attempt put its commits in the store."""

    node: str
    output: str      # the working copy (the runner's output directory) on the node
    job_dir: str     # the runner's job directory on the node
    part: str        # the attempt's part in the store (its URL)
    abandoned: bool = False   # not its done chunk's counted attempt (fence.py): none of its rows is needed


@dataclass
class Cleaned:
    removed: list[str] = field(default_factory=list)          # "<node>:<path>" of each copy removed
    kept: dict[str, str] = field(default_factory=dict)        # "<node>:<path>" -> why it was kept
    skipped: str | None = None                                # why nothing was looked at

    def to_dict(self) -> dict[str, Any]:
        return {"removed": len(self.removed), "kept": self.kept, **({"skipped": self.skipped} if self.skipped else {})}


def job_copies(cfg: FleetConfig, output: str, assign: Assignments) -> list[Copy]:
    """Every attempt of the job at `output` (state.json's), as a working copy on its node."""
    from fleet.errors import ConfigError
    from fleet.generation.multinode.fence import attempt_part, counted_attempts
    from fleet.jobs import job_dir

    counted = counted_attempts(assign)
    copies = []
    for chunk, attempts in assign.sources():
        for a in attempts:
            try:
                node_cfg = cfg.node(a.node)
            except ConfigError:   # a node no longer in the config: nothing to reach it with
                continue
            copies.append(Copy(a.node, a.output, job_dir(node_cfg, cfg, a.output), attempt_part(output, a.node, a.output),
                               abandoned=chunk.index in counted and counted[chunk.index] is not a))
    return copies


def input_dir(output: str) -> str:
    """Where a runner keeps the chunk input it read from the store (publish.stage_input): beside its output."""
    parent, name = posixpath.split(output.rstrip("/"))
    return posixpath.join(parent, f".{name}.input")


def _survey(node: Node, copies: list[Copy]) -> dict[str, dict[str, Any]]:
    args = [x for c in copies for x in (c.output, c.job_dir)]
    text = node.run(["sh", "-c", _SURVEY, "fleet-clean", *args], timeout=120).stdout
    found: dict[str, dict[str, Any]] = {}
    for block in text.split("=== ")[1:]:
        head, _, body = block.partition("\n")
        info: dict[str, Any] = {"exists": False, "alive": False, "shards": set(), "seeded": set(), "records": []}
        for line in body.splitlines():
            word, _, rest = line.partition(" ")
            if word in ("exists", "alive"):
                info[word] = True
            elif word == "shard":
                info["shards"].add(rest)
            elif word == "seeded":
                try:
                    info["seeded"] = set(json.loads(rest))
                except ValueError:
                    pass   # unreadable: nothing counts as seeded, so every shard must be in the part
            elif word == "records":
                info["records"].append(rest)
        found[head.strip()] = info
    return found


def _why_kept(info: dict[str, Any], part: Store, abandoned: bool = False) -> str | None:
    """Why a copy must stay (None: everything in it is in the store, or, `abandoned`, none of it counts)."""
    if info["alive"]:
        return "its runner is still running"
    if abandoned:   # its chunk's rows are all in the counted attempt's part
        return None
    stored = set(part.names(SHARDS_DIR))
    missing = sorted(info["shards"] - info["seeded"] - stored)
    if missing:
        return f"{len(missing)} committed shard(s) not in the store ({', '.join(missing[:3])})"
    if info["records"] and not part.exists(MANIFEST_FILE):
        return f"its {', '.join(info['records'])} are not in the store (the attempt did not finish publishing)"
    return None


def clean_nodes(cfg: FleetConfig, output: str, copies: list[Copy]) -> Cleaned:
    """Remove `copies` (every attempt of the job at `output`) from their nodes by the rules above."""
    from fleet.node import connect

    result = Cleaned()
    raw = Store(output).read_bytes(MANIFEST_FILE)
    if not raw or not json.loads(raw).get("complete"):
        result.skipped = "the job's merged output in the store is not complete"
        return result
    by_node: dict[str, list[Copy]] = {}
    for c in copies:
        by_node.setdefault(c.node, []).append(c)
    for name, mine in sorted(by_node.items()):
        try:
            node = connect(cfg.node(name))
        except Exception as exc:   # a node gone for good: its copies stay (there is nothing to ask)
            for c in mine:
                result.kept[f"{name}:{c.output}"] = f"node unreachable ({type(exc).__name__})"
            continue
        try:
            _clean_node(node, name, mine, result)
        except Exception as exc:   # a node that stops answering midway: what was not removed stays
            for c in mine:
                key = f"{name}:{c.output}"
                if key not in result.removed:
                    result.kept.setdefault(key, f"node stopped answering ({type(exc).__name__})")
        finally:
            node.close()
    return result


def _clean_node(node: Node, name: str, copies: list[Copy], result: Cleaned) -> None:
    survey = _survey(node, copies)
    doomed: list[str] = []
    for c in copies:
        key = f"{name}:{c.output}"
        info = survey.get(c.output)
        why = "the node did not report it" if info is None else _why_kept(info, Store(c.part), c.abandoned)
        if why is not None:
            result.kept[key] = why
            continue
        doomed += [c.output, input_dir(c.output), c.job_dir]
        result.removed.append(key)
    if doomed:
        node.run(["rm", "-rf", "--", *doomed], timeout=600)
        parents = sorted({posixpath.dirname(c.output) for c in copies}, reverse=True)
        # the per-node and per-job directories above the copies, once empty (rmdir leaves a non-empty one)
        node.run(["sh", "-c", 'for d in "$@"; do rmdir "$d" "${d%/*}" 2>/dev/null; done; exit 0', "fleet-clean",
                  *parents], timeout=60)
