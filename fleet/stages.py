"""What each bring-up stage hands on: typed results, read by attribute, written as artifacts.

The Prefect tasks (tasks/bringup.py) return these and the flow (flows/fleet.py) reads their
attributes; `as_dict()` is the JSON the stage's artifact shows. Each wraps the core's own
result (`NodeReport`, `StageResult`, `LaunchResult` + `ReadyResult`, `SmokeResult`) with what
the stage adds to it; a venv needs nothing added (`VenvResult`). `adopted` says the stage found
its work already done.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

from fleet.config import NodeConfig
from fleet.jobs import JobProof
from fleet.preflight import NodeReport
from fleet.servers import LaunchResult, ReadyResult
from fleet.smoke import SmokeResult
from fleet.staging import StageResult


class StageOutcome(Protocol):
    """What a stage's artifact is written from."""

    @property
    def adopted(self) -> bool: ...

    def as_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Provisioned:
    """A node that passed preflight, and the GPUs the fleet may use on it."""

    report: NodeReport
    gpu_ids: list[int]
    venv_network_fs: bool  # the venv path is on a network filesystem: build it elsewhere

    @classmethod
    def of(cls, report: NodeReport, node_cfg: NodeConfig) -> Provisioned:
        venv = report.path("venv")
        return cls(report, [g.index for g in report.gpus if node_cfg.gpus is None or g.index in node_cfg.gpus],
                   bool(venv and venv.network))

    @property
    def adopted(self) -> bool:
        return False

    def as_dict(self) -> dict[str, Any]:
        return self.report.as_dict() | {"gpu_ids": self.gpu_ids, "venv_network_fs": self.venv_network_fs}


@dataclass(frozen=True)
class ModelPlace:
    """Where the servers read the model: the RAM-disk copy, or its source when staging is off."""

    model_path: str
    staged: StageResult | None = None  # None: served from its source, nothing copied

    @property
    def adopted(self) -> bool:
        return self.staged.adopted if self.staged else True

    def as_dict(self) -> dict[str, Any]:
        if self.staged is None:
            return {"model_path": self.model_path, "staged": False, "adopted": True}
        return asdict(self.staged) | {"model_path": self.model_path, "staged": True}


@dataclass(frozen=True)
class Launched:
    """A server started (or adopted) and ready."""

    launch: LaunchResult
    ready: ReadyResult

    @property
    def adopted(self) -> bool:
        return self.launch.adopted

    @property
    def pid(self) -> int:
        return self.launch.pid

    @property
    def url(self) -> str:
        return self.ready.url

    @property
    def ready_s(self) -> float:
        return round(self.ready.seconds, 3)

    @property
    def facts(self) -> dict[str, float | int | str]:
        return self.ready.verdict.facts

    def fact_int(self, name: str) -> int | None:
        """A number the log printed (kv_cache_tokens, max_running_requests), None when it did not."""
        value = self.facts.get(name)
        return int(value) if isinstance(value, int | float) else None

    def as_dict(self) -> dict[str, Any]:
        return self.launch.as_dict() | {"url": self.url, "ready_s": self.ready_s, "facts": self.facts,
                                        "warnings": self.ready.verdict.warnings}


@dataclass(frozen=True)
class Smoked:
    """A server proven to serve, and what it says of itself: it answered its smoke request
    (`smoke`), or a live generation job saw it generate moments ago (`job` proven, no request
    sent: the smoke would wait for a slot behind the job's rows). `job` is also kept when the
    job's progress was no proof (why not, then) and the server was smoked."""

    smoke: SmokeResult | None
    max_running_requests: int | None = None  # from /server_info, else from its log
    server_info: dict[str, Any] = field(default_factory=dict)
    job: JobProof | None = None

    @property
    def adopted(self) -> bool:
        return False

    @property
    def latency_s(self) -> float | None:
        return self.smoke.latency_s if self.smoke else None

    @property
    def proof(self) -> str:
        """The summary table's word for it: "smoke", or how long ago the live job saw it generate."""
        if self.smoke is None and self.job is not None:
            return f"live job: generated {self.job.seen_s:.1f} s ago"
        return "smoke"

    def as_dict(self) -> dict[str, Any]:
        d = self.smoke.as_dict() if self.smoke else {"ok": True, "request_sent": False}
        return d | {"proof": self.proof, "max_running_requests": self.max_running_requests,
                    "server_info": self.server_info} | ({"job": self.job.as_dict()} if self.job else {})


@dataclass(frozen=True)
class TeardownRow:
    """One row of the teardown table: a server stopped, or a node's RAM-disk copy freed (or kept)."""

    node: str
    what: str  # "server <i>", "runner writing <output>" or "ramdisk <path>"
    action: str  # stopped | killed | already gone | none | freed | kept: … | error: …
    port: int | None = None
    pid: int | None = None
    seconds: float | None = None
    bytes: int | None = None
    index: int | None = None  # the server's index (None for the RAM disk)

    @classmethod
    def of_server(cls, stopped: dict[str, Any]) -> TeardownRow:
        """From one entry of `fleet.servers.stop_servers`."""
        index = stopped.get("index")
        return cls(str(stopped["node"]), f"server {index}", str(stopped["action"]), port=stopped.get("port"),
                   pid=stopped.get("pid"), seconds=stopped.get("seconds"),
                   index=int(index) if index is not None else None)

    @classmethod
    def of_job(cls, stopped: dict[str, Any]) -> TeardownRow:
        """From one entry of `fleet.servers.stop_jobs`: a generation runner stopped before its servers."""
        return cls(str(stopped["node"]), f"runner writing {stopped.get('output')}", str(stopped["action"]),
                   pid=stopped.get("pid"), seconds=stopped.get("seconds"))

    @classmethod
    def of_ramdisk(cls, node: str, freed: dict[str, Any]) -> TeardownRow:
        """From `fleet.staging.free_ramdisk`'s answer."""
        return cls(node, f"ramdisk {freed.get('path') or ''}".strip(), str(freed.get("action")),
                   seconds=freed.get("seconds"), bytes=freed.get("bytes"))

    @property
    def is_server(self) -> bool:
        return self.index is not None or self.what.startswith("server")

    @property
    def failed(self) -> bool:
        return self.action.startswith("error")

    @property
    def stopped(self) -> bool:
        return self.action in ("stopped", "killed")

    def as_dict(self) -> dict[str, Any]:
        """The teardown table's columns, in their order."""
        return {"node": self.node, "what": self.what, "port": self.port, "pid": self.pid, "action": self.action,
                "seconds": self.seconds, "bytes": self.bytes}


@dataclass(frozen=True)
class Generated:
    """A generation job on one node as its watch ended: the runner's final counts and the manifest's sections."""

    node: str
    output: str
    job_dir: str
    pid: int
    attached: bool  # re-attached to a runner already running (an earlier run of the flow started it)
    state: str | None
    detail: str | None
    rows_total: int | None
    completed: int | None
    errors: int | None
    rejects: int | None
    quality_rejects: int | None
    this_run: dict[str, Any]  # counts of this run alone (fed, completed, errors)
    throughput: Any
    cost: Any
    checks: Any
    quality: Any
    seconds: float
    error: dict[str, str | None] | None = None  # {"cause", "remedy"} when the job failed

    @property
    def adopted(self) -> bool:
        return self.attached

    def message(self) -> str:
        """What a finished run says: rows generated by this run, never the directory's total as if it were."""
        run = self.this_run
        if not run.get("fed") and not self.attached:
            # the runner read every row this run asks for (its limit) and found each one ended
            done = (self.completed or 0) + (self.errors or 0) + (self.rejects or 0)
            return (f"nothing to do: {done:,} rows already done in {self.output} ({self.completed or 0:,} completed, "
                    f"{self.errors or 0:,} errors, {self.rejects or 0:,} rejects)"
                    + ("; --retry-errors sends the errors again" if self.errors else ""))
        return (f"generated {run.get('completed', 0):,} row(s) in this run ({run.get('errors', 0):,} error(s)); "
                f"{self.completed or 0:,} completed, {self.errors or 0:,} error(s), "
                f"{self.rejects or 0:,} reject(s) in {self.output}")

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.error is None:
            del d["error"]
        return d


def is_up(state: str | None) -> bool:
    """A summary row's state for a server that serves: started, adopted, or started in place of the
    slot's old server ("replaced (port 35600 → 35601)")."""
    return state in ("up", "adopted") or (state or "").startswith("replaced")


@dataclass
class ServerRow:
    """One row of the summary table: a server, or (server "-") a node that failed before its servers."""

    node: str
    server: int | str
    # state and error come first after the server: Prefect's UI shows a table's first columns
    # without scrolling, so a failed server's cause is read at a glance (issue 21, item 5)
    state: str | None = None
    error: str | None = None
    gpus: list[int] | None = None
    port: int | None = None
    pid: int | None = None
    ready_s: float | None = None
    smoke_latency_s: float | None = None
    proof: str | None = None   # "smoke", or the live job's progress through it (no smoke request sent)
    kv_cache_tokens: int | None = None
    max_running_requests: int | None = None
    flag: str | None = None

    @property
    def up(self) -> bool:
        return is_up(self.state)

    @property
    def label(self) -> str:
        return f"{self.node}/{self.server}"

    def sort_key(self) -> tuple[str, int]:
        return self.node, self.server if isinstance(self.server, int) else -1

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


SUMMARY_COLUMNS = [f.name for f in fields(ServerRow)]
