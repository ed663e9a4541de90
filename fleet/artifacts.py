"""The text of a run's artifacts, Prefect-free: keys, redaction, the stage markdown and the table rows.

tasks/audit.py writes them through Prefect's artifact API inside the flow's runs; the adopt-only
`fleet up` (flows/quickup.py) posts the very same text through the REST API. What a run is called
comes in as arguments (its name, id, the UI's address), so both write one format.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

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


def utc(ts: float | None = None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def run_markdown(name: str | None, run_id: str | None, ui: str | None) -> tuple[str, str]:
    """(run name, markdown naming the run: a link when the UI's address is known, else name and id)."""
    name = name or "(no flow run)"
    url = f"{ui.rstrip('/')}/runs/flow-run/{run_id}" if ui and run_id else None
    short = str(run_id or "")[:8]
    return name, (f"[{name}]({url})" if url else f"**{name}**" + (f" (flow run `{short}`)" if short else ""))


def stamp(description: str, run_name: str) -> str:
    return f"{description} — {run_name}, {utc()[11:]}"


def run_line(cfg: FleetConfig, run_md: str) -> str:
    return f"Run {run_md} at {utc()}; the fleet's state after this run: artifact `{artifact_key(cfg, 'summary')}`."


def stage_markdown(cfg: FleetConfig, title: str, run_md: str, *, ok: bool, seconds: float,
                   result: dict[str, Any] | None = None, error: str | None = None, log: str | None = None) -> str:
    """One stage's markdown: status, run, timing, the result as JSON, a log excerpt (redacted)."""
    status = "OK" if ok else "FAILED"
    parts = [f"## {title}: {status} in {seconds:.2f} s", run_line(cfg, run_md)]
    if error:
        parts.append(f"**Error**\n\n```\n{error}\n```")
    if result is not None:
        parts.append("**Result**\n\n```json\n" + json.dumps(result, indent=2, default=str) + "\n```")
    if log:
        parts.append("**Log excerpt** (head and tail)\n\n```\n" + log[-20000:] + "\n```")
    return redact_text("\n\n".join(parts), cfg)


def stage_description(cfg: FleetConfig, title: str, run_name: str, ok: bool) -> str:
    return redact_text(stamp(f"{'OK' if ok else 'FAILED'}: {title}", run_name), cfg)


def table_rows(cfg: FleetConfig, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: redact_text(str(v), cfg) if isinstance(v, str) else v for k, v in r.items()} for r in rows]
