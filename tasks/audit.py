"""Artifacts: every task leaves its result, timing and a log excerpt under a stable key.

Keys are `<fleet>-<node>-<stage>` or `<fleet>-<node>-server-<i>-<stage>`, plus
`<fleet>-summary`; Prefect keeps every version of a key, so the latest is the state of
the fleet and the history is the audit trail. Secrets are redacted before writing.

The artifacts page shows each key's newest version, whichever run wrote it, so every
artifact says which run it belongs to: its description starts with its status and ends
with the run's name and time ("FAILED: launch local server 2 — bringup-b200, 12:32:22
UTC"), and its body links the run. A stage a run did not reach (a smoke after a failed
launch, staging after a failed preflight) gets a "NOT RUN" version of its key from that
run, so an older run's OK never sits beside the latest FAILED as if it were current.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from fleet.config import FleetConfig

_KEY_BAD = re.compile(r"[^a-z0-9-]+")


def artifact_key(cfg: FleetConfig, *parts: object) -> str:
    raw = "-".join([cfg.name, *[str(p) for p in parts]]).lower()
    return _KEY_BAD.sub("-", raw).strip("-")[:100]


def redact_text(text: str, cfg: FleetConfig) -> str:
    """Every secret of the config (API key, engine.env values) replaced by ***."""
    for secret in cfg.secrets():
        text = text.replace(secret, "***")
    return text


def _utc(ts: float | None = None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def run_label() -> tuple[str, str]:
    """(run name, markdown naming the run: a link when PREFECT_UI_URL is set, else name and id)."""
    from prefect.runtime import flow_run
    from prefect.settings import PREFECT_UI_URL

    name = flow_run.name or "(no flow run)"
    ui = PREFECT_UI_URL.value()
    url = f"{ui.rstrip('/')}/runs/flow-run/{flow_run.id}" if ui and flow_run.id else None
    run_id = str(flow_run.id or "")[:8]
    return name, (f"[{name}]({url})" if url else f"**{name}**" + (f" (flow run `{run_id}`)" if run_id else ""))


def _stamp(description: str) -> str:
    name, _ = run_label()
    return f"{description} — {name}, {_utc()[11:]}"


def _run_line(cfg: FleetConfig) -> str:
    _, md = run_label()
    return f"Run {md} at {_utc()}; the fleet's state after this run: artifact `{artifact_key(cfg, 'summary')}`."


def write_stage(cfg: FleetConfig, key_parts: tuple[object, ...], title: str, *, ok: bool, seconds: float,
                result: dict[str, Any] | None = None, error: str | None = None, log: str | None = None) -> None:
    """One markdown artifact for one stage: status, run, timing, the result as JSON, a log excerpt."""
    status = "OK" if ok else "FAILED"
    parts = [f"## {title}: {status} in {seconds:.2f} s", _run_line(cfg)]
    if error:
        parts.append(f"**Error**\n\n```\n{error}\n```")
    if result is not None:
        parts.append("**Result**\n\n```json\n" + json.dumps(result, indent=2, default=str) + "\n```")
    if log:
        parts.append("**Log excerpt** (head and tail)\n\n```\n" + log[-20000:] + "\n```")
    create_markdown_artifact(redact_text("\n\n".join(parts), cfg), key=artifact_key(cfg, *key_parts),
                             description=redact_text(_stamp(f"{status}: {title}"), cfg))


def write_not_run(cfg: FleetConfig, key_parts: tuple[object, ...], title: str, why: str) -> None:
    """A stage this run did not reach: a NOT RUN version of its key, so an older OK is not read as current."""
    md = f"## {title}: NOT RUN\n\n{_run_line(cfg)}\n\nNot run in this run because {why}."
    create_markdown_artifact(redact_text(md, cfg), key=artifact_key(cfg, *key_parts),
                             description=redact_text(_stamp(f"NOT RUN: {title} ({why})"), cfg)[:500])


def write_table(cfg: FleetConfig, key_parts: tuple[object, ...], rows: list[dict[str, Any]], description: str) -> None:
    clean = [{k: redact_text(str(v), cfg) if isinstance(v, str) else v for k, v in r.items()} for r in rows]
    create_table_artifact(clean, key=artifact_key(cfg, *key_parts), description=redact_text(_stamp(description), cfg))
