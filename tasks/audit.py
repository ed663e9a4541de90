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

from typing import Any

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from fleet.artifacts import (artifact_key, redact_text, run_line, run_markdown, stage_description, stage_markdown,
                             stamp, table_rows)
from fleet.config import FleetConfig

__all__ = ["artifact_key", "redact_text", "run_label", "write_not_run", "write_stage", "write_table"]


def run_label() -> tuple[str, str]:
    """(run name, markdown naming the run: a link when PREFECT_UI_URL is set, else name and id)."""
    from prefect.runtime import flow_run
    from prefect.settings import PREFECT_UI_URL

    return run_markdown(flow_run.name, str(flow_run.id) if flow_run.id else None, PREFECT_UI_URL.value())


def _stamp(description: str) -> str:
    return stamp(description, run_label()[0])


def _run_line(cfg: FleetConfig) -> str:
    return run_line(cfg, run_label()[1])


def write_stage(cfg: FleetConfig, key_parts: tuple[object, ...], title: str, *, ok: bool, seconds: float,
                result: dict[str, Any] | None = None, error: str | None = None, log: str | None = None) -> None:
    """One markdown artifact for one stage: status, run, timing, the result as JSON, a log excerpt."""
    name, md = run_label()
    create_markdown_artifact(stage_markdown(cfg, title, md, ok=ok, seconds=seconds, result=result, error=error, log=log),
                             key=artifact_key(cfg, *key_parts), description=stage_description(cfg, title, name, ok))


def write_not_run(cfg: FleetConfig, key_parts: tuple[object, ...], title: str, why: str) -> None:
    """A stage this run did not reach: a NOT RUN version of its key, so an older OK is not read as current."""
    md = f"## {title}: NOT RUN\n\n{_run_line(cfg)}\n\nNot run in this run because {why}."
    create_markdown_artifact(redact_text(md, cfg), key=artifact_key(cfg, *key_parts),
                             description=redact_text(_stamp(f"NOT RUN: {title} ({why})"), cfg)[:500])


def write_table(cfg: FleetConfig, key_parts: tuple[object, ...], rows: list[dict[str, Any]], description: str) -> None:
    create_table_artifact(table_rows(cfg, rows), key=artifact_key(cfg, *key_parts),
                          description=redact_text(_stamp(description), cfg))
