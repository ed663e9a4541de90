"""Create (or replace) the automation that notifies on a failed or crashed `fleet` flow run.

    # a webhook anywhere (Slack-compatible JSON: {"text": ...}); creates the block `fleet-alerts`
    python deployments/automation.py --webhook-url https://hooks.example.com/T000/B000
    # or any notification block you already made in the UI (Slack, Teams, PagerDuty, email, ...)
    python deployments/automation.py --block slack-webhook/ops-alerts

Runs against the Prefect API in PREFECT_API_URL. Idempotent: the block is overwritten and
an automation of the same name is deleted and created again, so re-running applies edits.

The trigger: a `fleet.flow-run.failed` event (emitted by every failed run of the `fleet`
flow, flows/alerts.py) or Prefect's `prefect.flow-run.Crashed`, for every deployment:
bringup, scheduled revalidate, generate, teardown. Not `prefect.flow-run.Failed`: for runs a
fresh schedule creates, Prefect holds that event ≈ 15 minutes waiting for a Scheduled event
that never comes. The notification names the run, its state message (revalidate puts every
unhealthy server there) and a link to it in the UI (PREFECT_UI_URL on the server).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from uuid import UUID

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from flows.alerts import FAILED_EVENT  # noqa: E402

AUTOMATION_NAME = "fleet-run-failed"
WEBHOOK_BLOCK_NAME = "fleet-alerts"
FLOW_NAME = "fleet"

SUBJECT = "fleet: {{ flow_run.name }} {{ flow_run.state.name }}"
BODY = """\
Flow run {{ flow.name }}/{{ flow_run.name }} ended {{ flow_run.state.name }} at {{ flow_run.state.timestamp }}.
{% if deployment %}Deployment: {{ deployment.name }}
{% endif %}Message: {{ flow_run.state.message }}
Run: {{ flow_run|ui_url or ("flow run " ~ flow_run.id ~ " (set PREFECT_UI_URL on the server for a link)") }}
"""


def webhook_block(url: str, name: str = WEBHOOK_BLOCK_NAME) -> UUID:
    """Save a Custom Webhook notification block posting {"text", "subject"} JSON to `url`; its id."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    block = CustomWebhookNotificationBlock(
        name=name, url=url, method="POST",
        json_data={"text": "{{subject}}\n{{body}}", "subject": "{{subject}}", "body": "{{body}}"},
    )
    return block.save(name, overwrite=True)


def existing_block(ref: str) -> UUID:
    """The id of a saved notification block, `<type-slug>/<name>` (e.g. slack-webhook/ops)."""
    from prefect.blocks.core import Block

    block = Block.load(ref)
    if not hasattr(block, "notify"):
        raise SystemExit(f"automation.py: block {ref!r} is a {type(block).__name__}, not a notification block")
    return block._block_document_id


def build_automation(block_id: UUID, flow_name: str = FLOW_NAME):  # -> Automation
    from prefect.automations import Automation, EventTrigger, Posture, SendNotification

    return Automation(
        name=AUTOMATION_NAME,
        description=f"Notify through a notification block when a run of the `{flow_name}` flow fails or crashes.",
        trigger=EventTrigger(
            # fleet.flow-run.failed comes from the run itself and follows no other event, so it is
            # never held back waiting for a Scheduled event the scheduler did not emit (flows/alerts.py).
            # Crashed: a run killed outright runs no hook; Prefect's event is the only word of it.
            expect={FAILED_EVENT, "prefect.flow-run.Crashed"},
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={"prefect.resource.role": "flow", "prefect.resource.name": flow_name},
            posture=Posture.Reactive,
            threshold=1,
            within=0,
        ),
        actions=[SendNotification(block_document_id=block_id, subject=SUBJECT, body=BODY)],
    )


def apply(block_id: UUID, flow_name: str = FLOW_NAME):  # -> Automation
    """Replace the automation named AUTOMATION_NAME; return the created one."""
    from prefect.automations import Automation

    try:
        while True:  # names are not unique in Prefect: remove every earlier copy
            Automation.read(name=AUTOMATION_NAME).delete()
    except ValueError:
        pass  # none (left)
    return build_automation(block_id, flow_name).create()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--webhook-url", help=f"create/overwrite the Custom Webhook block {WEBHOOK_BLOCK_NAME!r} posting here")
    g.add_argument("--block", help="use this existing notification block: <type-slug>/<name>")
    p.add_argument("--flow", default=FLOW_NAME, help="flow name to watch (default: fleet)")
    args = p.parse_args(argv)
    block_id = webhook_block(args.webhook_url) if args.webhook_url else existing_block(args.block)
    automation = apply(block_id, args.flow)
    print(f"automation {automation.name!r} ({automation.id}): on a Failed or Crashed run of flow {args.flow!r}, "
          f"notify through block {args.block or 'custom-webhook/' + WEBHOOK_BLOCK_NAME} ({block_id})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
