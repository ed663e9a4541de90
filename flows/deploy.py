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

It says when the schedule's first revalidation is (Prefect's interval schedules start one interval
after the deploy: a person who was told nothing waited 30 minutes for the first); with
`--revalidate-now` that first revalidation is a run created at once, for the pool's worker.

Where the flow's code is: a process worker runs each flow run in a fresh temporary
directory, so a deployment with Prefect's default `path: '.'` and no pull step crashes
there (FileNotFoundError flows/fleet.py), and an entrypoint taken relative to the directory
`fleet deploy` ran in points nowhere from the worker's. So each deployment gets the pull step
`set_working_directory` to the checkout this `fleet` package is installed from (CHECKOUT, the
directory holding flows/fleet.py; never the CWD) and the entrypoint `flows/fleet.py:fleet`
relative to it: the same shape as deployments/prefect.yaml, on any process pool (one this
command created or one made with defaults), whatever directory either command ran in. A
process worker started from this checkout's venv runs them (`prefect worker start --pool
fleet-pool`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from fleet.config import FleetConfig

# The checkout (or site-packages) that `flows` is imported from: what the worker must run.
CHECKOUT = Path(__file__).resolve().parents[1]
ENTRYPOINT = "flows/fleet.py:fleet"
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
    checkout: str = str(CHECKOUT)     # the directory each run's working directory is set to
    revalidate_every_s: float | None = None   # the revalidate schedule's interval; None: no schedule
    first_scheduled: datetime | None = None   # when the schedule's first revalidation runs
    revalidate_run: str | None = None         # the run created at once (--revalidate-now)


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
    """The fleet's four RunnerDeployments (exposed for tests); the same shape as deployments/prefect.yaml:
    entrypoint flows/fleet.py:fleet, pulled by setting the working directory to CHECKOUT."""
    from prefect.runner.storage import LocalStorage

    from flows.serve import DEPLOYMENTS, runner_deployment

    out = []
    for action in ACTIONS:
        d = runner_deployment(f"{action}-{cfg.name}", block_ref(cfg), DEPLOYMENTS[action][0],
                              revalidate_every_s=revalidate_every_s if action == "revalidate" else None,
                              tags=["fleet", f"fleet:{cfg.name}"], work_pool_name=pool,
                              job_variables={"env": dict(JOB_ENV)} if pool else None)
        # to_deployment took the entrypoint relative to the CWD and left path '.', no pull step
        d.entrypoint = ENTRYPOINT
        d.storage = LocalStorage(str(CHECKOUT))
        out.append(d)
    return out


def deploy(cfg: FleetConfig, *, source: str | None = None, pool: str = "fleet-pool",
           revalidate_every_s: float | None = 1800, revalidate_now: bool = False) -> Deployed:
    """Save the config block, make sure the pool exists, register the four deployments; with
    `revalidate_now`, start a revalidation at once (the schedule's first comes an interval later)."""
    out = Deployed(cfg.name, save_config_block(cfg, source), pool=pool, revalidate_every_s=revalidate_every_s or None)
    out.pool_created = ensure_pool(pool)
    for d in build(cfg, pool=pool, revalidate_every_s=revalidate_every_s):
        dep_id = d.apply()
        out.deployments.append(f"fleet/{d.name}")
        if d.name.startswith("revalidate-") and out.revalidate_every_s:
            out.first_scheduled = _first_scheduled(dep_id)
    if revalidate_now:
        from prefect.deployments import run_deployment

        fr = run_deployment(f"fleet/revalidate-{cfg.name}", timeout=0)  # created, not waited for
        out.revalidate_run = fr.name
    return out


def _first_scheduled(deployment_id: Any) -> datetime | None:
    """When the revalidate deployment's interval schedule first fires, as the API now holds it."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        dep = client.read_deployment(deployment_id)
    for sched in dep.schedules or []:
        interval = getattr(sched.schedule, "interval", None)
        anchor = getattr(sched.schedule, "anchor_date", None)
        if sched.active and isinstance(interval, timedelta) and isinstance(anchor, datetime):
            plain = datetime.fromtimestamp(anchor.timestamp(), tz=timezone.utc)  # not pendulum's subclass
            return first_after(plain, timedelta(seconds=interval.total_seconds()), datetime.now(timezone.utc))
    return None


def first_after(anchor: datetime, interval: timedelta, now: datetime) -> datetime:
    """The first time anchor + k × interval (k ≥ 1) after `now`: an interval schedule's next run
    (Prefect's scheduler never creates the run at the anchor itself, the moment of the deploy)."""
    if interval <= timedelta(0):
        raise ValueError("interval must be positive")
    k = max(1, int((now - anchor).total_seconds() // interval.total_seconds()) + 1)
    return anchor + k * interval
