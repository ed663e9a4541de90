"""Where a generation job lives on its node, as plain names and text (no imports of the rest of
fleet): the job directory, the runner's exit file, the shell function that reads a live pid.
The runner, `remote` (which starts it) and `validate` (which checks before) all read these."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleet.config import FleetConfig, NodeConfig

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
