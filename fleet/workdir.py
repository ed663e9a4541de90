"""The node workdir is ours or refused.

fleet keeps pid files, launch records, job files and logs in `nodes[].workdir`, and acts on
them: it signals the pids, adopts the servers, reads the jobs. A workdir someone else can
write is a workdir someone else controls: on a shared node another user created `/tmp/fleet`
first, planted `servers/<name>.pid` naming any process group (fleet up killed it) and a
symlink at a temp file (fleet up wrote through it). So before fleet reads or writes there:

- the workdir is created 0700 when missing (umask 077, parents too);
- it, and every directory up to two levels below it, must belong to the connecting user and
  must not be writable by group or others (`find -perm /022`);
- its parent must not be writable by others unless it is sticky (/tmp is: 1777), or someone
  could rename ours away and put theirs in its place.

The check is one shell script (a pure builder, run through `fleet.node` like everything
else), so it works the same on the local node and over SSH, and its answer is cached per
Node object: a directory that was ours a minute ago cannot be taken without root.
"""

from __future__ import annotations

from fleet.errors import ConfigError
from fleet.node import Node

# sh -c CHECK fleet-workdir WORKDIR CREATE(0|1)
# Prints "missing" (and exits 0) when CREATE=0 and there is nothing; otherwise one line per
# problem: "owner UID PATH", "mode MODE PATH", "parent MODE PATH", "mkdir ERROR".
_CHECK = r"""
w=$1; create=$2
umask 077
if [ ! -e "$w" ] && [ ! -L "$w" ]; then
  [ "$create" = 1 ] || { echo missing; exit 0; }
  err=$(mkdir -p -- "$w" 2>&1) || { echo "mkdir $err"; exit 0; }
fi
me=$(id -u)
find -H "$w" -maxdepth 2 -type d \( ! -uid "$me" -o -perm /022 \) -printf '%U %m %p\n' 2>/dev/null |
  while read -r uid mode path; do
    if [ "$uid" != "$me" ]; then echo "owner $uid $path"; else echo "mode $mode $path"; fi
  done
parent=$(dirname -- "$(readlink -f -- "$w")")
find "$parent" -maxdepth 0 -perm /002 ! -perm /1000 -printf 'parent %m %p\n' 2>/dev/null
"""


def check_script(workdir: str, create: bool) -> list[str]:
    """The argv that checks (and with `create`, makes) a workdir."""
    return ["sh", "-c", _CHECK, "fleet-workdir", workdir, "1" if create else "0"]


def problems(output: str) -> list[str]:
    """What the check script found wrong, one readable line each ([] when the workdir is ours)."""
    out = []
    for line in output.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "owner":
            uid, _, path = rest.partition(" ")
            out.append(f"{path} belongs to uid {uid}, not to the connecting user")
        elif kind == "mode":
            mode, _, path = rest.partition(" ")
            out.append(f"{path} is writable by group or others (mode {mode})")
        elif kind == "parent":
            mode, _, path = rest.partition(" ")
            out.append(f"its parent {path} is writable by others and not sticky (mode {mode})")
        elif kind == "mkdir":
            out.append(f"cannot create it: {rest}")
    return out


def ensure_workdir(node: Node, workdir: str, *, create: bool = True) -> bool:
    """Make sure `workdir` on the node is ours (creating it 0700 when `create`); raise ConfigError
    naming each problem otherwise. Returns False when it does not exist and `create` is off."""
    cache: set[str] = node.__dict__.setdefault("_trusted_workdirs", set())
    if workdir in cache:
        return True
    res = node.run(check_script(workdir, create), check=False, timeout=60)
    if res.stdout.strip() == "missing":
        return False
    found = problems(res.stdout)
    if not res.ok and not found:
        found = [f"the check failed (exit code {res.exit_code}): {res.stderr.strip()[-300:]}"]
    if found:
        raise ConfigError(
            f"workdir {workdir} on {node.host} is not safe to use: " + "; ".join(found[:5])
            + ("; …" if len(found) > 5 else ""),
            remedy="use a workdir only you can write: the default (~/.cache/fleet of the connecting user), or "
                   "fix it on the node (chown -R $USER and chmod go-w); fleet never trusts pid files or "
                   "records in a directory another user can write")
    cache.add(workdir)
    return True
