"""Free the RAM-disk copy of the model (teardown with free_ramdisk=True).

Only a directory fleet staged is removed (its staging manifest is there), and only when no
live process names it on its command line (another fleet's server may share the copy).
Idempotent: a copy already gone is reported as such.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import task

from fleet.config import FleetConfig
from fleet.node import Node
from fleet.staging import MANIFEST_NAME, staged_path
from tasks.nodes import node_for
from tasks.policy import TASK_OPTS

# sh -c USERS fleet-users HEAD TAIL: pids whose argv names the directory HEAD+TAIL (or a file in it).
# The path goes in as two halves joined in the shell, so no process of the scan itself (the
# shell, a remote `timeout` wrapper) carries the whole path in its own argv.
_USERS = r"""
d="$1$2"
for f in /proc/[0-9]*/cmdline; do
  p=${f#/proc/}; p=${p%/cmdline}
  [ "$p" = "$$" ] && continue
  c=" $(tr '\0' ' ' < "$f" 2>/dev/null) "
  case "$c" in *" $d "*|*" $d/"*|*"=$d "*|*"=$d/"*) echo "$p" ;; esac
done
exit 0
"""


def users_of(node: Node, path: str) -> list[int]:
    """Live processes whose command line names `path` (zombies excluded)."""
    path = path.rstrip("/")
    half = len(path) // 2
    res = node.run(["sh", "-c", _USERS, "fleet-users", path[:half], path[half:]], check=False, timeout=60)
    return [p for p in (int(x) for x in res.stdout.split() if x.isdigit()) if node.is_alive(p)]


def unstage(node: Node, dst: str) -> dict[str, Any]:
    """Remove the staged copy at `dst`; say what was done (never raises for a refusal)."""
    t0 = time.monotonic()
    out: dict[str, Any] = {"path": dst, "action": "none", "bytes": None}
    exists = node.run(["test", "-d", dst], check=False, timeout=30).ok
    if not exists:
        out["action"] = "already gone"
    elif not node.run(["test", "-f", f"{dst.rstrip('/')}/{MANIFEST_NAME}"], check=False, timeout=30).ok:
        out["action"] = f"kept: no {MANIFEST_NAME} (not staged by fleet)"
    elif pids := users_of(node, dst):
        out["action"] = f"kept: in use by pid {', '.join(map(str, pids[:10]))}"
    else:
        du = node.run(["du", "-sb", dst], check=False, timeout=120).stdout.split()
        out["bytes"] = int(du[0]) if du and du[0].isdigit() else None
        node.run(["rm", "-rf", "--", dst], timeout=600)
        out["action"] = "freed"
    out["seconds"] = round(time.monotonic() - t0, 3)
    return out


@task(name="free-ramdisk", task_run_name="free-ramdisk-{node_name}", **TASK_OPTS)
def free_ramdisk(cfg: FleetConfig, node_name: str) -> dict[str, Any]:
    node_cfg = next(n for n in cfg.nodes if n.name == node_name)
    if not cfg.model.stage or not cfg.model.source:
        return {"node": node_name, "path": None, "action": "nothing staged (model.stage off or no source)"}
    res = unstage(node_for(cfg, node_name), staged_path(cfg.model.source, node_cfg.ramdisk))
    res["node"] = node_name
    return res
