"""Check a generation job before anything starts: the input, the output location, the job already there.

`plan_job` is what `fleet generate` and the flow's `generate` action call first, before any
server is brought up, so a wrong path, an empty or non-JSONL file, an output that cannot be
written or a second job into a live one's directory is answered in a second (exit 2), not
after the bring-up:

- **input** (`check_input`): resolved against the caller's directory; must exist, be a file,
  be readable, and hold at least one valid row among its first `SNIFF_ROWS` rows (a CSV, an
  empty file, a file of rejects is an error, not "generated 0 rows"). A path that is not on
  this machine but absolute is taken as a path on an SSH node and checked there (exists, file,
  readable, not empty; its rows are checked by the runner).
- **output** (`check_output`): on the node; an existing directory or a path whose nearest
  existing ancestor is a writable directory (a directory made and removed in it proves that),
  with free space, and not a non-empty directory
  that holds no fleet job (`--output ~` would scatter shards into a home directory).
- **the job already there** (`decide`): one output directory is one job. A live runner is
  re-attached to only when the input (SHA-256), the generation parameters and the mode are the
  same; a finished job re-run is "nothing to do" when it holds every row this call asks for (a job
  finished under `--limit 100` goes on under `--limit 200` or without one: `covers`); a different
  input or different parameters into a directory that holds results is refused (`JobConflict`),
  each with its remedy.

What defines a job (`job_params`): the `[generation]` section minus the operational knobs
(concurrency, timeouts, attempts, shard size, price, limit: `OPERATIONAL`), plus the model's source and
served name. A live runner is compared on the whole `[generation]` section, since it would
silently keep its own values.
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from fleet.errors import InputError, JobConflict
from fleet.generation.data.jobrecord import params_diff

if TYPE_CHECKING:
    from fleet.config import FleetConfig, GenerationConfig, NodeConfig
    from fleet.node import Node

__all__ = ["SNIFF_ROWS", "OPERATIONAL", "InputCheck", "OutputCheck", "ExistingJob", "JobPlan", "check_input",
           "check_output", "covers", "job_params", "read_existing", "decide", "plan_job", "fingerprint"]

SNIFF_ROWS = 10_000   # rows read at most to find the first valid one
MIN_FREE_BYTES = 1 << 20
# Knobs that change how a job runs, not what it generates: a resume may change them.
# (`limit`: a first 1,000 rows, then all of them, is one job.) Any other `*_s` key is a timing knob too.
OPERATIONAL = frozenset({"max_concurrency_per_server", "request_timeout_s", "max_attempts", "shard_rows",
                         "price_per_gpu_hour", "limit", "stall_s", "stall_min_s", "stall_max_s",
                         "max_response_mib"})


def _operational(key: str) -> bool:
    return key in OPERATIONAL or key.endswith("_s")


@dataclass(frozen=True)
class InputCheck:
    path: str                     # absolute
    size: int
    local: bool                   # False: a path on the node, checked there
    rows_read: int = 0            # rows read to find the first valid one
    first_valid_line: int | None = None


@dataclass(frozen=True)
class OutputCheck:
    node: str
    path: str
    exists: bool
    free_bytes: int | None
    entries: list[str] = field(default_factory=list)   # names in the directory (first 50)


@dataclass
class ExistingJob:
    """What one output directory on one node already holds."""

    node: str
    output: str
    runner_pid: int | None = None          # a live runner writing it
    runner_job: dict[str, Any] | None = None   # that runner's job.json (the job dir's)
    store_job: dict[str, Any] | None = None    # DIR/job.json: input_fingerprint, params
    manifest: dict[str, Any] | None = None


@dataclass(frozen=True)
class JobPlan:
    input: str                  # absolute path (local, or on the node when `input_local` is False)
    output: str                 # as the runner sees it (absolute)
    verdict: Literal["new", "resume", "attach", "done"]
    message: str                # one line for the operator
    input_local: bool = True
    done: dict[str, int] | None = None   # counts, for "done"


# ---------------------------------------------------------------------------- input


def _resolve(path: str | os.PathLike[str], cwd: str | None) -> Path:
    p = Path(os.path.expanduser(str(path)))
    if not p.is_absolute():
        p = Path(cwd or os.getcwd()) / p
    return Path(os.path.normpath(p))


def check_input(path: str | os.PathLike[str], gen: GenerationConfig | None = None, *, cwd: str | None = None,
                sniff_rows: int = SNIFF_ROWS) -> InputCheck:
    """The input exists, is a readable file, and holds a valid row among its first rows; InputError if not."""
    from fleet.generation.data.inputs import iter_input
    from fleet.generation.data.rows import InputStats, Request

    p = _resolve(path, cwd)
    if not p.exists():
        raise InputError(f"input {path} does not exist" + (f" (resolved to {p})" if str(p) != str(path) else ""),
                         remedy="pass an existing --input file (JSONL, JSONL.gz or Parquet); a relative path is "
                                "taken from the directory you run fleet in")
    if p.is_dir():
        raise InputError(f"input {p} is a directory",
                         remedy="pass one file (JSONL, JSONL.gz or Parquet); concatenate several first")
    if not p.is_file():
        raise InputError(f"input {p} is not a regular file", remedy="pass a JSONL, JSONL.gz or Parquet file")
    if not os.access(p, os.R_OK):
        raise InputError(f"input {p} is not readable (permission denied)",
                         remedy="make it readable by the user fleet runs as")
    size = p.stat().st_size
    if size == 0:
        raise InputError(f"input {p} is empty", remedy="pass a file with at least one row")
    stats = InputStats()
    first_reject = None
    for item in iter_input(p, gen, stats=stats):   # InputError: corrupt gzip / Parquet, with the offset
        if isinstance(item, Request):
            return InputCheck(str(p), size, True, stats.rows, item.line)
        if first_reject is None:
            first_reject = item
        if stats.rows >= sniff_rows:
            break
    hint = " (is it CSV? fleet reads JSONL, JSONL.gz or Parquet)" if p.suffix.lower() in (".csv", ".tsv") else ""
    why = f"; line {first_reject.line}: {first_reject.reason}" if first_reject is not None else ""
    scope = f"the first {stats.rows:,} rows" if stats.rows >= sniff_rows else f"all {stats.rows:,} rows"
    if stats.rows == 0:
        raise InputError(f"input {p} holds no rows (only blank lines){hint}",
                         remedy="pass a file with at least one row")
    raise InputError(f"input {p} holds no valid row: {scope} are rejects{why}{hint}",
                     remedy="fix the rows (one JSON object per line with 'messages', 'body.messages' or "
                            "'conversations'; see the README's Generation section)")


def _check_input_on_node(node: Node, path: str) -> InputCheck:
    script = ('p="$1"; [ -e "$p" ] || { echo missing; exit 0; }; [ -d "$p" ] && { echo dir; exit 0; }; '
              '[ -f "$p" ] || { echo notfile; exit 0; }; [ -r "$p" ] || { echo unreadable; exit 0; }; '
              'echo "ok $(wc -c < "$p")"')
    out = node.run(["sh", "-c", script, "fleet-input", path], timeout=60).stdout.strip()
    where = f"on node {node.name}"
    if out == "missing":
        raise InputError(f"input {path} does not exist here nor {where}",
                         remedy="pass an existing --input file (a local file is uploaded to SSH nodes)")
    if out == "dir":
        raise InputError(f"input {path} {where} is a directory", remedy="pass one file")
    if out == "notfile":
        raise InputError(f"input {path} {where} is not a regular file", remedy="pass a JSONL or Parquet file")
    if out == "unreadable":
        raise InputError(f"input {path} {where} is not readable", remedy="make it readable by the SSH user")
    size = int(out.split()[1])
    if size == 0:
        raise InputError(f"input {path} {where} is empty", remedy="pass a file with at least one row")
    return InputCheck(path, size, False)


_FP_CACHE: dict[tuple[str, int, int], str] = {}


def fingerprint(path: str) -> str:
    """SHA-256 of a local input, remembered per (path, size, mtime) for this process."""
    from fleet.generation.data.sources import input_fingerprint

    st = os.stat(path)
    key = (path, st.st_size, st.st_mtime_ns)
    if key not in _FP_CACHE:
        _FP_CACHE[key] = input_fingerprint(path)
    return _FP_CACHE[key]


def _fingerprint_on(node: Node, path: str) -> str:
    res = node.run(["sha256sum", path], timeout=3600)
    return res.stdout.split()[0]


# ---------------------------------------------------------------------------- output


_OUTPUT_SCRIPT = r'''
o="$1"
if [ -e "$o" ] && [ ! -d "$o" ]; then echo "notdir"; exit 0; fi
d="$o"
while [ ! -e "$d" ]; do d=$(dirname "$d"); done
if [ ! -d "$d" ]; then echo "ancestor-notdir $d"; exit 0; fi
if [ ! -w "$d" ] || [ ! -x "$d" ]; then echo "notwritable $d"; exit 0; fi
# -w says yes to root on a filesystem that makes no directories (/proc, /sys): only trying tells
if [ ! -d "$o" ]; then
  t="$d/.fleet-output-probe-$$"
  if ! err=$(mkdir "$t" 2>&1); then printf 'cannotcreate %s\n%s\n' "$d" "${err##*: }"; exit 0; fi
  rmdir "$t"
fi
if [ -d "$o" ]; then echo "exists"; else echo "absent"; fi
df -Pk "$d" 2>/dev/null | tail -n 1
[ -d "$o" ] && ls -A "$o" 2>/dev/null | head -n 50
exit 0
'''
_FLEET_OUTPUT_NAMES = frozenset({"job.json", "shards", "progress.json", "manifest.json", "errors.jsonl",
                                 "rejects.jsonl", ".lock",
                                 "multinode.json"})   # a job over several nodes (multinode.py): <node>/chunk-N


def check_output(node: Node, output: str) -> OutputCheck:
    """The output location on the node can hold a job; InputError (exit 2) with the reason if not."""
    if not posixpath.isabs(output):
        raise InputError(f"--output {output} is relative: on node {node.name} it would be taken from the "
                         "runner's own directory", remedy="pass an absolute --output path on the node")
    lines = node.run(["sh", "-c", _OUTPUT_SCRIPT, "fleet-output", output], timeout=60).stdout.splitlines()
    head = lines[0].split(" ", 1) if lines else ["?"]
    where = f"on node {node.name}"
    if head[0] == "notdir":
        raise InputError(f"--output {output} {where} exists and is not a directory",
                         remedy="pass a directory (new or a previous job's) as --output")
    if head[0] == "ancestor-notdir":
        raise InputError(f"--output {output} {where} cannot be created: {head[1]} is not a directory",
                         remedy="pass an --output under a directory")
    if head[0] == "notwritable":
        raise InputError(f"--output {output} {where} cannot be created: {head[1]} is not writable",
                         remedy="pass an --output in a directory you can write to")
    if head[0] == "cannotcreate":
        why = lines[1] if len(lines) > 1 else "refused"
        raise InputError(f"--output {output} {where} cannot be created: making a directory in {head[1]} fails "
                         f"({why})", remedy="pass an --output on a filesystem you can write to")
    if head[0] not in ("exists", "absent"):
        raise InputError(f"--output {output} {where} could not be checked: {' '.join(lines)[:200]}",
                         remedy="check the path on the node")
    free = None
    if len(lines) > 1:
        parts = lines[1].split()
        if len(parts) >= 4 and parts[3].isdigit():
            free = int(parts[3]) * 1024
    entries = [ln for ln in lines[2:] if ln.strip()] if head[0] == "exists" else []
    if free is not None and free < MIN_FREE_BYTES:
        raise InputError(f"--output {output} {where}: no space left ({free // 1024} KiB free)",
                         remedy="free space on that filesystem or pick another --output")
    if entries and _FLEET_OUTPUT_NAMES.isdisjoint(entries):
        raise InputError(f"--output {output} {where} is a non-empty directory that holds no fleet job "
                         f"({', '.join(entries[:5])}{', …' if len(entries) > 5 else ''})",
                         remedy="pass a new or empty directory, or the directory of a previous job")
    return OutputCheck(node.name, output, head[0] == "exists", free, entries)


# ---------------------------------------------------------------------------- the job already there


def job_params(config: FleetConfig | dict[str, Any]) -> dict[str, Any]:
    """What a job generates with: [generation] minus OPERATIONAL, and the model (see the module docstring)."""
    data = config if isinstance(config, dict) else config.model_dump(mode="json")
    gen = {k: v for k, v in (data.get("generation") or {}).items() if not _operational(k)}
    model = data.get("model") or {}
    return {"generation": gen, "model": {k: model.get(k) for k in ("source", "served_name")}}



_EXISTING_SCRIPT = r'''
j="$1"; o="$2"
if p=$(live_pid "$j/runner.pid"); then echo "pid $p"; else echo "pid -"; fi
for f in "$j/job.json" "$o/job.json" "$o/manifest.json"; do
  echo "--- $f"; cat "$f" 2>/dev/null
done
exit 0
'''


def read_existing(node: Node, node_cfg: NodeConfig, cfg: FleetConfig, output: str) -> ExistingJob:
    """The live runner (if any) and the records of the job in `output` on this node: one round trip."""
    from fleet.jobs import LIVE_PID_SH, job_dir

    text = node.run(["sh", "-c", LIVE_PID_SH + _EXISTING_SCRIPT, "fleet-job", job_dir(node_cfg, cfg, output), output],
                    timeout=60).stdout
    head, _, rest = text.partition("\n")
    pid = head.split()[1] if head.startswith("pid ") else "-"
    docs: list[dict[str, Any] | None] = []
    for chunk in rest.split("--- ")[1:]:
        _, _, body = chunk.partition("\n")
        try:
            doc = json.loads(body) if body.strip() else None
        except ValueError:
            doc = None
        docs.append(doc if isinstance(doc, dict) else None)
    docs += [None] * (3 - len(docs))
    return ExistingJob(node.name, output, int(pid) if pid.isdigit() else None, docs[0] if pid.isdigit() else None,
                       docs[1], docs[2])


def _stop_hint(ex: ExistingJob) -> str:
    return (f"`kill -TERM {ex.runner_pid}` on node {ex.node} stops it cleanly (in-flight rows finish, the "
            "manifest is written; the same command resumes it later)")


def decide(ex: ExistingJob, cfg: FleetConfig, *, input_fp: Callable[[], str], input_path: str,
           retry_errors: bool, paths_comparable: bool = True) -> JobPlan:
    """New, resume, re-attach or nothing to do — or JobConflict: see the module docstring."""
    out = ex.output
    recorded_fp = (ex.store_job or {}).get("input_fingerprint") or \
        ((ex.manifest or {}).get("input") or {}).get("fingerprint")
    if ex.runner_pid is not None:
        live = ex.runner_job or {}
        who = f"a generation runner (pid {ex.runner_pid}) is still writing {out} on node {ex.node}"
        if retry_errors:
            raise JobConflict(f"{who}; --retry-errors needs it to end first",
                              remedy=f"wait for it to finish (the same command without --retry-errors watches "
                                     f"it), or stop it — {_stop_hint(ex)} — then run this command again")
        if recorded_fp is not None:
            same_input = recorded_fp == input_fp()
            theirs = f"sha256 {recorded_fp[:12]}…"
        else:   # the live runner has not recorded its input yet: compare the paths (when both are the node's)
            same_input = not paths_comparable or live.get("input") in (None, input_path)
            theirs = str(live.get("input"))
        if not same_input:
            raise JobConflict(f"{who} for a different input ({theirs}; this command's is {input_path})",
                              remedy=f"give this input its own --output, or wait for that job / stop it — "
                                     f"{_stop_hint(ex)}")
        live_cfg = live.get("config") or {}
        new_cfg = cfg.model_dump(mode="json")
        diff = params_diff({"generation": live_cfg.get("generation") or {}, "model": job_params(live_cfg)["model"]},
                           {"generation": new_cfg["generation"], "model": job_params(new_cfg)["model"]}) \
            if live_cfg else []
        if diff:
            raise JobConflict(f"{who} with other settings ({'; '.join(diff)}); re-attaching would ignore yours",
                              remedy=f"run with the settings it has, give this job its own --output, or stop it "
                                     f"— {_stop_hint(ex)} — then run this command again to resume with yours")
        return JobPlan(input_path, out, "attach", f"re-attaching to the runner (pid {ex.runner_pid}) already "
                                                  f"generating into {out} on node {ex.node}")
    broken = (ex.store_job or {}).get("input_broken")
    if recorded_fp is not None and recorded_fp != input_fp() and broken:
        return JobPlan(input_path, out, "resume", f"resuming the job in {out} on node {ex.node} with a replacement "
                                                  f"for its broken input ({broken[:200]}); rows done are skipped")
    if recorded_fp is not None and recorded_fp != input_fp():
        raise JobConflict(f"output directory {out} on node {ex.node} holds results of a different input "
                          f"(sha256 {recorded_fp[:12]}…; {input_path} is {input_fp()[:12]}…)",
                          remedy="pass the input this directory was started with, or give this input its own "
                                 "--output (two inputs in one directory would break resume and the counts)")
    recorded_params = (ex.store_job or {}).get("params")
    if recorded_params is not None:
        diff = params_diff(recorded_params, job_params(cfg))
        if diff:
            raise JobConflict(f"output directory {out} on node {ex.node} was generated with other parameters "
                              f"({'; '.join(diff)})",
                              remedy="give this job its own --output, or set the parameters back (one directory "
                                     "holds one dataset: rows made with two settings would be mixed silently)")
    m = ex.manifest or {}
    finished = m.get("complete") and m.get("state") == "done" and not retry_errors and recorded_fp is not None
    if finished and covers(m, cfg.generation.limit):
        counts = m.get("counts") or {}
        done = {k: int(counts.get(k) or 0) for k in ("completed", "errors", "rejects")}
        n = sum(done.values())
        return JobPlan(input_path, out, "done",
                       f"nothing to do: {n:,} rows already done in {out} on node {ex.node} "
                       f"({done['completed']:,} completed, {done['errors']:,} errors, {done['rejects']:,} rejects)"
                       + ("; --retry-errors sends the errors again" if done["errors"] else ""), done=done)
    if finished:
        inp = m.get("input") or {}
        limit = cfg.generation.limit
        return JobPlan(input_path, out, "resume",
                       f"going on with the job in {out} on node {ex.node}: its first {inp.get('rows') or 0:,} rows "
                       f"are done (limit {_done_limit(m)}), this run asks for "
                       + ("every row" if limit is None else f"the first {limit:,}"))
    if ex.store_job is not None or m:
        return JobPlan(input_path, out, "resume", f"resuming the job in {out} on node {ex.node}")
    return JobPlan(input_path, out, "new", f"new job into {out} on node {ex.node}")


def _done_limit(manifest: dict[str, Any]) -> int | None:
    """The generation.limit the finished job ran with (its config, for a manifest from before `input.limit`)."""
    inp = manifest.get("input") or {}
    if "limit" in inp:
        return cast(int | None, inp["limit"])
    return cast(int | None, ((manifest.get("config") or {}).get("generation") or {}).get("limit"))


def covers(manifest: dict[str, Any], limit: int | None) -> bool:
    """Whether a finished job's rows are every row a call with `limit` (None: the whole input) asks for.

    A job finished under `--limit 100` covers a later `--limit 50`, not a `--limit 200` nor a call
    without one, unless its input ended before its limit."""
    done_limit = _done_limit(manifest)
    if done_limit is None:
        return True                     # it read the whole input
    inp = manifest.get("input") or {}
    rows, total = inp.get("rows"), inp.get("rows_in_input")
    if isinstance(rows, int) and isinstance(total, int):
        return rows >= (total if limit is None else min(total, limit))
    if isinstance(rows, int) and rows < done_limit:
        return True                     # the input ended before the limit: every row was read
    return limit is not None and limit <= done_limit


def plan_job(cfg: FleetConfig, *, input: str, output: str, retry_errors: bool = False, cwd: str | None = None,
             connect: Callable[[NodeConfig], Node] | None = None) -> JobPlan:
    """Every check of the module docstring, on every node of the config, before anything starts.

    Raises InputError (bad input or output location) or JobConflict; returns the plan."""
    from fleet.node import LocalNode
    from fleet.node import connect as default_connect

    from fleet.generation.data.objstore import is_url

    if is_url(output) or is_url(input):
        if cfg.endpoints:
            raise InputError("[[endpoints]] with an input or output on object storage is not supported yet (a store "
                             "job runs per chunk under the multi-node controller, which starts only fleet's servers)",
                             remedy="give the job a local --input and --output, or leave [[endpoints]] out of this config")
        return _plan_store_job(input, output, cwd)
    own_nodes = connect is None   # a caller's connect (the flow's cached nodes) keeps its nodes open
    connect = connect or default_connect
    local_in = _resolve(input, cwd)
    plans: list[JobPlan] = []
    inp: InputCheck | None = None
    if local_in.exists() or not posixpath.isabs(str(input)) or all(n.kind == "local" for n in cfg.nodes):
        inp = check_input(input, cfg.generation, cwd=cwd)
    for node_cfg in cfg.nodes:
        node = connect(node_cfg)
        try:
            out = output
            if isinstance(node, LocalNode):
                out = str(_resolve(output, cwd))
            node_inp = inp if inp is not None else _check_input_on_node(node, str(input))
            if node_inp.local:
                fp: Callable[[], str] = lambda: fingerprint(node_inp.path)  # noqa: E731
            else:
                fp = _memo(lambda: _fingerprint_on(node, node_inp.path))
            check_output(node, out)
            # an uploaded input has another path on an SSH node: only the SHA-256 compares there
            plans.append(decide(read_existing(node, node_cfg, cfg, out), cfg, input_fp=fp,
                                input_path=node_inp.path, retry_errors=retry_errors,
                                paths_comparable=isinstance(node, LocalNode) or not node_inp.local))
        finally:
            if own_nodes:
                node.close()
    # One job spans one node; the most advanced verdict tells the operator what will happen.
    order = {"attach": 0, "done": 1, "resume": 2, "new": 3}
    best = min(plans, key=lambda p: order[p.verdict])
    return JobPlan(best.input, best.output, best.verdict, best.message, inp is not None, best.done)


def _plan_store_job(input: str, output: str, cwd: str | None) -> JobPlan:
    """A job whose input or output is on object storage: the input is there, the output a URL (the nodes'
    runners put their commits there; a plain --output path would be on each node's own disk)."""
    from urllib.parse import urlsplit

    from fleet.generation.data.objstore import is_url, store_env

    for url in (input, output):
        if is_url(url) and (urlsplit(url).username or urlsplit(url).password):
            raise InputError("an object-storage URL with a user or password in it would be written to job.json, the "
                             "manifest and the flow run's parameters",
                             remedy="give the URL without credentials; put them in the environment (AWS_*, "
                                    "GOOGLE_APPLICATION_CREDENTIALS, HF_TOKEN) or FLEET_STORE_SECRET")
    store_env([input, output])   # what the runners will be given can be read (a credentials file): before bring-up
    if output.startswith("hf://"):
        raise InputError(f"--output {output}: hf:// is read-only for fleet (an input, not a job's output)",
                         remedy="give --output an s3:// or gs:// URL; upload the exported result to the Hub after")
    if not is_url(output):
        raise InputError(f"--input {input} is on object storage but --output {output} is a local path",
                         remedy="give --output an object-storage URL too (s3://bucket/prefix): every node writes there")
    if is_url(input):
        _check_store_input(input)
    else:
        input = str(_resolve(input, cwd))
        if not Path(input).is_file():
            raise InputError(f"input {input} is not a file", remedy="give --input a JSONL or Parquet file")
    done = _check_store_output(output, input)
    if done and json.loads(done).get("complete"):
        return JobPlan(input, output, "done", f"{output} already holds this job's finished output", True)
    return JobPlan(input, output, "new", f"{input} → {output} (object storage: nodes read and write it directly)",
                   not is_url(input))


def _check_store_input(url: str) -> None:
    """The input on the store exists and these credentials can read it: one line with its remedy (StoreError
    for credentials, permission, a missing bucket) before anything starts."""
    from fleet.generation.data.objstore import Store
    from fleet.generation.data.storeerrors import translated

    parent, _, name = url.rstrip("/").rpartition("/")
    with translated(url, "reading"):
        store = Store(parent)
        try:   # a ranged GET, not a HEAD: a refusal then says why (S3's error code is in the body)
            store.fs.cat_file(store._p(name), start=0, end=1)
        except FileNotFoundError as exc:
            if "bucket" in str(exc).lower():
                raise
            raise InputError(f"input {url} does not exist (or these credentials cannot read it)",
                             remedy="check the URL, and the credentials in this shell's environment (AWS_*, "
                                    "GOOGLE_APPLICATION_CREDENTIALS, HF_TOKEN)") from None
        except OSError as exc:   # an empty object has no first byte (416): it exists, the plan says it is empty
            if "InvalidRange" not in str(exc) and "416" not in str(exc) and \
                    "not satisfiable" not in str(exc).lower():
                raise


def _check_store_output(output: str, input: str) -> bytes | None:
    """The output URL can be written (a test object put and removed: a missing bucket, no permission, no
    credentials are found now), and a job already planned there was planned on this input's version (its
    plan's pin under `_control/`: InputChanged else). Returns its manifest, if any."""
    import uuid

    from fleet.generation.data.objstore import Store, is_url
    from fleet.generation.data.storeerrors import translated

    with translated(output, "reading"):
        store = Store(output)
        manifest = store.read_bytes("manifest.json")
        planned = store.read_bytes("_control/plan.json")
    probe = f"_fleet-write-test-{uuid.uuid4().hex[:12]}"
    with translated(output, "writing a test object under"):
        store.write_bytes(probe, b"fleet checks it can write here; removed at once\n")
        store.fs.rm(store._p(probe))
    if planned and is_url(input):
        from fleet.generation.data.pin import check

        try:
            plan = json.loads(planned)
        except ValueError:
            return manifest
        if str(plan.get("input", "")).rstrip("/") == input.rstrip("/"):
            with translated(input, "reading"):
                check(input, plan.get("input_id"))
    return manifest


def _memo(fn: Callable[[], str]) -> Callable[[], str]:
    box: list[str] = []

    def get() -> str:
        if not box:
            box.append(fn())
        return box[0]
    return get
