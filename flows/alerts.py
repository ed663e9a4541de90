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

import re
from typing import Any

FAILED_EVENT = "fleet.flow-run.failed"

# The cause as a tag: Prefect's UI shows a run's tags in the runs list and at the top of the run
# page, but its state message nowhere without scrolling to the last log line (checked with Chromium
# on Prefect 3.9.1). A tag is one short line: which server and the cause's first words; the whole
# message stays the state message and the last log line.
CAUSE_TAG_CHARS = 64  # longer, the runs list folds the tag into "+1"
_REPEATS = [re.compile(r"^\d+ server\(s\) [^:]*: "),  # "1 server(s) up; 1 failed: ": the tag says failed
            re.compile(r"\[[^\]]*\] server \d+ on port \d+: "),  # "[host] server 1 on port 31001: " after the label
            re.compile(r"fatal log line after [\d.]+ s: ")]


def cause_tag(message: str) -> str:
    """`failed: <which server, why>` from a run's failure message, short enough to read at a glance."""
    text = message
    for pattern in _REPEATS:
        text = pattern.sub("", text)
    text = " ".join(text.split())
    if len(text) > CAUSE_TAG_CHARS:
        text = text[:CAUSE_TAG_CHARS - 1].rstrip() + "…"
    return f"failed: {text}"


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
    tag_cause(flow_run, state.message or "")


def tag_cause(flow_run: Any, message: str) -> None:
    """Add the cause tag to the run (a retried run's earlier cause tags are replaced; never raises)."""
    if not message:
        return
    try:
        from prefect.client.orchestration import get_client

        kept = [t for t in (flow_run.tags or []) if not t.startswith("failed: ")]
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run.id, tags=[*kept, cause_tag(message)])
    except Exception:  # noqa: BLE001 - a tag must never turn a Failed run into a crash
        import logging

        logging.getLogger("fleet.alerts").warning("could not tag the run with its cause", exc_info=True)


def clear_cause(flow: Any, flow_run: Any, state: Any) -> None:
    """on_completion hook: a retried run that now completed drops the cause tag of its failed try."""
    if any(t.startswith("failed: ") for t in (flow_run.tags or [])):
        try:
            from prefect.client.orchestration import get_client

            with get_client(sync_client=True) as client:
                client.update_flow_run(flow_run.id, tags=[t for t in flow_run.tags if not t.startswith("failed: ")])
        except Exception:  # noqa: BLE001 - never turn a Completed run into a crash
            import logging

            logging.getLogger("fleet.alerts").warning("could not drop the cause tag", exc_info=True)
