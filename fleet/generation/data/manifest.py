"""A job's manifest (`<out>/manifest.json`), built from plain facts by pure functions.

The runner gathers what one run knows (its outcome, the dispatcher's `Summary`, the
store's counts, the servers, the runs before it) into a `RunFacts`; `build_manifest`
turns that into the manifest dict, with nothing read from disk, the clock or the
environment, so it is tested on plain inputs. The runner then adds the data checks
(`checks`, `quality`), which read the output, and writes it with `store.write_manifest`.

A long job is often several runs into one directory (kills, resumes): `runs` keeps each
run's record (`run_record`), and `overall` sums them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet.generation.data.durable import atomic_write

__all__ = ["MANIFEST_FILE", "RunFacts", "ServerFacts", "Summary", "build_manifest", "cost", "read_manifest", "run_record",
           "server_facts", "write_manifest"]

MANIFEST_FILE = "manifest.json"


@dataclass
class Summary:
    """What one run of the dispatcher did (its counts, servers, gates and backups): a run's record is built from it."""

    state: str                 # done | stopped | failed
    complete: bool             # input exhausted and every row fed ended in results or errors
    completed: int
    errors: int
    rejects: int
    fed: int                   # rows accepted from the input this run
    unfinished: int            # rows fed but left unwritten (a stop): resume sends them again
    retries: int
    requeues: int
    prompt_tokens: int
    completion_tokens: int
    wall_s: float
    reason: str | None = None
    servers: list[dict[str, Any]] = field(default_factory=list)
    quality_rejects: int = 0   # rows a quality gate turned away (quality_rejects.jsonl)
    gates: dict[str, Any] = field(default_factory=dict)   # work.GateStats of this run
    hedge: dict[str, Any] = field(default_factory=dict)   # hedge.Hedge.stats() of this run

# What the manifest keeps of a server's /server_info (the rest is large and engine-internal).
SERVER_INFO_KEYS = ("version", "model_path", "served_model_name", "context_length", "max_total_num_tokens",
                    "max_running_requests", "max_req_input_len", "speculative_algorithm", "speculative_num_steps",
                    "tp_size", "mem_fraction_static")

# The Summary counters a run's record copies as they are.
_RUN_COUNTERS = ("fed", "completed", "errors", "rejects", "unfinished", "retries", "requeues", "quality_rejects")


@dataclass(frozen=True)
class ServerFacts:
    """One server of the run, as the manifest names it (its counters come from `Summary.servers`)."""

    name: str
    url: str
    model: str
    gpus: int
    info: dict[str, Any] = field(default_factory=dict)   # /server_info, as the dispatcher read it


@dataclass(frozen=True)
class RunFacts:
    """Everything the manifest says about one run, read before it is built."""

    state: str                          # done | stopped | failed (the job's, after the runner's checks)
    reason: str | None
    failure: dict[str, Any] | None      # runner.Failure.as_dict(), when the job failed
    summary: Summary                    # the dispatcher's, for this run
    input_path: str
    input_fingerprint: str
    rows_total: int | None              # rows of the input (capped by generation.limit), None if not counted
    output: str
    counts: dict[str, int]              # ResultStore.counts(): every run into this directory
    config: dict[str, Any]              # the FleetConfig as JSON, the API key left out
    config_fingerprint: str
    price_per_gpu_hour: float | None
    servers: Sequence[ServerFacts]
    started_at: float                   # epoch seconds
    finished_at: float
    wall_s: float                       # the whole run, set-up and manifest included
    # every row of the input and the run's generation.limit: whether the job covers a later call's
    # --limit (fleet/generation/job/validate.py `covers`)
    rows_in_input: int | None = None
    limit: int | None = None
    previous_runs: Sequence[dict[str, Any]] = ()   # the `runs` of the manifest already there
    runner: dict[str, Any] = field(default_factory=dict)   # pid, retry_errors, python

    @property
    def gpus(self) -> int:
        return sum(s.gpus for s in self.servers)


def server_facts(info: dict[str, Any]) -> dict[str, Any]:
    """The kept keys of /server_info whose values are plain (a server's answer is not trusted: a
    nested or huge value there must not cost the job its manifest)."""
    return {k: v for k in SERVER_INFO_KEYS if k in info
            and isinstance(v := info[k], str | int | float | bool | None) and (not isinstance(v, str) or len(v) <= 1000)}


def cost(price_per_gpu_hour: float | None, wall_s: float, gpus: int, completion_tokens: int,
         prompt_tokens: int) -> dict[str, Any]:
    """GPU hours, and with a price the dollars and dollars per million tokens."""
    gpu_hours = wall_s / 3600 * gpus
    out: dict[str, Any] = {"gpus": gpus, "gpu_hours": round(gpu_hours, 4),
                           "price_per_gpu_hour": price_per_gpu_hour}
    price = price_per_gpu_hour
    if price is not None and completion_tokens:
        usd = gpu_hours * price
        out["usd"] = round(usd, 4)
        out["usd_per_m_completion_tokens"] = round(usd / (completion_tokens / 1e6), 4)
        out["usd_per_m_total_tokens"] = round(usd / ((completion_tokens + prompt_tokens) / 1e6), 4)
    return out


def run_record(f: RunFacts) -> dict[str, Any]:
    """This run's entry of the manifest's `runs` (and its `this_run`)."""
    s = f.summary
    record: dict[str, Any] = {
        "started_at": f.started_at, "finished_at": f.finished_at, "wall_s": round(f.wall_s, 3),
        "dispatch_s": round(s.wall_s, 3), "state": f.state, "gpus": f.gpus,
        "completion_tokens": s.completion_tokens, "prompt_tokens": s.prompt_tokens,
        **{k: getattr(s, k) for k in _RUN_COUNTERS},
        "gates": s.gates,
        "hedge": s.hedge,   # backups: sent, won, the tokens their losers cost (fleet.generation.hotpath.hedge)
    }
    if f.failure is not None:
        record["error"] = f.failure
    return record


def _throughput(s: Summary) -> dict[str, Any]:
    return {
        "completion_tokens": s.completion_tokens, "prompt_tokens": s.prompt_tokens,
        "completion_tok_s": round(s.completion_tokens / s.wall_s, 2) if s.wall_s else None,
        "total_tok_s": round((s.completion_tokens + s.prompt_tokens) / s.wall_s, 2) if s.wall_s else None,
        "rows_per_s": round(s.completed / s.wall_s, 3) if s.wall_s else None,
    }


def _overall(runs: Sequence[dict[str, Any]], gpus: int, price_per_gpu_hour: float | None) -> dict[str, Any]:
    """Every run into this directory, summed (a run recorded without `gpus` counts this run's)."""
    all_s = sum(r.get("dispatch_s", 0) for r in runs)
    all_ct = sum(r.get("completion_tokens", 0) for r in runs)
    all_pt = sum(r.get("prompt_tokens", 0) for r in runs)
    gpu_s = sum(r.get("dispatch_s", 0) * r.get("gpus", gpus) for r in runs)
    hedge = {k: sum((r.get("hedge") or {}).get(k, 0) for r in runs) for k in ("backups", "wins", "extra_tokens")}
    return {
        "runs": len(runs), "dispatch_s": round(all_s, 3), "completion_tokens": all_ct, "hedge": hedge,
        "prompt_tokens": all_pt, "completion_tok_s": round(all_ct / all_s, 2) if all_s else None,
        "cost": {k: v for k, v in cost(price_per_gpu_hour, gpu_s, 1, all_ct, all_pt).items() if k != "gpus"},
    }


def build_manifest(f: RunFacts) -> dict[str, Any]:
    """The manifest of the job after this run (without `checks` and `quality`, which read the output)."""
    s = f.summary
    this_run = run_record(f)
    runs = [*f.previous_runs, this_run]
    counts = dict(f.counts)
    return {
        "state": f.state, "reason": f.reason, "complete": s.complete and f.failure is None,
        "error": f.failure,
        "input": {"path": f.input_path, "fingerprint": f.input_fingerprint, "rows": f.rows_total,
                  "rows_in_input": f.rows_in_input, "limit": f.limit},
        "output": f.output,
        "counts": counts,
        "accounted": sum(counts.get(k, 0) for k in ("completed", "errors", "rejects", "quality_rejects")),
        "this_run": this_run,
        "config_fingerprint": f.config_fingerprint,
        "config": f.config,
        "servers": [{"name": srv.name, "url": srv.url, "model": srv.model, "gpus": srv.gpus,
                     "info": server_facts(srv.info), **stats}
                    for srv, stats in zip(f.servers, s.servers)],
        "timings": {"started_at": f.started_at, "finished_at": f.finished_at, "wall_s": round(f.wall_s, 3),
                    "dispatch_s": round(s.wall_s, 3)},
        "throughput": _throughput(s),
        "cost": cost(f.price_per_gpu_hour, s.wall_s, f.gpus, s.completion_tokens, s.prompt_tokens),
        "overall": _overall(runs, f.gpus, f.price_per_gpu_hour),
        "runs": runs,
        "runner": f.runner,
    }


def write_manifest(out_dir: str | Path, data: dict[str, Any]) -> None:
    """Write DIR/manifest.json atomically (temp file, fsync, rename, directory fsync)."""
    text = json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n"
    atomic_write(Path(out_dir) / MANIFEST_FILE, text.encode())


def read_manifest(out_dir: str | Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads((Path(out_dir) / MANIFEST_FILE).read_text())
    except FileNotFoundError:
        return None
    return data
