"""Start, watch, re-attach to and fetch a generation job on a node (Prefect-free).

The runner (`fleet.generation.job.runner`) runs ON the node, detached like the servers, so
the job outlives the flow and the SSH connection. On an SSH node it runs from a small
venv of its own (`<workdir>/runner-venv`: pydantic, pydantic-settings, httpx, aiohttp,
pyarrow — no Prefect, no engine) and fleet's code shipped as one zip file
(`<workdir>/bin/fleet-runner.pyz`); on the local node it is this interpreter.

One job per output directory: a live runner (its pid file) is re-attached to, never
doubled, and the store's lock refuses a second writer even if someone tries by hand.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import logging
import os
import posixpath
import sys
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet.config import FleetConfig, NodeConfig
from fleet.engines import ServerSpec, get_profile
from fleet.errors import CommandFailed, FleetError, JobConflict
from fleet.generation.data.objstore import is_url, store_env, store_packages
from fleet.interrupt import check_stop
from fleet.jobs import EXIT_FILE, JOB_DIR_GLOB, job_dir
from fleet.node import LocalNode, Node

log = logging.getLogger(__name__)

RUNNER_PACKAGES = ["pydantic>=2.7", "pydantic-settings>=2.3", "httpx>=0.27", "aiohttp>=3.9", "pyarrow>=15"]
FLEET_ROOT = Path(__file__).resolve().parents[2]  # the fleet package directory


@dataclass
class JobHandle:
    node: str
    job_dir: str
    output: str
    pid: int
    attached: bool          # True: a runner was already running for this output; we watch it
    log: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@functools.lru_cache(maxsize=1)
def build_pyz() -> bytes:
    """fleet's source as a zip that `python fleet-runner.pyz --job …` runs (deterministic bytes). Built
    once per process (≈ 8 ms of CPU, at every chunk start of a multi-node controller before): the code a
    process ships is the code it runs."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(FLEET_ROOT.rglob("*.py")):
            info = zipfile.ZipInfo(str(path.relative_to(FLEET_ROOT.parent)), date_time=(2020, 1, 1, 0, 0, 0))
            zf.writestr(info, path.read_bytes())
        zf.writestr(zipfile.ZipInfo("__main__.py", date_time=(2020, 1, 1, 0, 0, 0)),
                    "import sys\nfrom fleet.generation.job.runner import main\nsys.exit(main())\n")
    return buf.getvalue()


def runner_command(node: Node, cfg: FleetConfig, node_cfg: NodeConfig, *, urls: Sequence[str] = ()) -> list[str]:
    """The argv prefix that runs the runner on this node, installing it there when needed (`urls`: the
    job's locations on object storage; the venv adds the fsspec package of each protocol they use, and
    only those: `store_packages`).

    What it proved stays known on the connection (`node`): the same venv request and the same zip are
    not checked and put again. A multi-node controller starts a chunk after chunk on one connection, and
    each start read the venv's stamp, timed its import and put the 1.3 MB zip again (the controller's
    CPU, the node's too). A new connection (a lost node's next attempt) checks afresh."""
    if isinstance(node, LocalNode):
        return [sys.executable, "-m", "fleet.generation.job.runner"]
    from fleet.venv import ensure_venv, request_hash, request_of

    runner_cfg = cfg.model_copy(deep=True)
    runner_cfg.venv.path = f"{node_cfg.workdir.rstrip('/')}/runner-venv"
    runner_cfg.venv.use_existing = False
    runner_cfg.engine.packages = list(RUNNER_PACKAGES) + store_packages(urls)
    pyz = f"{node_cfg.workdir.rstrip('/')}/bin/fleet-runner.pyz"
    data = build_pyz()
    key = (runner_cfg.venv.path, request_hash(request_of(runner_cfg, "pyarrow")), pyz, _digest(data))
    known: dict[tuple[str, ...], list[str]] = node.__dict__.setdefault("_runner_commands", {})
    if key in known:
        return list(known[key])
    venv = ensure_venv(node, runner_cfg, node_cfg, "pyarrow")
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".pyz") as tmp:
        tmp.write(data)
        tmp.flush()
        node.put(tmp.name, pyz)
    known[key] = [venv.python, pyz]
    return list(known[key])


@functools.lru_cache(maxsize=1)
def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def server_entries(cfg: FleetConfig, specs: list[ServerSpec], facts: dict[int, dict[str, Any]] | None = None
                   ) -> list[dict[str, Any]]:
    """The runner's view of the servers: URLs as the node sees them, the model id each expects."""
    profile = get_profile(cfg.engine.kind)
    out = []
    for spec in specs:
        host = spec.connect_host
        fields = {k: v for k, v in dataclasses.asdict(spec).items() if k != "api_key"}
        out.append({"node": spec.node, "index": spec.index, "url": f"http://{host}:{spec.port}",
                    "model": profile.request_model(spec), "gpus": list(spec.gpus),
                    "max_running_requests": (facts or {}).get(spec.index, {}).get("max_running_requests"),
                    "spec": fields})
    return out


def runner_secret_env(cfg: FleetConfig, endpoint_keys: dict[str, str] | None = None) -> dict[str, str]:
    """The secrets the runner needs, as environment: job.json holds them masked, and the runner
    relaunches servers with the real engine.env; `endpoint_keys` (`fleet.generation.job.endpoints.
    endpoint_keys`) are the [[endpoints]]' keys. Delivered through start_detached's 0600 env
    file, never argv."""
    key = cfg.api_key()
    env = {"FLEET_API_KEY": key} if key else {}
    if cfg.engine.env:
        env["FLEET_ENGINE_ENV"] = json.dumps(cfg.engine.env_values())
    env.update(endpoint_keys or {})
    return env


def start_job(node: Node, cfg: FleetConfig, node_cfg: NodeConfig, *, input_path: str, output: str,
              specs: list[ServerSpec], retry_errors: bool = False,
              facts: dict[int, dict[str, Any]] | None = None,
              endpoint_keys: dict[str, str] | None = None, store: str | None = None,
              seed: list[str] | None = None, input_span: list[int] | None = None,
              input_rows: list[int] | None = None, input_pin: dict[str, Any] | None = None,
              exclusive: bool = False) -> JobHandle:
    """Start the runner detached on the node, or re-attach to the one already running for `output`.

    Claim first, then write: two `fleet generate` into one directory at the same moment both
    found no runner and both wrote job.json and runner.pid before the runners' own lock told one
    it lost, so the winner's files could be the loser's. Now a start takes the job directory's
    start claim (`_claim_start`) before it writes anything; the one that finds it taken, or finds
    the winner's runner once it has it, is refused (JobConflict: exit 2) and touches nothing.

    Its servers: `specs` (launched by fleet) and the config's [[endpoints]] (their keys in
    `endpoint_keys`, see `fleet.generation.job.endpoints`). `input_path` may be an fsspec URL (the
    runner reads it from there); `store`: the URL the runner puts its committed output under,
    `seed`: earlier attempts' store URLs (fleet.generation.job.publish), `input_span`: the [start, end)
    bytes of `input_path` that are this job's input, `input_rows` the [first, end) rows of a Parquet
    `input_path` (ranges.py), `input_pin` the version of `input_path` the job was planned on (data/pin.py).
    The credentials of the URLs' protocols go to the runner in the
    environment (`store_env`: by name, a Google credentials file by content), never in job.json or argv.

    `exclusive`: the caller already holds the output's own lock (the multi-node controller's
    ControllerLock over its chunk directories), so no start claim is taken: a controller killed
    in the middle of a start leaves a claim that would refuse its successor for CLAIM_STALE_S."""
    from fleet.generation.job.endpoints import endpoint_entries
    from fleet.workdir import ensure_workdir

    ensure_workdir(node, node_cfg.workdir)
    jdir = job_dir(node_cfg, cfg, output)
    pid_path, log_path = f"{jdir}/runner.pid", f"{jdir}/runner.log"
    attached = _attach(node, cfg, node_cfg, jdir, output, input_path, retry_errors)
    if attached is not None:
        return attached
    urls = [u for u in (input_path, store, *(seed or [])) if u and is_url(u)]
    store_vars = store_env(urls)   # only what these URLs' protocols need (objstore.SCHEMES); refused before any install
    prefix = runner_command(node, cfg, node_cfg, urls=urls)
    token = None if exclusive else _claim_start(node, jdir)
    try:
        if token is not None:   # one that won meanwhile (under the caller's lock none can)
            attached = _attach(node, cfg, node_cfg, jdir, output, input_path, retry_errors)
            if attached is not None:
                return attached
        if not is_url(input_path) and not node.exists(input_path):
            raise CommandFailed(f"input {input_path} does not exist on node {node_cfg.name}", host=node.host,
                                remedy="give --input a path that exists (it is uploaded to SSH nodes when it is local)")
        job = {
            "config": cfg.model_dump(mode="json", exclude={"servers": {"api_key"}}),
            "input": input_path, "output": output,
            "servers": server_entries(cfg, specs, facts) + endpoint_entries(cfg),
            "retry_errors": retry_errors, "relaunch": True, "store": store, "seed": list(seed or []),
            "input_span": input_span, "input_rows": input_rows, "input_pin": input_pin,
        }
        # a previous run's last word (its exit file) is not this one's: removed with the write
        node.write_text(f"{jdir}/job.json", json.dumps(job, indent=2), remove=[f"{jdir}/{EXIT_FILE}"])
        env = runner_secret_env(cfg, endpoint_keys)
        env.update(store_vars)
        env["PYTHONUNBUFFERED"] = "1"
        det = node.start_detached([*prefix, "--job", f"{jdir}/job.json"], log_path=log_path, pid_path=pid_path,
                                  env=env, cwd=jdir)
        return JobHandle(node_cfg.name, jdir, output, det.pid, False, log_path)
    finally:
        try:
            if token is not None:
                node.run(["sh", "-c", _UNCLAIM, "fleet-unclaim", jdir, token], check=False, timeout=30)
        except FleetError as exc:   # a runner started is not undone by a lost connection; the claim goes stale
            log.warning("could not give back the start claim of %s (%s); it goes stale in %d s",
                        jdir, exc.one_line(), CLAIM_STALE_S)


def _attach(node: Node, cfg: FleetConfig, node_cfg: NodeConfig, jdir: str, output: str, input_path: str,
            retry_errors: bool) -> JobHandle | None:
    """The live runner's handle when it runs this very job; JobConflict when it runs another; None when none runs."""
    pid = node.read_pid(f"{jdir}/runner.pid", expect=f"--job {jdir}/job.json")
    if pid is None or not node.is_alive(pid):
        return None
    # Re-attach only to the same job (validate.plan_job compares the input's SHA-256 first).
    from fleet.generation.job.validate import ExistingJob, decide

    try:
        live = json.loads(node.read_text(f"{jdir}/job.json") or "{}")
    except ValueError:
        live = {}
    decide(ExistingJob(node_cfg.name, output, pid, live), cfg, input_fp=lambda: "", input_path=input_path,
           retry_errors=retry_errors)
    return JobHandle(node_cfg.name, jdir, output, pid, True, f"{jdir}/runner.log")


# A start claim older than this was left by a start that died mid-way (a start takes seconds:
# two small writes and a detached launch that waits PID_FILE_TIMEOUT_S at most).
CLAIM_STALE_S = 120

# sh -c CLAIM fleet-claim JOBDIR TOKEN STALE_S: take JOBDIR/start.claim for one start. Prints
# "claimed", or "held AGE WHO" when another start holds it. The look and the write happen under
# flock (bounded by -w), so of starts at the same moment exactly one finds it free.
_CLAIM = r"""
mkdir -p -- "$1" || exit 95
exec 9>>"$1/start.claim.lock" || exit 95
flock -w 20 9 || { echo "held ? (its lock stayed taken)"; exit 0; }
f="$1/start.claim"
if [ -s "$f" ]; then
  age=$(( $(date +%s) - $(stat -c %Y -- "$f") ))
  if [ "$age" -le "$3" ]; then printf 'held %s %s\n' "$age" "$(head -c 300 -- "$f")"; exit 0; fi
fi
printf '%s\n' "$2" > "$f.tmp" && mv -f -- "$f.tmp" "$f" && echo claimed
"""

# sh -c UNCLAIM fleet-unclaim JOBDIR TOKEN: give the claim back, only if it is still this start's.
_UNCLAIM = r"""
exec 9>>"$1/start.claim.lock" || exit 0
flock -w 20 9 || exit 0
[ "$(head -n 1 -- "$1/start.claim" 2>/dev/null)" = "$2" ] && rm -f -- "$1/start.claim"
exit 0
"""


def _claim_start(node: Node, jdir: str) -> str:
    """Take the job directory's start claim; its token. JobConflict (exit 2) when another start holds it."""
    import socket
    import uuid

    token = f"{socket.gethostname()} pid {os.getpid()} {uuid.uuid4().hex[:12]}"
    res = node.run(["sh", "-c", _CLAIM, "fleet-claim", jdir, token, str(CLAIM_STALE_S)], timeout=60)
    said = res.stdout.strip()
    if said == "claimed":
        return token
    age, _, who = said.removeprefix("held ").partition(" ")
    raise JobConflict(f"another `fleet generate` is starting a job in {jdir} right now ({who or '?'}, {age} s ago)",
                      host=node.host,
                      remedy="wait for it: the same command then re-attaches to its runner, or is refused if its "
                             "job differs; two runners writing one directory would duplicate rows. To run a second "
                             "job, give it its own --output.")


def read_progress(node: Node, output: str) -> dict[str, Any] | None:
    return _progress(node.read_text(f"{output.rstrip('/')}/progress.json"))


def look_at_runner(node: Node, output: str, pid: int) -> tuple[dict[str, Any] | None, bool]:
    """The runner's progress and whether its process lives, in one round trip (`Node.watch`: a
    multi-node controller asks this of every running chunk every second; two commands each were
    most of its CPU on a real SSH seam, bench/RESULTS.md)."""
    state, text = node.watch(pid, f"{output.rstrip('/')}/progress.json", 0)
    return _progress(text), state != "dead"


def _progress(text: str | None) -> dict[str, Any] | None:
    try:
        return json.loads(text) if text else None
    except json.JSONDecodeError:
        return None  # written atomically, so only a file from something else


def watch_job(node: Node, handle: JobHandle, *, poll_s: float = 5.0,
              on_progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Follow progress.json until the runner exits; return the last progress (with the exit state)."""
    last: dict[str, Any] = {}
    while True:
        # A cancelled run stops following; the runner is detached and goes on with its job.
        check_stop(f"following the runner (pid {handle.pid})")
        prog = read_progress(node, handle.output)
        if prog:
            last = prog
            if on_progress:
                on_progress(prog)
        if not node.is_alive(handle.pid):
            prog = read_progress(node, handle.output) or last
            if prog and prog.get("pid") not in (None, handle.pid):
                prog = {}   # another run's progress (this runner died before writing its own)
            if on_progress and prog:
                on_progress(prog)
            prog = dict(prog or {})
            prog["runner_exited"] = True
            prog["log_tail"] = node.read_text(handle.log, tail_bytes=4000)
            prog["exit"] = read_exit(node, handle)
            return prog
        time.sleep(poll_s)


# sh -c JOBS fleet-jobs WORKDIR FLEET: every job.json of the fleet, each after "@@<mtime> <path>".
_JOBS = r"""
for f in "$1"/jobs/""" + JOB_DIR_GLOB + r"""/job.json; do
  [ -f "$f" ] || continue
  printf '@@%s %s\n' "$(stat -c %Y -- "$f")" "$f"; cat -- "$f"; echo
done
"""


def job_outputs(node: Node, cfg: FleetConfig, node_cfg: NodeConfig) -> list[str]:
    """The output directory of every job of this fleet on the node, newest job first."""
    from fleet.preflight import split_sections
    from fleet.workdir import ensure_workdir

    if not ensure_workdir(node, node_cfg.workdir, create=False):
        return []
    res = node.run(["sh", "-c", _JOBS, "fleet-jobs", node_cfg.workdir.rstrip("/"), cfg.name], check=False,
                   timeout=60)
    found: list[tuple[int, str]] = []
    for head, body in split_sections(res.stdout).items():
        try:
            found.append((int(head.split(" ", 1)[0]), str(json.loads(body)["output"])))
        except (ValueError, KeyError, TypeError):
            continue
    return [out for _, out in sorted(found, key=lambda t: -t[0])]


def check_fetch_path(remote: str, outputs: list[str], node: str) -> str:
    """`remote` normalised, when it is a job's output directory or inside one; else ConfigError.

    `fleet fetch --remote` reaches `find` on the node: `--remote=-delete` once became
    `find -delete` and wiped the remote user's current directory. Only an absolute path
    inside a job's output is accepted, so nothing else can ever be read or named."""
    from fleet.config import no_control
    from fleet.errors import ConfigError

    try:
        no_control(remote, "--remote")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not remote.startswith("/"):
        raise ConfigError(f"--remote {remote!r} is not an absolute path",
                          remedy="give the job's output directory on the node, e.g. /data/out, or leave "
                                 "--remote out to fetch the newest job's output")
    norm = posixpath.normpath(remote)
    for out in outputs:
        o = posixpath.normpath(out)
        if norm == o or norm.startswith(o.rstrip("/") + "/"):
            return norm
    known = ", ".join(outputs[:5]) or "none"
    raise ConfigError(f"--remote {remote!r} is not inside the output of any job of this fleet on node {node} "
                      f"(job outputs: {known})",
                      remedy="give a job's output directory or a path inside it, or leave --remote out")


def read_exit(node: Node, handle: JobHandle) -> dict[str, Any] | None:
    """The runner's exit.json (rc, state, failure: kind/cause/remedy/file), if this runner wrote one."""
    try:
        data = json.loads(node.read_text(f"{handle.job_dir}/{EXIT_FILE}") or "null")
    except ValueError:
        return None
    return data if isinstance(data, dict) and data.get("pid") == handle.pid else None


def outcome(final: dict[str, Any], handle: JobHandle) -> tuple[bool, str, str]:
    """(ok, cause, remedy) of a watched job that ended: what the CLI prints when it failed."""
    ex = final.get("exit") or {}
    failure = ex.get("failure") or final.get("error")
    if failure:
        return False, failure["cause"], failure["remedy"]
    state = final.get("state")
    if state == "done" and ex.get("rc", 0) == 0:
        return True, "done", ""
    if state == "stopped" and ex.get("rc") == 0:
        return False, f"the job was stopped ({final.get('reason') or 'by a signal'}) before every row ended", \
            "run the same command again to resume"
    if state == "failed":
        return False, str(final.get("reason") or final.get("detail") or "the job failed"), \
            f"read {handle.log} on node {handle.node}; run the same command again to resume"
    last = [ln for ln in (final.get("log_tail") or "").splitlines() if ln.strip()]
    return False, (f"the runner (pid {handle.pid}) on node {handle.node} died without a final state"
                   + (f" (exit code {ex['rc']})" if ex.get("rc") is not None else
                      " (killed: SIGKILL, the out-of-memory killer, or a reboot?)")
                   + (f"; its log ends: {last[-1][:300]}" if last else "")), \
        f"read {handle.log} on node {handle.node}; run the same command again to resume (committed rows are kept)"


def fetch(node: Node, remote_output: str, local_dir: str | Path) -> list[str]:
    """Copy a job's output (shards, errors, rejects, manifest, progress) from the node."""
    remote_output = remote_output.rstrip("/")
    if not remote_output.startswith("/"):
        # find takes a leading '-' as an expression ("-delete"); an absolute path never is one.
        from fleet.errors import ConfigError

        raise ConfigError(f"remote output {remote_output!r} is not an absolute path",
                          remedy="give the output directory as an absolute path on the node")
    res = node.run(["find", remote_output, "-type", "f", "!", "-name", "*.tmp", "!", "-name", ".lock"], timeout=120)
    copied = []
    for path in sorted(ln for ln in res.stdout.splitlines() if ln.strip()):
        rel = posixpath.relpath(path, remote_output)
        dest = Path(local_dir) / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        node.get(path, dest)
        copied.append(rel)
    return copied
