"""A multi-node job's ETA and console line, from its nodes' progress files (each a runner's
`progress.json`: fleet.generation.job.progress).

The ETA counts generated tokens as a single node's does (`fleet.generation.job.progress.eta`):
the nodes' token rates summed, tokens per row from their runs' finished rows (max_tokens before
any has finished), less what their rows in flight already have; rows per second only where the
answers carry no token counts. So rows of minutes give an ETA before the first chunk's first row
ends, and never "None".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fleet.generation.job.progress import eta, fmt_s

__all__ = ["format_line", "job_eta"]


def job_eta(remaining: int, running: Iterable[dict[str, Any]], *, tok_s: float, rows_per_s: float,
            max_tokens: int) -> tuple[float | None, str | None]:
    """(seconds to the job's end, its basis) over the progress files of the chunks running now."""
    finished = completion = generated = 0.0
    for p in running:
        finished += float((p.get("this_run") or {}).get("completed") or 0)
        completion += float(p.get("completion_tokens") or 0)
        generated += float(p.get("generated_tokens") or p.get("completion_tokens") or 0)
    return eta(remaining, tok_s=tok_s, rows_per_s=rows_per_s, rows_finished=int(finished),
               completion_tokens=completion, generated_tokens=generated, max_tokens=max_tokens)


def format_line(p: dict[str, Any]) -> str:
    """The CLI's one line for a multi-node job: the same width at any node count (counts of nodes by state;
    each node's detail is in progress.json and the `<fleet>-job-nodes` table: with every node listed it
    was ≈ 1.6 KB at 40 nodes), and no ETA without a rate to base it on."""
    pct = f" ({p['percent']:.1f}%)" if p.get("percent") is not None else ""
    c = p["chunks"]
    nodes = f"nodes {p.get('nodes_up', 0)} up"
    for key, word in (("nodes_lost", "lost"), ("nodes_quarantined", "quarantined")):
        if p.get(key):
            nodes += f", {p[key]} {word}"
    if p.get("nodes_set_aside"):
        nodes += f", {len(p['nodes_set_aside'])} set aside"
    flight = (f" | in flight {p['rows_in_flight']:,}" if p.get("rows_in_flight") else "") + (
        f", oldest {fmt_s(p['oldest_in_flight_s'])}" if p.get("rows_in_flight") and p.get("oldest_in_flight_s") else "")
    rate = f" | {p['tok_s']:,.0f} tok/s" if p.get("tok_s") else ""
    when = "" if p.get("eta_s") is None else \
        f" | ETA {'≤' if p.get('eta_basis') == 'max_tokens' else ''}{fmt_s(p['eta_s'])}"
    return (f"[fleet generate] {p['rows_done']:,}/{p['rows_total']:,}{pct} | chunks {c.get('done', 0)}/"
            f"{p['chunks_total']} done, {c.get('running', 0)} running | {nodes}{flight} | {p['rows_per_s']:.1f} rows/s"
            f"{rate}{when}")
