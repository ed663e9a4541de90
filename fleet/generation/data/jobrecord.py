"""DIR/job.json: one output directory, one job (the same input and the same generation parameters).

The first run records the input's SHA-256 and `validate.job_params`; every later run into the
directory must match them, except that a repaired copy may continue an input that broke
mid-file (`note_input_broken`).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from fleet.errors import FatalError, JobConflict
from fleet.generation.data.durable import atomic_write

__all__ = ["JOB_FILE", "check_job", "note_input_broken", "params_diff"]

log = logging.getLogger("fleet.generation.data.store")

JOB_FILE = "job.json"


def check_job(out_dir: Path, fingerprint: str | None, params: dict[str, Any] | None = None) -> None:
    """One directory, one job: the same input (SHA-256) and the same generation parameters
    (`validate.job_params`) as recorded in DIR/job.json by the first run; recorded if absent."""
    path = out_dir / JOB_FILE
    try:
        job = json.loads(path.read_text())
    except FileNotFoundError:
        job = {}
    except ValueError as exc:
        raise FatalError(f"{path} is not valid JSON ({exc})",
                         remedy=f"restore it, or delete it to accept the current input into {out_dir}") from exc
    recorded = job.get("input_fingerprint")
    if fingerprint is not None and recorded is not None and recorded != fingerprint and job.get("input_broken"):
        # The recorded input broke mid-file (truncated/corrupt): its repaired copy continues the job;
        # the rows done are skipped by id.
        log.warning("%s: the recorded input was broken (%s); continuing with the replacement input %s…",
                    out_dir, job["input_broken"], fingerprint[:12])
        job.pop("input_broken")
        job["replaced_inputs"] = [*job.get("replaced_inputs", []), recorded]
        job["input_fingerprint"] = recorded = fingerprint
        atomic_write(path, (json.dumps(job, indent=2) + "\n").encode())
    if fingerprint is not None and recorded is not None and recorded != fingerprint:
        raise JobConflict(
            f"output directory {out_dir} holds results of a different input "
            f"(recorded sha256 {recorded[:12]}…, this input {fingerprint[:12]}…)",
            remedy="pass the input this directory was started with, or give the new input its own "
                   "--output directory (mixing two inputs in one directory would corrupt resume)",
        )
    recorded_params = job.get("params")
    if params is not None and recorded_params is not None and recorded_params != params:
        raise JobConflict(
            f"output directory {out_dir} was generated with other parameters "
            f"({'; '.join(params_diff(recorded_params, params))})",
            remedy="give this job its own --output, or set the parameters back (one directory holds one "
                   "dataset: rows made with two settings would be mixed silently)",
        )
    changed = False
    if fingerprint is not None and recorded is None:
        job.update(input_fingerprint=fingerprint)
        changed = True
    if params is not None and recorded_params is None:
        job.update(params=params)
        changed = True
    if changed:
        job.setdefault("created_at", time.time())
        atomic_write(path, (json.dumps(job, indent=2) + "\n").encode())


def note_input_broken(out_dir: Path, cause: str) -> None:
    """Record in DIR/job.json that this job's input broke mid-file: a repaired copy may continue it."""
    path = out_dir / JOB_FILE
    try:
        job = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    job["input_broken"] = cause
    atomic_write(path, (json.dumps(job, indent=2) + "\n").encode())

def params_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """'section.key: old → new' for every key that differs (a key missing on one side reads as unset)."""
    out = []
    for section in sorted(set(old) | set(new)):
        a, b = old.get(section) or {}, new.get(section) or {}
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                out.append(f"{section}.{k}: {json.dumps(a.get(k))} → {json.dumps(b.get(k))}")
    return out
