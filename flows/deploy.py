"""`fleet deploy -c FILE`: one fleet's config into Prefect, and its four deployments, in one command.

    fleet deploy -c deployments/configs/ssh-sglang.toml [--pool fleet-pool] [--revalidate-every 1800]

1. validates the TOML and saves it as the block `fleet-config/<fleet name>` (blocks/config.py),
   replacing an earlier version;
2. creates the process work pool if it does not exist;
3. registers `fleet/bringup-<name>`, `fleet/revalidate-<name>` (on a schedule, one run at a
   time), `fleet/generate-<name>` and `fleet/teardown-<name>`, each with
   `config = "block:fleet-config/<name>"`: every run, scheduled ones included, acts on the
   fleet that bring-up brought up, and the runs are named `<action>-<name>`.

Re-running it after editing the TOML updates the block and the deployments (idempotent).
A process worker (`prefect worker start --pool fleet-pool`) started from this repository's
venv runs them, in this directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet.config import FleetConfig

ROOT = Path(__file__).resolve().parents[1]
ACTIONS = ("bringup", "revalidate", "generate", "teardown")
JOB_ENV = {"PREFECT_LOGGING_EXTRA_LOGGERS": "fleet", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


@dataclass
class Deployed:
    """What `fleet deploy` registered."""

    fleet: str
    block: str                        # fleet-config/<name>
    deployments: list[str] = field(default_factory=list)   # fleet/<action>-<name>
    pool: str = "fleet-pool"
    pool_created: bool = False


def block_ref(cfg: FleetConfig) -> str:
    return f"block:fleet-config/{cfg.name}"


def save_config_block(cfg: FleetConfig, source: str | None = None) -> str:
    """Save (or replace) the fleet's config block; its `<type-slug>/<name>`."""
    from blocks.config import FleetConfigBlock

    FleetConfigBlock.of(cfg, source).save(cfg.name, overwrite=True)
    return f"fleet-config/{cfg.name}"


def ensure_pool(name: str) -> bool:
    """Create a process work pool `name` unless one exists; True when created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
            return False
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))
            return True


def build(cfg: FleetConfig, *, pool: str | None, revalidate_every_s: float | None) -> list[Any]:
    """The fleet's four RunnerDeployments (exposed for tests); the same shape as deployments/prefect.yaml."""
    from flows.serve import DEPLOYMENTS, runner_deployment

    return [runner_deployment(f"{action}-{cfg.name}", block_ref(cfg), DEPLOYMENTS[action][0],
                              revalidate_every_s=revalidate_every_s if action == "revalidate" else None,
                              tags=["fleet", f"fleet:{cfg.name}"], work_pool_name=pool,
                              job_variables={"env": dict(JOB_ENV)} if pool else None)
            for action in ACTIONS]


def deploy(cfg: FleetConfig, *, source: str | None = None, pool: str = "fleet-pool",
           revalidate_every_s: float | None = 1800) -> Deployed:
    """Save the config block, make sure the pool exists, register the four deployments."""
    out = Deployed(cfg.name, save_config_block(cfg, source), pool=pool)
    out.pool_created = ensure_pool(pool)
    for d in build(cfg, pool=pool, revalidate_every_s=revalidate_every_s):
        d.apply()
        out.deployments.append(f"fleet/{d.name}")
    return out
