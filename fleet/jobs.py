"""The generation jobs on a node, as the core knows them: where a job lives (its directory, the
runner's exit file, the shell function that reads a live pid) and which jobs are alive there and
which servers they use (`live_jobs`).

Both sides ask these: bring-up (`fleet.servers` will not replace a server a live job uses) and
generation (the runner, `remote` which starts it, `validate` which checks before). Nothing here
imports either side."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleet.config import FleetConfig, NodeConfig
    from fleet.node import Node

EXIT_FILE = "exit.json"      # in the job directory, next to job.json: the runner's last word


def job_dir(node_cfg: NodeConfig, cfg: FleetConfig, output: str) -> str:
    """One job directory per (fleet, output dir) on the node: job.json, runner.log, runner.pid."""
    key = hashlib.sha256(output.encode()).hexdigest()[:10]
    return f"{node_cfg.workdir.rstrip('/')}/jobs/{cfg.name}-{key}"


# sh: live_pid PIDFILE prints the pid of the process a fleet pid file ("PID STARTTIME") names, when
# that very process is alive (not a zombie, and started at that time: a reused pid does not count).
LIVE_PID_SH = r'''
live_pid() {
  read p s _ < "$1" 2>/dev/null || [ -n "$p" ] || return 1
  case "$p" in ''|*[!0-9]*) return 1;; esac
  rest=$(sed 's/^.*) //' "/proc/$p/stat" 2>/dev/null) || return 1
  [ -n "$rest" ] || return 1
  case "$(echo "$rest" | cut -d' ' -f1)" in Z|X) return 1;; esac
  if [ -n "$s" ] && [ "$(echo "$rest" | cut -d' ' -f20)" != "$s" ]; then return 1; fi
  echo "$p"
}
'''


@dataclass
class LiveJob:
    """A generation runner alive on a node, and what its job.json says."""

    node: str
    pid: int
    job_dir: str
    output: str
    servers: list[dict[str, Any]]     # the job's server entries (node, index, url, …)

    def stop_hint(self) -> str:
        return (f"stop it with `kill -TERM {self.pid}` on node {self.node} (a clean stop: in-flight rows finish, "
                "the manifest is written; the same `fleet generate` command resumes it), or wait for it to finish")



_LIVE_JOBS = LIVE_PID_SH + r'''
for d in "$1"/jobs/"$2"-*; do
  p=$(live_pid "$d/runner.pid") || continue
  printf '=== %s %s\n' "$p" "$d"; cat "$d/job.json" 2>/dev/null; echo
done
exit 0
'''


def live_jobs(node: Node, workdir: str, fleet: str) -> list[LiveJob]:
    """Every generation runner of this fleet alive on the node (one round trip)."""
    text = node.run(["sh", "-c", _LIVE_JOBS, "fleet-jobs", workdir.rstrip("/"), fleet], timeout=60).stdout
    jobs = []
    for chunk in text.split("=== ")[1:]:
        head, _, body = chunk.partition("\n")
        pid, _, jdir = head.partition(" ")
        try:
            spec = json.loads(body) if body.strip() else {}
        except ValueError:
            spec = {}
        if pid.isdigit():
            jobs.append(LiveJob(node.name, int(pid), jdir, str(spec.get("output") or "?"),
                                list(spec.get("servers") or [])))
    return jobs
