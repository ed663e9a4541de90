"""Stage the model into the node's RAM disk: once per node, shared by every server on it.

Reading weights from a network filesystem made each server load for minutes (28 s per
shard with seven servers competing); a RAM-disk copy makes every load a memory read.
The copy itself runs on the node (`fleet/remote/stage.py`, standard library only, uploaded
to WORKDIR/bin/fleet_stage.py), so bytes never travel through the machine running the
flow. This module only drives it through the `Node` seam:

    upload the script (when changed) -> plan (sizes, what is already staged)
    -> room check against `df` BEFORE anything is copied -> copy -> parse its JSON report

Where: RAMDISK/fleet-<uid>/<fleet>/<source directory name>-<key> (the script's `destination`):
one user's, one fleet's, one state of the source's (the key digests its real path and every
file's path, size and mtime). So another user's or another fleet's model of the same directory
name never re-copies over the files live servers map, and a changed source is a new copy beside
the old one (the servers move to it when the bring-up replaces them, their launch spec naming the
new path). Only its owner removes a copy (`free_ramdisk`: this user's copies of this fleet, each
only when no live process uses it).

Idempotent: a finished copy of the same source state is adopted (nothing copied; see
`StageResult.adopted`), and a copy that was killed half-way is resumed and finished, never
served: the manifest DST/.fleet-stage.json says ``"complete": true`` only once every file is in
place (`is_staged`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet.errors import CommandFailed, ConfigError, PreflightFailed
from fleet.node.base import Node, describe
from fleet.remote.stage import ERROR_MARK, EXIT_IO, EXIT_NOSPACE, EXIT_USAGE, LOG_PREFIX, MANIFEST

__all__ = ["StageResult", "stage_model", "fleet_root", "is_staged", "read_manifest", "stage_argv",
           "STAGE_SCRIPT", "MANIFEST_NAME"]

log = logging.getLogger("fleet.staging")

STAGE_SCRIPT = Path(__file__).parent / "remote" / "stage.py"
# The script's manifest name and exit codes, from the script itself (stdlib only, safe to import).
MANIFEST_NAME = MANIFEST

GiB = 2**30


@dataclass(frozen=True)
class StageResult:
    """What staging did on one node."""

    src: str  # the model directory on the node (as given)
    dst: str  # the staged copy in the RAM disk: serve the model from here
    files: int  # files in the model directory (symlinks resolved)
    copied_files: int  # files copied this time
    skipped_files: int  # files already staged and unchanged
    bytes_total: int  # size of the model
    bytes_copied: int  # bytes copied this time
    seconds: float  # wall time of the whole stage, upload and room check included
    mb_per_s: float  # copy rate of the copy phase (0 when nothing was copied)
    adopted: bool  # nothing needed copying: an existing complete copy was reused
    verified: bool  # staged files were compared by SHA-256, not only by size and mtime
    node: str = ""  # the node's name
    removed_files: int = 0  # stale files and leftovers removed from the copy
    ignored: tuple[str, ...] = field(default_factory=tuple)  # not staged: "path (reason)", e.g. broken symlinks


def fleet_root(ramdisk: str, fleet: str, uid: int | str) -> str:
    """This user's and this fleet's staging directory: RAMDISK/fleet-<uid>/<fleet> (copies are under it)."""
    return posixpath.join(ramdisk.rstrip("/") or "/", f"fleet-{uid}", fleet)


def _check_source(source: str) -> None:
    name = posixpath.basename(source.rstrip("/"))
    if not name or name in (".", ".."):
        raise ConfigError(f"model.source {source!r} has no directory name to stage under",
                          remedy="set model.source to the model directory itself, e.g. /data/models/Qwen3-8B")


def stage_argv(python: str, script: str, *, source: str, ramdisk: str, fleet: str, streams: int = 8,
               verify: bool = False, plan_only: bool = False) -> list[str]:
    """The command that runs the stage script on the node (it names the copy: see the module docstring)."""
    argv = [python, script, "--src", source, "--ramdisk", ramdisk, "--fleet", fleet, "--streams", str(streams)]
    if verify:
        argv.append("--verify")
    if plan_only:
        argv.append("--plan-only")
    return argv


def parse_report(text: str) -> dict[str, Any] | None:
    """The stage script's JSON object: the last output line that is one."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                data = json.loads(line)
            except ValueError:
                continue
            if isinstance(data, dict):
                return data
    return None


def parse_df_avail(text: str) -> int:
    """Bytes free from `df -B1 --output=avail PATH` (a header line, then the number)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.isdigit():
            return int(line)
    raise ValueError(f"no byte count in df output: {text!r}")


def read_manifest(node: Node, dst: str) -> dict[str, Any] | None:
    """The staging manifest of `dst` on the node, or None when absent or unreadable."""
    text = node.read_text(posixpath.join(dst, MANIFEST_NAME))
    if not text:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def is_staged(node: Node, dst: str) -> bool:
    """True when `dst` holds a finished copy (its manifest says complete)."""
    manifest = read_manifest(node, dst)
    return manifest is not None and manifest.get("complete") is True


def _script_sha() -> str:
    return hashlib.sha256(STAGE_SCRIPT.read_bytes()).hexdigest()


def ensure_script(node: Node, workdir: str) -> str:
    """Upload stage.py to WORKDIR/bin/fleet_stage.py unless the node has this very version."""
    from fleet.workdir import ensure_workdir

    ensure_workdir(node, workdir)
    remote = posixpath.join(workdir, "bin", "fleet_stage.py")
    res = node.run(["sha256sum", "--", remote], check=False, timeout=60)
    if res.ok and res.stdout.split()[:1] == [_script_sha()]:
        return remote
    # upload beside it, then rename: a stager starting meanwhile never reads half a script
    tmp = f"{remote}.{uuid.uuid4().hex[:8]}.tmp"
    node.put(STAGE_SCRIPT, tmp)
    node.run(["mv", "-f", tmp, remote], timeout=60)
    return remote


def _error_line(stderr: str) -> str:
    for line in reversed(stderr.splitlines()):
        if ERROR_MARK in line:
            return line.split(ERROR_MARK, 1)[1].strip()
    return ""


def _failed(node: Node, exc_or_code: CommandFailed | int, *, argv: list[str], stderr: str,
            source: str, dst: str, ramdisk: str) -> CommandFailed:
    """Turn the stage script's exit code into an error that says what to do."""
    code = exc_or_code if isinstance(exc_or_code, int) else exc_or_code.exit_code
    why = _error_line(stderr)
    if code == EXIT_USAGE:
        reason = f"cannot stage {source} on {node.name}: {why or 'bad source'}"
        in_place = "same directory" in why or "already in the RAM disk" in why
        if "not a directory of this user" in why:   # RAMDISK/fleet-<uid> made by someone else
            reason = f"cannot stage {source} on {node.name}: {why}"
            remedy = (f"ask whoever made it (or root) to remove it, or set nodes.ramdisk to another RAM disk "
                      f"on {node.name}: fleet never writes into another user's directory")
        else:
            remedy = ("set model.stage=false to serve the model from where it is" if in_place else
                      f"set model.source to an existing model directory as seen from {node.name} "
                      "(paths are on the node, not where the flow runs)")
    elif code == EXIT_NOSPACE:
        reason = f"RAM disk {ramdisk} on {node.name} ran out of space while staging {source}: {why}"
        remedy = (f"free {ramdisk} (old models: ls -la {ramdisk}), use a node with more RAM, or set "
                  "model.stage=false; the partial copy is marked incomplete and a re-run resumes it")
    elif code == EXIT_IO:
        reason = f"I/O error while staging {source} to {dst} on {node.name}: {why}"
        remedy = ("check that the source is readable and nobody is writing to it, then re-run: "
                  "files already staged are kept")
    else:
        reason = f"staging {source} to {dst} on {node.name} failed with exit code {code}"
        remedy = "read the stderr above; a re-run resumes the copy (files already staged are kept)"
    return CommandFailed(reason, host=node.host, command=argv, exit_code=code, stderr=stderr, remedy=remedy)


class NotStaged(Exception):
    """`stage_model(adopt_only=True)` found something to copy (and copied nothing)."""


def stage_model(node: Node, *, source: str, ramdisk: str, fleet: str, workdir: str, python: str = "python3",
                streams: int = 8, verify: bool = False, margin_bytes: int = 4 * GiB,
                timeout: float = 6 * 3600, adopt_only: bool = False) -> StageResult:
    """Copy the model directory `source` into this fleet's part of `ramdisk` on `node` once; adopt a
    finished copy of the same source state. `StageResult.dst` is where (serve the model from there).

    Raises PreflightFailed before copying anything when the RAM disk cannot hold what is
    left to copy plus `margin_bytes`; CommandFailed (with a remedy) when the copy fails;
    CommandTimeout past `timeout` (transient: a retry resumes where the copy stopped).
    `adopt_only`: raise NotStaged after the plan, copying nothing, unless every byte is staged already.
    """
    t0 = time.monotonic()
    _check_source(source)
    script = ensure_script(node, workdir)
    where = fleet_root(ramdisk, fleet, "<uid>")
    argv = stage_argv(python, script, source=source, ramdisk=ramdisk, fleet=fleet, streams=streams, plan_only=True)
    plan = _plan(node, argv, source=source, dst=where, ramdisk=ramdisk, timeout=timeout)
    _check_room(node, plan, source=source, ramdisk=ramdisk, margin_bytes=margin_bytes)
    if adopt_only and int(plan["bytes_total"]) - int(plan["already_staged_bytes"]) != 0:
        raise NotStaged(f"[{node.name}] {source}: not staged yet (nothing copied)")
    report = _copy(node, stage_argv(python, script, source=source, ramdisk=ramdisk, fleet=fleet, streams=streams,
                                    verify=verify),
                   source=source, dst=str(plan.get("dst") or where), ramdisk=ramdisk, timeout=timeout)
    dst = str(report["dst"])
    result = _result(node, report, source=source, dst=dst, seconds=round(time.monotonic() - t0, 3))
    log.info("[%s] staged %s -> %s: %d/%d files copied, %.2f GiB at %.0f MB/s, %.1f s%s", node.name, source,
             dst, result.copied_files, result.files, result.bytes_copied / GiB, result.mb_per_s, result.seconds,
             " (adopted)" if result.adopted else "")
    return result


def _plan(node: Node, argv: list[str], *, source: str, dst: str, ramdisk: str, timeout: float) -> dict[str, Any]:
    """The stage script's --plan-only report: sizes, what is staged already, what removal frees."""
    log.info("[%s] %s", node.name, describe(argv))
    res = node.run(argv, check=False, timeout=min(timeout, 1800.0))
    if res.exit_code == 127:
        node.raise_for(res)  # CommandNotFound: no python on the node
    if not res.ok:
        raise _failed(node, res.exit_code, argv=argv, stderr=res.stderr, source=source, dst=dst, ramdisk=ramdisk)
    plan = parse_report(res.stdout)
    if plan is None:
        raise CommandFailed("the stage script printed no plan", host=node.host, command=argv,
                            exit_code=res.exit_code, stderr=res.stderr or res.stdout,
                            remedy=f"run the command by hand on {node.name} and check its output")
    for item in plan.get("ignored", []):
        log.warning("[%s] not staged: %s/%s (%s)", node.name, source, item.get("path"), item.get("reason"))
    return plan


def _check_room(node: Node, plan: dict[str, Any], *, source: str, ramdisk: str, margin_bytes: int) -> None:
    """Room check before the first byte moves; PreflightFailed when what is left does not fit."""
    # Old copies of changed files and stale files are deleted before copying, so they count
    # as room. With nothing to copy there is nothing to refuse: adopting a finished copy
    # takes no space.
    df_argv = ["df", "-B1", "--output=avail", ramdisk]
    free = parse_df_avail(node.run(df_argv, timeout=60).stdout)
    needed = int(plan["bytes_total"]) - int(plan["already_staged_bytes"])
    room = free + int(plan.get("reclaimable_bytes", 0))
    if needed > 0 and needed + margin_bytes > room:
        raise PreflightFailed(
            f"RAM disk {ramdisk} on node {node.name} is too small to stage {source}: "
            f"{needed / GiB:.2f} GiB to copy + {margin_bytes / GiB:.2f} GiB margin needed, "
            f"{room / GiB:.2f} GiB free ({needed + margin_bytes} > {room} bytes)",
            host=node.host, command=df_argv,
            remedy=(f"free {ramdisk} on {node.name} (old models: ls -la {ramdisk}), use a node with more RAM, "
                    "lower model.stage_margin_gb, or set model.stage=false to serve from the source"),
        )


def _copy(node: Node, argv: list[str], *, source: str, dst: str, ramdisk: str, timeout: float) -> dict[str, Any]:
    """Run the copy, its progress lines to the log; its final report (complete: true)."""
    log.info("[%s] %s", node.name, describe(argv))
    lines: list[str] = []
    try:
        for line in node.stream(argv, timeout=timeout):
            lines.append(line)
            if line.startswith(LOG_PREFIX):
                log.info("[%s] %s", node.name, line.removeprefix(LOG_PREFIX))
    except CommandFailed as exc:
        raise _failed(node, exc, argv=argv, stderr="\n".join(lines[-40:]) or exc.stderr_tail,
                      source=source, dst=dst, ramdisk=ramdisk) from exc
    report = parse_report("\n".join(lines))
    if report is None or report.get("complete") is not True:
        raise CommandFailed("the stage script finished without a report", host=node.host, command=argv,
                            exit_code=0, stderr="\n".join(lines[-40:]),
                            remedy=f"run the command by hand on {node.name} and check its output")
    return report


def _result(node: Node, report: dict[str, Any], *, source: str, dst: str, seconds: float) -> StageResult:
    return StageResult(
        src=source,
        dst=dst,
        files=int(report["files"]),
        copied_files=int(report["copied_files"]),
        skipped_files=int(report["skipped_files"]),
        bytes_total=int(report["bytes_total"]),
        bytes_copied=int(report["bytes_copied"]),
        seconds=seconds,
        mb_per_s=float(report["mb_per_s"]),
        adopted=int(report["copied_files"]) == 0,
        verified=bool(report["verified"]),
        node=node.name,
        removed_files=int(report.get("removed_files", 0)),
        ignored=tuple(f"{i.get('path')} ({i.get('reason')})" for i in report.get("ignored", [])),
    )


# -- freeing the copy ---------------------------------------------------------------------
# Only this user's copies of this fleet (RAMDISK/fleet-<uid>/<fleet>/*), only a directory fleet
# staged (its staging manifest is there), and only when no live process names it on its command
# line (this fleet's servers still running on it). Idempotent: a copy already gone is reported
# as such.

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


# sh -c COPIES fleet-copies RAMDISK FLEET: this user's fleet root, then each copy in it.
_COPIES = r"""
root="$1/fleet-$(id -u)/$2"
printf '%s\n' "$root"
for d in "$root"/*; do [ -d "$d" ] && [ ! -L "$d" ] && printf '%s\n' "$d"; done
exit 0
"""


def free_ramdisk(node: Node, *, source: str | None, stage: bool, ramdisk: str, fleet: str) -> dict[str, Any]:
    """Free this user's copies of this fleet's model on the node (`unstage` each): one answer, with
    `path` the fleet's staging directory and `action` "freed" only when every copy was."""
    if not stage or not source:
        return {"path": None, "action": "nothing staged (model.stage off or no source)"}
    t0 = time.monotonic()
    lines = node.run(["sh", "-c", _COPIES, "fleet-copies", ramdisk.rstrip("/") or "/", fleet],
                     timeout=60).stdout.splitlines()
    root, copies = (lines[0] if lines else fleet_root(ramdisk, fleet, "<uid>")), lines[1:]
    done = [unstage(node, d) for d in copies]
    freed = [d for d in done if d["action"] == "freed"]
    if not done:
        action = "already gone"
    elif len(freed) == len(done):
        action = "freed"
    else:
        action = "; ".join(f"{posixpath.basename(d['path'])}: {d['action']}" for d in done)
    if done and len(freed) == len(done):
        # empty now: leave no trace (the user's directory too, unless another fleet of theirs is in it)
        node.run(["rmdir", "--", root, posixpath.dirname(root)], check=False, timeout=30)
    total = sum(d["bytes"] or 0 for d in freed) if freed else None
    return {"path": root, "action": action, "bytes": total, "seconds": round(time.monotonic() - t0, 3)}
