"""The generation jobs on a node, as the core knows them: where a job lives (its directory, the
runner's exit file, the shell function that reads a live pid), which jobs are alive there and
which servers they use (`live_jobs`), and what a live job's progress says of one of them
(`job_proof`).

Both sides ask these: bring-up (`fleet.servers` will not replace a server a live job uses; its
smoke takes a live job's recent progress through a server as proof that it serves) and
generation (the runner, `remote` which starts it, `validate` which checks before). Nothing here
imports either side."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

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
    stop_grace_s: float = 60.0        # how long the runner lets in-flight rows finish after SIGTERM

    def uses(self, node: str, index: int, port: int) -> bool:
        """Its entry for fleet's server `index` on `node` (not an [[endpoints]] entry) is on `port`."""
        for s in self.servers:
            if s.get("label") or s.get("index") != index or s.get("node") not in (None, node):
                continue
            try:
                return urlsplit(str(s.get("url") or "")).port == port
            except ValueError:
                return False
        return False

    def stop_hint(self) -> str:
        return (f"stop it with `kill -TERM {self.pid}` on node {self.node} (a clean stop: in-flight rows finish, "
                "the manifest is written; the same `fleet generate` command resumes it), or wait for it to finish")



# "$2"-<10 hex>: exactly this fleet's directories (job_dir). "$2"-* matched another fleet's too when
# its name begins with this one's and a dash ("gen" and "gen-b"), and teardown stopped its runner.
JOB_DIR_GLOB = '"$2"-' + "[0-9a-f]" * 10

_LIVE_JOBS = LIVE_PID_SH + r'''
for d in "$1"/jobs/''' + JOB_DIR_GLOB + r'''; do
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
            grace = spec.get("stop_grace_s")
            jobs.append(LiveJob(node.name, int(pid), jdir, str(spec.get("output") or "?"),
                                list(spec.get("servers") or []),
                                float(grace) if isinstance(grace, int | float) else 60.0))
    return jobs


@dataclass(frozen=True)
class JobProof:
    """What a live job's progress says of one server it uses: proof that the server serves
    (`proven`: the job saw it generate `seen_s` ago, within the window), or why it is no proof."""

    runner_pid: int
    output: str
    seen_s: float | None            # seconds since the job last saw it generate, progress.json's age included
    completion_tokens: int | None   # what the job has had from it in this runner's life
    answers: int | None
    why_not: str | None = None      # None: proven

    @property
    def proven(self) -> bool:
        return self.why_not is None

    def describe(self) -> str:
        who = f"the live job writing {self.output} (runner pid {self.runner_pid})"
        if self.proven:
            return (f"{who} saw it generate {self.seen_s:.1f} s ago ({self.completion_tokens or 0:,} tokens, "
                    f"{self.answers or 0:,} rows from it so far)")
        return f"{who} uses it, but {self.why_not}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"proven": self.proven}


def judge_proof(job: LiveJob, name: str, progress_text: str, node_now: float, window_s: float) -> JobProof:
    """Does the job's progress.json (read at `node_now`, the node's clock) prove that server `name`
    ("node/index") serves? Only if it is this runner's, the runner has the server up and not under
    stall suspicion, and it saw the server generate within `window_s`."""
    def no(why: str, seen: float | None = None, tokens: int | None = None, answers: int | None = None) -> JobProof:
        return JobProof(job.pid, job.output, seen, tokens, answers, why)

    try:
        p = json.loads(progress_text) if progress_text.strip() else None
    except ValueError:
        p = None
    if not isinstance(p, dict):
        return no("its progress file is missing or unreadable")
    if p.get("pid") != job.pid:
        return no(f"its progress file is another runner's (pid {p.get('pid')})")
    srv = next((s for s in p.get("servers") or [] if isinstance(s, dict) and s.get("name") == name), None)
    if srv is None:
        return no("its progress does not list the server yet")
    tokens, answers = srv.get("completion_tokens"), srv.get("requests")
    if srv.get("state") != "up":
        return no(f"the job has it {srv.get('state')} ({srv.get('down_reason') or 'no reason given'})",
                  tokens=tokens, answers=answers)
    if srv.get("suspect"):
        return no("the job suspects it of a stall (its generation probe is deciding)", tokens=tokens, answers=answers)
    served = srv.get("served_s")
    if not isinstance(served, int | float):
        return no("the job has not seen it generate yet", tokens=tokens, answers=answers)
    seen = round(max(0.0, node_now - float(p.get("updated_at") or 0.0)) + float(served), 1)
    if seen > window_s:
        return no(f"it last saw it generate {seen:.0f} s ago (more than smoke.job_proof_s = {window_s:g} s)",
                  seen, tokens, answers)
    return JobProof(job.pid, job.output, seen, tokens, answers)


_PROGRESS = 'date +%s; cat -- "$1" 2>/dev/null; exit 0'


def job_proof(node: Node, workdir: str, fleet: str, server_node: str, index: int, port: int,
              window_s: float) -> JobProof | None:
    """What the live job of this fleet that uses server `index` of `server_node` (on `port`) says of
    it (see `judge_proof`); None when no live job uses it. One round trip, two when a job does."""
    job = next((j for j in live_jobs(node, workdir, fleet) if j.uses(server_node, index, port)), None)
    if job is None:
        return None
    out = node.run(["sh", "-c", _PROGRESS, "fleet-progress", f"{job.output.rstrip('/')}/progress.json"],
                   timeout=30).stdout
    now, _, text = out.partition("\n")
    try:
        node_now = float(now)
    except ValueError:
        return JobProof(job.pid, job.output, None, None, None, f"the node's clock could not be read ({now[:80]!r})")
    return judge_proof(job, f"{server_node}/{index}", text, node_now, window_s)
