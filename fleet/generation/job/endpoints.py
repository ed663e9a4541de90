"""Servers fleet did not start (`[[endpoints]]` in the config) as the runner's server entries,
and their API keys as the runner's environment.

An endpoint joins the job like a launched server (the same admission, watchdog and
down/readmit cycle) but has no launch spec, so the runner never relaunches it: a down
endpoint is probed until it answers and is then re-admitted (`fleet.generation.job.relaunch`).

Its key is read where the flow runs (an environment variable, or a Secret block through the
process's credential store, `fleet.node.credentials`) and reaches the runner as `ENDPOINT_API_KEY_<i>` in the detached
process's 0600 environment file; job.json names only that variable.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from fleet.config import FleetConfig
from fleet.errors import ConfigError

__all__ = ["ENDPOINT_NODE", "endpoint_entries", "endpoint_keys", "key_env"]

ENDPOINT_NODE = "endpoint"   # the entries' node: their names read `endpoint/NAME`


def key_env(i: int) -> str:
    """The runner's environment variable for endpoint `i`'s key (not FLEET_*: not a config setting)."""
    return f"ENDPOINT_API_KEY_{i}"


def endpoint_entries(cfg: FleetConfig) -> list[dict[str, Any]]:
    """The runner's view of the config's endpoints (`fleet.generation.job.jobspec.ServerEntry` fields)."""
    out = []
    for i, ep in enumerate(cfg.endpoints):
        has_key = bool(ep.api_key_env or ep.api_key_secret)
        out.append({"node": ENDPOINT_NODE, "index": i, "label": f"{ENDPOINT_NODE}/{ep.name}", "url": ep.url,
                    "model": ep.model or "", "api_key_env": key_env(i) if has_key else "",
                    "max_in_flight": ep.max_in_flight, "engine": ep.engine, "gpus": []})
    return out


def endpoint_keys(cfg: FleetConfig, load_secret: Callable[[str], str] | None = None,
                  environ: dict[str, str] | None = None) -> dict[str, str]:
    """{runner variable: key} for every endpoint that names one; `load_secret(name)` reads a
    Secret block (default: the process's credential store, which the `fleet` command and the
    tasks install). Raises ConfigError naming the endpoint when its key is not there."""
    from fleet.node.credentials import current

    env = os.environ if environ is None else environ
    load_secret = load_secret or current().secret
    keys: dict[str, str] = {}
    for i, ep in enumerate(cfg.endpoints):
        if ep.api_key_env:
            value = env.get(ep.api_key_env, "")
            if not value.strip():
                raise ConfigError(f"endpoint {ep.name!r}: its key variable {ep.api_key_env} is not set where the "
                                  "flow runs", remedy=f"export {ep.api_key_env} before running fleet, or name a "
                                  "Secret block with api_key_secret")
            keys[key_env(i)] = value
        elif ep.api_key_secret:
            value = load_secret(ep.api_key_secret)
            if not value.strip():
                raise ConfigError(f"endpoint {ep.name!r}: Secret block {ep.api_key_secret!r} is empty",
                                  remedy="store the endpoint's API key in it")
            keys[key_env(i)] = value
    return keys
