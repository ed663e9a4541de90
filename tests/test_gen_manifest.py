"""The manifest builder on plain inputs: no runner, no store, no servers, no clock."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from fleet.generation.data.manifest import Summary
from fleet.generation.data.manifest import RunFacts, ServerFacts, build_manifest, cost, run_record


def _summary(**kw: Any) -> Summary:
    base: dict[str, Any] = dict(
        state="done", complete=True, completed=90, errors=6, rejects=4, fed=100, unfinished=0, retries=3,
        requeues=1, prompt_tokens=20_000, completion_tokens=100_000, wall_s=50.0, reason=None,
        servers=[{"requests": 60, "completed": 55}, {"requests": 40, "completed": 35}], quality_rejects=2,
        gates={"empty": 2},
    )
    base.update(kw)
    return Summary(**base)


def _facts(**kw: Any) -> RunFacts:
    base: dict[str, Any] = dict(
        state="done", reason=None, failure=None, summary=_summary(), input_path="/data/in.jsonl",
        input_fingerprint="ab" * 32, rows_total=102, output="/data/out",
        counts={"completed": 90, "committed": 90, "errors": 6, "rejects": 4, "quality_rejects": 2, "shards": 1},
        config={"name": "f"}, config_fingerprint="cfg123", price_per_gpu_hour=2.0,
        servers=[ServerFacts("gpu1/0", "http://127.0.0.1:30000", "m", 2,
                             {"version": "0.4", "tp_size": 2, "internal_states": [{"big": 1}]}),
                 ServerFacts("gpu1/1", "http://127.0.0.1:30001", "m", 1, {})],
        started_at=1000.0, finished_at=1060.0, wall_s=60.0, previous_runs=(),
        runner={"pid": 7, "retry_errors": False, "python": "3.12.0"},
    )
    base.update(kw)
    return RunFacts(**base)


def test_manifest_of_one_clean_run() -> None:
    """A done run: complete, counts accounted, servers with their kept facts and counters, cost priced."""
    m = build_manifest(_facts())
    assert m["state"] == "done" and m["complete"] is True and m["error"] is None
    assert m["input"] == {"path": "/data/in.jsonl", "fingerprint": "ab" * 32, "rows": 102, "rows_in_input": None,
                          "limit": None}
    # what a later call's --limit is compared with (fleet/generation/job/validate.py `covers`)
    assert build_manifest(_facts(rows_in_input=300, limit=102))["input"]["rows_in_input"] == 300
    assert m["accounted"] == 90 + 6 + 4 + 2
    assert m["servers"][0] == {"name": "gpu1/0", "url": "http://127.0.0.1:30000", "model": "m", "gpus": 2,
                               "info": {"version": "0.4", "tp_size": 2}, "requests": 60, "completed": 55}
    assert m["throughput"] == {"completion_tokens": 100_000, "prompt_tokens": 20_000, "completion_tok_s": 2000.0,
                               "total_tok_s": 2400.0, "rows_per_s": 1.8}
    # 50 s of dispatch on 3 GPUs at $2/GPU-hour
    assert m["cost"]["gpus"] == 3 and m["cost"]["usd"] == round(50 / 3600 * 3 * 2.0, 4)
    assert m["this_run"]["gpus"] == 3 and m["this_run"]["dispatch_s"] == 50.0 and m["this_run"]["wall_s"] == 60.0
    assert m["this_run"]["quality_rejects"] == 2 and m["this_run"]["gates"] == {"empty": 2}
    assert m["runs"] == [m["this_run"]] and m["overall"]["runs"] == 1
    assert m["timings"] == {"started_at": 1000.0, "finished_at": 1060.0, "wall_s": 60.0, "dispatch_s": 50.0}
    json.dumps(m)   # plain JSON, no default= needed


def test_manifest_sums_every_run_into_the_directory() -> None:
    """A resumed job: `overall` sums the earlier runs with this one; a run recorded without `gpus`
    is priced with this run's GPUs."""
    earlier = [{"dispatch_s": 100.0, "completion_tokens": 50_000, "prompt_tokens": 5_000, "gpus": 1},
               {"dispatch_s": 10.0, "completion_tokens": 1_000, "prompt_tokens": 100}]   # an old record: no gpus
    m = build_manifest(_facts(previous_runs=earlier))
    o = m["overall"]
    assert o["runs"] == 3 and o["dispatch_s"] == 160.0
    assert o["completion_tokens"] == 151_000 and o["prompt_tokens"] == 25_100
    assert o["completion_tok_s"] == round(151_000 / 160.0, 2)
    gpu_s = 100.0 * 1 + 10.0 * 3 + 50.0 * 3
    assert o["cost"]["gpu_hours"] == round(gpu_s / 3600, 4) and "gpus" not in o["cost"]
    assert m["runs"][:2] == earlier and m["runs"][2] == m["this_run"]


def test_failed_run_is_not_complete_and_names_its_error() -> None:
    """A failure: never `complete` (even if the dispatcher saw every row end); the error in both places."""
    err = {"kind": "disk_full", "cause": "disk full", "remedy": "free space", "file": "/data/out/shards"}
    m = build_manifest(_facts(state="failed", reason="disk full", failure=err))
    assert m["complete"] is False and m["error"] == err and m["this_run"]["error"] == err
    assert "error" not in run_record(_facts())


def test_zero_dispatch_time_gives_no_rates() -> None:
    """A run that failed before its first row: no division by zero, rates are None, no price per token."""
    s = _summary(completed=0, errors=0, rejects=0, fed=0, prompt_tokens=0, completion_tokens=0, wall_s=0.0,
                 servers=[], complete=False, state="failed")
    m = build_manifest(replace(_facts(), summary=s, state="failed"))
    assert m["throughput"]["completion_tok_s"] is None and m["throughput"]["rows_per_s"] is None
    assert m["overall"]["completion_tok_s"] is None
    assert m["servers"] == []   # no counters: no server rows
    assert "usd" not in m["cost"]


def test_cost_without_a_price_is_gpu_hours_only() -> None:
    assert cost(None, 3600.0, 2, 1000, 10) == {"gpus": 2, "gpu_hours": 2.0, "price_per_gpu_hour": None}
    c = cost(4.0, 1800.0, 2, 1_000_000, 1_000_000)
    assert c["usd"] == 4.0 and c["usd_per_m_completion_tokens"] == 4.0 and c["usd_per_m_total_tokens"] == 2.0
