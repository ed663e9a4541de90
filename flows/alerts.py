"""The event fleet's alert automation follows: `fleet.flow-run.failed`, emitted by the run itself.

Why not Prefect's own `prefect.flow-run.Failed`: the server's event ordering holds an event
until the one it follows has been seen (up to 15 minutes). Runs that a schedule creates
right after `prefect deploy` (or a new schedule) have no `prefect.flow-run.Scheduled`
event, so their Pending → Running → Failed chain waited ≈ 15 minutes and the alert came
that late (measured on Prefect 3.9.1). This event follows nothing: the automation sees it
at once. It names the flow run (and its flow and deployment) as Prefect's own state
events do, so the notification templates read `flow_run`, `flow` and `deployment`.
"""

from __future__ import annotations

from typing import Any

FAILED_EVENT = "fleet.flow-run.failed"


def announce_failure(flow: Any, flow_run: Any, state: Any) -> None:
    """on_failure hook of the `fleet` flow: emit FAILED_EVENT for this run (never raises)."""
    try:
        from prefect.events import emit_event

        related = [{"prefect.resource.id": f"prefect.flow.{flow_run.flow_id}", "prefect.resource.role": "flow",
                    "prefect.resource.name": flow.name}]
        if flow_run.deployment_id:
            related.append({"prefect.resource.id": f"prefect.deployment.{flow_run.deployment_id}",
                            "prefect.resource.role": "deployment"})
        emit_event(event=FAILED_EVENT,
                   resource={"prefect.resource.id": f"prefect.flow-run.{flow_run.id}",
                             "prefect.resource.name": flow_run.name,
                             "prefect.state-name": state.name, "prefect.state-type": str(state.type.value)},
                   related=related, payload={"message": (state.message or "")[:4000]})
    except Exception:  # noqa: BLE001 - an alert must never turn a Failed run into a crash
        import logging

        logging.getLogger("fleet.alerts").warning("could not emit %s", FAILED_EVENT, exc_info=True)
