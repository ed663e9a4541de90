"""JOB.json: what one runner is asked to do (`JobSpec`, its servers `ServerEntry`), and the job's
config with its secrets put back from the environment (`fleet_config`). The format is drawn in
`fleet.generation.job.runner`'s docstring."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fleet.config import FleetConfig

__all__ = ["JobSpec", "ServerEntry", "fleet_config"]


@dataclass
class ServerEntry:
    """One server of the job, as JOB.json lists it."""

    node: str
    index: int
    url: str                                   # base URL as seen from the runner (on the node)
    model: str                                 # the "model" requests carry (engines.get_profile(kind).request_model(spec))
    api_key_env: str = "FLEET_API_KEY"         # environment variable that holds the API key
    gpus: list[int] = field(default_factory=list)
    max_running_requests: int | None = None    # from the launch log, when /server_info does not say
    spec: dict[str, Any] | None = None         # ServerSpec fields except api_key: enables relaunch
    label: str | None = None                   # its name when not node/index (an endpoint: "endpoint/NAME")
    max_in_flight: int | None = None           # an endpoint's own concurrency (config endpoints[].max_in_flight)
    engine: str | None = None                  # an endpoint's engine, for its progress signal (None: the config's)

    @property
    def name(self) -> str:
        return self.label or f"{self.node}/{self.index}"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ServerEntry:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


@dataclass
class JobSpec:
    config: dict[str, Any]
    input: str
    output: str
    servers: list[ServerEntry]
    retry_errors: bool = False
    relaunch: bool = True
    flush_interval_s: float | None = None   # seconds between commits; None: generation.commit_every_s
    progress_interval_s: float = 2.0
    console_interval_s: float = 5.0
    stop_grace_s: float = 60.0
    dispatch: dict[str, Any] = field(default_factory=dict)   # Dispatcher keyword options (backoff_s, down_after, ...)
    store: str | None = None     # object-storage URL the committed output is put under (fleet.generation.job.publish)
    seed: list[str] = field(default_factory=list)   # store URLs of earlier attempts whose shards a fresh run starts from
    input_span: list[int] | None = None   # [start, end) bytes of `input` (a URL) that are this job's rows
    input_rows: list[int] | None = None   # [first, end) rows (0-based) of `input` (a Parquet URL) that are this job's
    input_pin: dict[str, Any] | None = None   # the version of `input` (a URL) the job was planned on (data/pin.py)

    @classmethod
    def load(cls, path: str | Path) -> JobSpec:
        d = json.loads(Path(path).read_text())
        d["servers"] = [ServerEntry.from_dict(s) for s in d.get("servers") or []]
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def fleet_config(data: dict[str, Any]) -> FleetConfig:
    """The job's config, with the API key put back from the environment (never from the file)."""
    data = json.loads(json.dumps(data))
    servers = data.setdefault("servers", {})
    servers.pop("api_key", None)
    key = os.environ.get("FLEET_API_KEY")
    if key:
        servers["api_key"] = key
    # engine.env values arrive masked in the file; the real ones come from the environment
    # (fleet.generation.job.remote.runner_secret_env), so a relaunch gets the real HF_TOKEN & co.
    env_json = os.environ.get("FLEET_ENGINE_ENV")
    if env_json:
        data.setdefault("engine", {})["env"] = json.loads(env_json)
    return FleetConfig(**data)
