"""One Prefect global concurrency limit per node, so two runs never launch onto the same GPUs.

Every action that changes or probes what runs on a node (bringup, revalidate, teardown)
holds a slot of `fleet-node-<node>` for each node of its config, for the whole action.
The limit has one slot and is created on first use. The node's name in the lock is the
machine, not the fleet config: `<host>-<port>` for an SSH node, `block-<name>` for a node
given by a fleet-node block, `local-<hostname>` for the machine the flow runs on. So two
fleet configs that point at the same machine also wait for each other.

What a second run does while the first holds the node: it logs that it waits, shows as
Running in the UI, and proceeds as soon as the slot is free (then adopts what the first
one launched: same launch spec, same pids). After `wait_s` it ends Failed with
"node busy". The slot is a lease renewed in the background: a flow process that dies
(kill -9, lost worker) frees it within `LEASE_S` seconds.

The lock lives in the Prefect API the flow talks to: runs against the same server (the
deployments, a worker, `PREFECT_API_URL` set) exclude each other; two `fleet up` runs on
their own embedded servers do not.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from fleet.config import FleetConfig, NodeConfig
from fleet.errors import TransientError

LOCK_PREFIX = "fleet-node-"
LEASE_S = 120.0
_BAD = re.compile(r"[^a-z0-9-]+")


def node_lock_name(node_cfg: NodeConfig) -> str:
    """The concurrency limit that guards this machine (a-z, 0-9, -)."""
    if node_cfg.kind == "ssh":
        ident = f"block-{node_cfg.block}" if node_cfg.block and not node_cfg.host else f"{node_cfg.host}-{node_cfg.port}"
    else:
        ident = f"local-{socket.gethostname()}"
    return (LOCK_PREFIX + _BAD.sub("-", ident.lower()).strip("-"))[:100]


def lock_names(cfg: FleetConfig) -> list[str]:
    return sorted({node_lock_name(n) for n in cfg.nodes})


def ensure_limits(names: list[str]) -> None:
    """Create each one-slot limit unless it exists; warn when someone widened or disabled it."""
    from prefect import get_run_logger
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        for name in names:
            try:
                existing = client.read_global_concurrency_limit_by_name(name)
            except ObjectNotFound:
                try:
                    client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
                except ObjectAlreadyExists:
                    pass  # another run created it meanwhile
                continue
            if existing.limit != 1 or not existing.active:
                get_run_logger().warning(
                    "concurrency limit %s has limit=%s active=%s: runs may launch onto the same GPUs at once; "
                    "set it back with `prefect gcl update %s --limit 1 --enable`",
                    name, existing.limit, existing.active, name)


def _locked(exc: BaseException) -> bool:
    cause = exc.__cause__
    return getattr(getattr(cause, "response", None), "status_code", None) == 423


@contextmanager
def hold_nodes(cfg: FleetConfig, *, wait_s: float, purpose: str) -> Iterator[list[str]]:
    """Hold every node of `cfg` for the body (all limits at once: no deadlock between multi-node fleets)."""
    from prefect import get_run_logger
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder
    from prefect.concurrency._asyncio import ConcurrencySlotAcquisitionError
    from prefect.concurrency.sync import concurrency
    from prefect.context import FlowRunContext

    logger = get_run_logger()
    names = lock_names(cfg)
    ensure_limits(names)
    ctx = FlowRunContext.get()
    holder = ConcurrencyLeaseHolder(type="flow_run", id=ctx.flow_run.id) if ctx and ctx.flow_run else None
    # strict: a missing limit is an error, never a silent "no limit"; a failed lease renewal
    # only logs (a bring-up must not die because one renewal call failed).
    opts = dict(strict=True, lease_duration=LEASE_S, holder=holder, raise_on_lease_renewal_failure=False)
    with ExitStack() as stack:
        try:
            # A first try that does not wait, so the run can say why it waits.
            stack.enter_context(concurrency(names, max_retries=0, **opts))
        except ConcurrencySlotAcquisitionError as exc:
            if not _locked(exc):
                raise
            logger.warning("%s: another run holds %s (a bring-up, revalidation or teardown of this machine); "
                           "waiting up to %.0f s", purpose, ", ".join(names), wait_s)
            try:
                stack.enter_context(concurrency(names, timeout_seconds=wait_s, **opts))
            except TimeoutError:
                raise NodeBusy(
                    f"{purpose}: node busy: another run held {', '.join(names)} for more than {wait_s:.0f} s",
                    remedy="wait for the other run to end (the Concurrency page of the Prefect UI shows the "
                           "slot), or raise the flow parameter node_wait_s",
                ) from None
        logger.info("%s: holding %s", purpose, ", ".join(names))
        yield names


class NodeBusy(TransientError):
    """Another run held the node longer than this run would wait."""
