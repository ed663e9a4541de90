"""Checks on a generation job's output, streamed shard by shard.

`data_checks(DIR)`: is this a usable drafter training set? For the manifest:

    rows                       completed rows
    cut_at_max_tokens          finish_reason == "length": the answer was cut off
    empty_completions          completion empty after stripping whitespace, and no tool calls
                               (a tool-call-only answer is not empty)
    think_tags                 completion still holding "<think>" or "</think>": the server's
                               reasoning parser did not separate the reasoning (wrong
                               --reasoning-parser, or none)
    with_reasoning, with_tool_calls, finish_reasons
    completion_tokens          mean / p50 / p95 / max

Each count comes with its share of rows (`*_share`, None for an empty job).

`account(INPUT, DIR)`: the exactly-once proof. Reads the input again and checks that every
request id ended in exactly one of completed / errors, every rejected line is in
rejects.jsonl, and no id is in two result rows. Exact (strings, not digests), so it can
run at the end of a job and in tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from fleet.generation.data.inputs import iter_input
from fleet.generation.data.rows import InputStats, Reject
from fleet.generation.data.results import iter_results, read_errors, read_quality_rejects, read_rejects

if TYPE_CHECKING:
    from fleet.config import GenerationConfig

__all__ = ["data_checks", "account", "quality_summary", "sum_checks", "job_checks"]

_THINK = ("<think>", "</think>")


def _share(n: int, rows: int) -> float | None:
    return n / rows if rows else None


def _count(mask: pa.Array) -> int:
    return int(pc.sum(pc.cast(pc.fill_null(mask, False), pa.int64())).as_py() or 0)


def data_checks(out_dir: str | Path) -> dict[str, Any]:
    """Quality numbers of the completed rows in `out_dir` (see the module docstring)."""
    rows = cut = empty = think = reasoning = tools = multi = 0
    finish: dict[str, int] = {}
    flagged: dict[str, int] = {}
    tokens: list[pa.Array] = []
    cols = ["completion", "finish_reason", "completion_tokens", "tool_calls", "reasoning_content", "flags", "turns"]
    for batch in iter_results(out_dir, cols):
        rows += batch.num_rows
        comp = batch.column("completion")
        fr = batch.column("finish_reason")
        has_tools = pc.is_valid(batch.column("tool_calls"))
        cut += _count(pc.equal(fr, "length"))
        blank = pc.fill_null(pc.equal(pc.utf8_trim_whitespace(comp), ""), True)
        empty += _count(pc.and_(blank, pc.invert(has_tools)))
        think += _count(pc.or_(pc.match_substring(comp, _THINK[0]), pc.match_substring(comp, _THINK[1])))
        rc = batch.column("reasoning_content")
        reasoning += _count(pc.greater(pc.utf8_length(rc), 0))
        tools += _count(has_tools)
        vc = pc.value_counts(pc.fill_null(fr, "null"))
        for v, c in zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()):
            finish[v] = finish.get(v, 0) + c
        tokens.append(pc.drop_null(batch.column("completion_tokens")))
        flags = pc.list_flatten(batch.column("flags"))
        if len(flags):
            vc = pc.value_counts(flags)
            for v, c in zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()):
                flagged[v] = flagged.get(v, 0) + c
        multi += _count(pc.greater(batch.column("turns"), 1))
    toks = pa.chunked_array(tokens, pa.int64()) if tokens else pa.chunked_array([], pa.int64())
    hist: dict[int, int] = {}
    if len(toks):
        vc = pc.value_counts(toks)
        hist = dict(zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()))
    return _checks(rows, cut, empty, think, reasoning, tools, finish, flagged, multi, hist)


def _quantile(hist: list[tuple[int, int]], n: int, q: float) -> float:
    """The `q` quantile of the `n` values whose (value, count) pairs are `hist` (ascending): linear
    interpolation between the two values around position q × (n - 1), as pyarrow's `quantile` does."""
    pos = q * (n - 1)
    lo, frac = int(pos), pos - int(pos)

    def at(k: int) -> int:
        seen = 0
        for v, c in hist:
            seen += c
            if k < seen:
                return v
        return hist[-1][0]

    a = at(lo)
    return float(a) if frac == 0 else a + (at(lo + 1) - a) * frac


def _checks(rows: int, cut: int, empty: int, think: int, reasoning: int, tools: int, finish: dict[str, int],
            flagged: dict[str, int], multi: int, hist: dict[int, int]) -> dict[str, Any]:
    pairs = sorted(hist.items())
    n = sum(c for _, c in pairs)
    tok_stats: dict[str, Any]
    if n:
        total = sum(v * c for v, c in pairs)
        tok_stats = {"mean": total / n, "p50": _quantile(pairs, n, 0.5), "p95": _quantile(pairs, n, 0.95),
                     "max": pairs[-1][0], "total": total, "rows": n}
    else:
        tok_stats = {"mean": None, "p50": None, "p95": None, "max": None, "total": 0, "rows": 0}
    return {
        "rows": rows,
        "cut_at_max_tokens": cut, "cut_at_max_tokens_share": _share(cut, rows),
        "empty_completions": empty, "empty_completions_share": _share(empty, rows),
        "think_tags": think, "think_tags_share": _share(think, rows),
        "with_reasoning": reasoning, "with_reasoning_share": _share(reasoning, rows),
        "with_tool_calls": tools, "with_tool_calls_share": _share(tools, rows),
        "finish_reasons": dict(sorted(finish.items())),
        "flagged": dict(sorted(flagged.items())),  # quality gate -> rows stored with its flag
        "multi_turn_rows": multi,
        "completion_tokens": tok_stats,
        # every completion's token count as [value, rows] pairs: at most max_tokens of them, so the checks
        # of a job's chunks sum to the job's exactly, quantiles included (`sum_checks`)
        "completion_tokens_hist": [[v, c] for v, c in pairs],
    }


def sum_checks(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The checks of one output made of several (a multi-node job's chunks, each checked by its own
    runner), from their counts alone: exact, the token quantiles too (from the summed histograms). None
    when a part has none to sum (an error, or checks from before the histogram was kept)."""
    rows = cut = empty = think = reasoning = tools = multi = 0
    finish: dict[str, int] = {}
    flagged: dict[str, int] = {}
    hist: dict[int, int] = {}
    for p in parts:
        if not isinstance(p, dict) or "error" in p or not isinstance(p.get("completion_tokens_hist"), list):
            return None
        rows += int(p["rows"])
        cut += int(p["cut_at_max_tokens"])
        empty += int(p["empty_completions"])
        think += int(p["think_tags"])
        reasoning += int(p["with_reasoning"])
        tools += int(p["with_tool_calls"])
        multi += int(p["multi_turn_rows"])
        for into, d in ((finish, p["finish_reasons"]), (flagged, p["flagged"])):
            for k, v in d.items():
                into[k] = into.get(k, 0) + int(v)
        for v, c in p["completion_tokens_hist"]:
            hist[int(v)] = hist.get(int(v), 0) + int(c)
    return _checks(rows, cut, empty, think, reasoning, tools, finish, flagged, multi, hist)


def quality_summary(out_dir: str | Path, this_run: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the quality gates did, across every run into `out_dir` (flags from the shards,
    rejections from quality_rejects.jsonl), plus this run's retries."""
    rejected: dict[str, int] = {}
    rejected_rows = 0
    for rec in read_quality_rejects(out_dir):
        rejected_rows += 1
        for r in rec.get("reasons") or []:
            rejected[r] = rejected.get(r, 0) + 1
    flagged: dict[str, int] = {}
    flagged_rows = 0
    for batch in iter_results(out_dir, ["flags"]):
        col = batch.column("flags")
        flagged_rows += len(col) - col.null_count
        flat = pc.list_flatten(col)
        if len(flat):
            vc = pc.value_counts(flat)
            for v, c in zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()):
                flagged[v] = flagged.get(v, 0) + c
    return {"flagged_rows": flagged_rows, "flagged": dict(sorted(flagged.items())),
            "rejected_rows": rejected_rows, "rejected": dict(sorted(rejected.items())),
            "this_run": this_run or {}}


def account(input_path: str | Path, out_dir: str | Path,
            defaults: GenerationConfig | None = None, *, sample: int = 10) -> dict[str, Any]:
    """Check that every input row ended in exactly one place; `ok` says whether all holds.

    Holds every request id of the input as Arrow strings (tens of MB for a million ids):
    meant for the end of a job and for tests, not for the hot path.
    """
    st = InputStats()
    chunks: list[pa.Array] = []
    pending: list[str] = []
    input_reject_lines: set[int] = set()
    for item in iter_input(input_path, defaults, stats=st):
        if isinstance(item, Reject):
            input_reject_lines.add(item.line)
            continue
        pending.append(item.id)
        if len(pending) >= 65536:
            chunks.append(pa.array(pending, pa.string()))
            pending = []
    chunks.append(pa.array(pending, pa.string()))
    requests = pa.chunked_array(chunks, pa.string())

    completed = pa.chunked_array([b.column("id") for b in iter_results(out_dir, ["id"])], pa.string())
    error_ids = [str(r["id"]) for r in read_errors(out_dir)]
    quality_ids = [str(r["id"]) for r in read_quality_rejects(out_dir)]
    # a row a quality gate rejected ended too: for exactly-once it counts like an error
    errors = pa.array(error_ids + quality_ids, pa.string())
    reject_lines = {r["line"] for r in read_rejects(out_dir) if isinstance(r.get("line"), int)}

    def first(arr: Any) -> list[str]:
        ids: list[str] = arr.slice(0, sample).to_pylist()  # Arrow strings (pyarrow is untyped)
        return ids

    vc = pc.value_counts(completed) if len(completed) else None
    duplicated = (pc.filter(vc.field("values"), pc.greater(vc.field("counts"), 1))
                  if vc is not None else pa.array([], pa.string()))
    err_counts = pc.value_counts(errors) if len(errors) else None
    err_dup = (pc.filter(err_counts.field("values"), pc.greater(err_counts.field("counts"), 1))
               if err_counts is not None else pa.array([], pa.string()))
    done = pa.chunked_array(list(completed.chunks) + [errors], pa.string())
    done_values = pc.unique(done) if len(done) else pa.array([], pa.string())
    missing = pc.filter(requests, pc.invert(pc.is_in(requests, value_set=done_values)))
    req_values = pc.unique(requests) if len(requests) else pa.array([], pa.string())
    unexpected = pc.filter(done_values, pc.invert(pc.is_in(done_values, value_set=req_values)))
    both = pc.filter(errors, pc.is_in(errors, value_set=pc.unique(completed) if len(completed)
                                      else pa.array([], pa.string())))
    unrecorded = sorted(input_reject_lines - reject_lines)
    result = {
        "input_rows": st.rows, "blank_lines": st.blank, "requests": st.requests,
        "input_rejects": st.rejects, "input_duplicates": st.duplicates,
        "completed": len(completed), "errors": len(error_ids), "quality_rejects": len(quality_ids),
        "rejects": len(reject_lines),
        "missing": len(missing), "missing_ids": first(missing),
        "duplicated": len(duplicated) + len(err_dup), "duplicated_ids": first(duplicated) + first(err_dup),
        "completed_and_errored": len(both), "completed_and_errored_ids": first(both),
        "unexpected": len(unexpected), "unexpected_ids": first(unexpected),
        "unrecorded_rejects": len(unrecorded), "unrecorded_reject_lines": unrecorded[:sample],
    }
    result["ok"] = not (result["missing"] or result["duplicated"] or result["completed_and_errored"]
                        or result["unexpected"] or result["unrecorded_rejects"])
    return result


def job_checks(dest: str | Path, sources: int, counting: dict[int, dict[str, Any]],
               kept: list[int]) -> tuple[dict[str, Any], str]:
    """A multi-node job's data checks and how they were had. Each chunk's runner checked its own output
    (its manifest's `checks`: `counting`, by merge source index); their sum is the job's exactly when the
    merge kept (`kept`: rows kept per source) every row of those attempts and none of any other (no id
    dropped as a duplicate, no row from an abandoned attempt): then nothing of the output is read. Else
    (or a chunk without summable checks) the output's check columns are read, as before."""
    if len(kept) == sources and all(
            kept[i] == (int(counting[i].get("rows") or 0) if i in counting else 0) for i in range(sources)):
        summed = sum_checks(list(counting.values()))
        if summed is not None:
            return summed, "summed from each chunk's own checks (its runner's)"
    try:   # on object storage too: the merged shards' check columns streamed from the store
        return data_checks(dest), "read from the merged output"
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}, "read from the merged output"
