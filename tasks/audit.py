"""Artifacts: every task leaves its result, timing and a log excerpt under a stable key.

Keys are `<fleet>-<node>-<stage>` or `<fleet>-<node>-server-<i>-<stage>`, plus
`<fleet>-summary`; Prefect keeps every version of a key, so the latest is the state of
the fleet and the history is the audit trail. Secrets are redacted before writing.
"""

from __future__ import annotations

import json
import re
from typing import Any

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from fleet.config import FleetConfig

_KEY_BAD = re.compile(r"[^a-z0-9-]+")


def artifact_key(cfg: FleetConfig, *parts: object) -> str:
    raw = "-".join([cfg.name, *[str(p) for p in parts]]).lower()
    return _KEY_BAD.sub("-", raw).strip("-")[:100]


def redact_text(text: str, cfg: FleetConfig) -> str:
    key = cfg.api_key()
    return text.replace(key, "***") if key else text


def write_stage(cfg: FleetConfig, key_parts: tuple[object, ...], title: str, *, ok: bool, seconds: float,
                result: dict[str, Any] | None = None, error: str | None = None, log: str | None = None) -> None:
    """One markdown artifact for one stage: status, timing, the result as JSON, a log excerpt."""
    status = "OK" if ok else "FAILED"
    parts = [f"## {title}: {status} in {seconds:.2f} s"]
    if error:
        parts.append(f"**Error**\n\n```\n{error}\n```")
    if result is not None:
        parts.append("**Result**\n\n```json\n" + json.dumps(result, indent=2, default=str) + "\n```")
    if log:
        parts.append("**Log excerpt** (head and tail)\n\n```\n" + log[-20000:] + "\n```")
    create_markdown_artifact(redact_text("\n\n".join(parts), cfg), key=artifact_key(cfg, *key_parts),
                             description=f"{title} — {status}")


def write_table(cfg: FleetConfig, key_parts: tuple[object, ...], rows: list[dict[str, Any]], description: str) -> None:
    clean = [{k: redact_text(str(v), cfg) if isinstance(v, str) else v for k, v in r.items()} for r in rows]
    create_table_artifact(clean, key=artifact_key(cfg, *key_parts), description=description)
