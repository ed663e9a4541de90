"""Job knobs: sampling defaults with per-row override, a seeded per-row reasoning_effort,
`--limit N`, and the input's extra fields carried to the result row.

What these protect: a job-level top_k/min_p/penalty that never reaches the request (or
overrides a row's own value); a reasoning_effort draw that changes on resume (a row
regenerated after a kill would get another effort) or is not recorded; `--limit` reading
the whole input; extra input fields (source, category) lost before the SpecForge export.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from fleet.cli import build_parser
from fleet.config import FleetConfig, GenerationConfig
from fleet.generation.data.checks import account
from fleet.generation.data.inputs import iter_input
from fleet.generation.data.rows import Reject, Request
from fleet.generation.job.runner import ServerEntry, run_local
from fleet.generation.data.results import read_results
from fleet.generation.data.schema import params_from_arrow
from fleet.generation.hotpath.work import RowPlan
from test_gen_dispatch import Sim, sims  # noqa: F401  (the fixture is re-used)


def rows(path: Path, items: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return path


def test_sampling_defaults_fill_and_rows_override(tmp_path: Path) -> None:
    """top_k, min_p and the three penalties are job defaults; a row's own value wins; a bad
    type in a row is a reject with its line, not a server error."""
    gen = GenerationConfig(top_k=20, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.1,
                           repetition_penalty=1.05)
    p = rows(tmp_path / "in.jsonl", [
        {"id": "a", "messages": [{"role": "user", "content": "q"}]},
        {"id": "b", "messages": [{"role": "user", "content": "q"}], "top_k": 5, "params": {"min_p": 0.2}},
        {"id": "c", "messages": [{"role": "user", "content": "q"}], "presence_penalty": "high"},
        {"id": "d", "messages": [{"role": "user", "content": "q"}], "seed": 2**70},
    ])
    a, b, c, d = list(iter_input(p, gen))
    # a seed past 64 bits: the server would refuse it, and the store could not hold it
    assert isinstance(d, Reject) and "seed must be a 64-bit integer" in d.reason
    assert isinstance(a, Request) and isinstance(b, Request)
    assert {k: a.params[k] for k in ("top_k", "min_p", "presence_penalty", "frequency_penalty",
                                     "repetition_penalty")} == {"top_k": 20, "min_p": 0.05, "presence_penalty": 0.5,
                                                                "frequency_penalty": 0.1, "repetition_penalty": 1.05}
    assert b.params["top_k"] == 5 and b.params["min_p"] == 0.2 and b.params["presence_penalty"] == 0.5
    assert isinstance(c, Reject) and c.line == 3 and "presence_penalty must be a number" in c.reason
    assert "top_k" not in next(iter(iter_input(p, GenerationConfig()))).params  # unset: not sent


def test_reasoning_effort_is_weighted_seeded_by_row_and_a_row_may_choose(tmp_path: Path) -> None:
    """The draw depends on the job seed and the row id only (same on resume, in another
    process), follows the weights, and never overrides a row's own reasoning_effort."""
    gen = GenerationConfig(reasoning_effort={"low": 4, "medium": 4, "high": 2}, seed=3)
    plan, again = RowPlan(gen), RowPlan(gen)
    ids = [f"row-{i}" for i in range(3000)]
    draws = [plan.effort(i) for i in ids]
    assert draws == [again.effort(i) for i in ids]
    n = Counter(draws)
    assert set(n) == {"low", "medium", "high"}
    assert 0.35 < n["low"] / 3000 < 0.45 and 0.35 < n["medium"] / 3000 < 0.45 and 0.15 < n["high"] / 3000 < 0.25
    other = RowPlan(GenerationConfig(reasoning_effort={"low": 4, "medium": 4, "high": 2}, seed=4))
    assert [other.effort(i) for i in ids] != draws, "the job seed changes the draw"
    own = Request("x", 1, [{"role": "user", "content": "q"}], {"reasoning_effort": "high"})
    assert plan.work(own).params["reasoning_effort"] == "high"
    drawn = plan.work(Request("row-7", 1, [{"role": "user", "content": "q"}], {}))
    assert drawn.params["reasoning_effort"] == draws[7]


def test_reasoning_effort_weights_are_checked() -> None:
    with pytest.raises(ValueError, match="weight > 0"):
        GenerationConfig(reasoning_effort={"low": 0})


def test_limit_reads_only_the_first_rows(tmp_path: Path) -> None:
    """--limit N: only the first N input rows (rejects included) are read; the CLI refuses 0."""
    p = rows(tmp_path / "in.jsonl", [{"id": f"r{i}", "messages": [{"role": "user", "content": "q"}]}
                                     for i in range(10)])
    assert [r.id for r in iter_input(p, GenerationConfig(limit=3))] == ["r0", "r1", "r2"]
    args = build_parser().parse_args(["generate", "-c", "f.toml", "--input", "x", "--output", "y", "--limit", "5"])
    assert args.limit == 5
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "-c", "f.toml", "--input", "x", "--output", "y", "--limit", "0"])


def test_knobs_reach_the_server_and_the_row_end_to_end(tmp_path: Path, sims) -> None:  # noqa: F811
    """On the sim: --limit 12 of 20 rows; each stored row records the params as sent (penalties,
    top_k, its drawn reasoning_effort) and the input's extra fields; a second run without the
    limit goes on with the other 8 only."""
    s = sims()
    items = [{"id": f"r{i}", "source": "unit", "n": i, "conversations": [
        {"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "old"}]} for i in range(20)]
    inp, out = rows(tmp_path / "in.jsonl", items), tmp_path / "out"
    gen = {"max_tokens": 16, "top_k": 20, "presence_penalty": 0.3, "reasoning_effort": {"low": 1, "high": 1},
           "limit": 12}
    cfg = FleetConfig(name="t", engine={"kind": "sim"}, generation=gen)
    entry = [ServerEntry(node="local", index=0, url=s.url, model="sim-model")]
    assert run_local(cfg, inp, out, entry, flush_interval_s=0.5, progress_interval_s=0.2) == 0
    got = read_results(out).to_pylist()
    assert sorted(r["id"] for r in got) == sorted(f"r{i}" for i in range(12))
    plan = RowPlan(cfg.generation)
    for r in got:
        p = params_from_arrow(r["params"])
        assert p["top_k"] == 20 and p["presence_penalty"] == 0.3 and p["reasoning_effort"] == plan.effort(r["id"])
        assert json.loads(r["extra"]) == {"source": "unit", "n": int(r["id"][1:])}
    assert json.loads((out / "progress.json").read_text())["rows_total"] == 12
    cfg.generation.limit = None
    assert run_local(cfg, inp, out, entry, flush_interval_s=0.5, progress_interval_s=0.2) == 0
    assert len(read_results(out)) == 20 and account(inp, out, cfg.generation)["ok"]
