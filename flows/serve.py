"""Serve fleet's four deployments from this process: no work pool, no worker.

    PREFECT_API_URL=http://127.0.0.1:4200/api python -m flows.serve [--config deployments/configs/local-sim.toml]

The same deployments as deployments/prefect.yaml (bringup, revalidate every 30 minutes,
generate, teardown), run in subprocesses of this one. Stop it with Ctrl-C: the
revalidate schedule is paused on shutdown (Prefect's default for `serve`), so no run
piles up while nothing serves it. The runner polls for new runs every
PREFECT_RUNNER_POLL_FREQUENCY seconds (default 10).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

DEFAULT_CONFIG = "deployments/configs/local-sim.toml"
REVALIDATE_EVERY_S = 1800

# name -> (fixed parameters, extra to_deployment options); kept in step with deployments/prefect.yaml.
DEPLOYMENTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "bringup": ({"action": "bringup"}, {}),
    "revalidate": ({"action": "revalidate"}, {"interval": REVALIDATE_EVERY_S}),
    "generate": ({"action": "generate"}, {}),
    "teardown": ({"action": "teardown", "free_ramdisk": False}, {}),
}


def runner_deployment(name: str, config: str, params: dict[str, Any], *, revalidate_every_s: float | None = None,
                      tags: list[str] | None = None, **opts: Any) -> Any:
    """One RunnerDeployment of the `fleet` flow; a revalidate one gets its schedule and one-at-a-time limit."""
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

    from flows.fleet import fleet

    opts = {k: v for k, v in opts.items() if v is not None}
    if params.get("action") == "revalidate":
        if revalidate_every_s:
            opts["interval"] = revalidate_every_s
        opts["concurrency_limit"] = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW)
    return fleet.to_deployment(name=name, parameters={"config": config, **params}, tags=tags or ["fleet"], **opts)


def build(config: str = DEFAULT_CONFIG, revalidate_every_s: float | None = REVALIDATE_EVERY_S) -> list[Any]:
    """The RunnerDeployments `serve` runs (exposed for tests)."""
    return [runner_deployment(name, config, params, revalidate_every_s=revalidate_every_s)
            for name, (params, _) in DEPLOYMENTS.items()]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flows.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=DEFAULT_CONFIG,
                   help="default `config` parameter of every deployment: a TOML path (relative to this "
                        "directory), or block:json/NAME (default: %(default)s)")
    p.add_argument("--revalidate-every", type=float, default=REVALIDATE_EVERY_S, metavar="SECONDS",
                   help="revalidate schedule interval; 0 for no schedule (default: %(default)s)")
    p.add_argument("--limit", type=int, default=None, help="most flow runs at once (default: no limit)")
    args = p.parse_args(argv)

    from prefect import serve

    serve(*build(args.config, args.revalidate_every or None), limit=args.limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
