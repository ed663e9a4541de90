"""Pictures where they read better: throughput over time and tokens per server, as markdown.

Plain text that the Prefect UI renders as it is (no image hosting, no JavaScript): a
sparkline of tok/s over time in a code block (monospace, so the time axis is true), and a
table of tokens per server with a bar each. Pure functions build the text; one function
writes it as an artifact.

    series      [{"t": seconds since start, "tok_s": tokens per second}, ...] (any order, gaps ok)
    per_server  {"node/0": tokens, ...} or [{"server": "node/0", "tokens": n}, ...]
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

SPARK = "▁▂▃▄▅▆▇█"
EIGHTHS = " ▏▎▍▌▋▊▉"   # partial blocks for bar ends
FULL = "█"


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def resample(series: Sequence[Mapping[str, Any]], width: int) -> tuple[list[float | None], float, float]:
    """Mean tok/s per time bucket: (`width` buckets, None where no sample fell), t0, t1."""
    pts = sorted((t, v) for t, v in ((_num(p.get("t")), _num(p.get("tok_s"))) for p in series)
                 if t is not None and v is not None)
    if not pts:
        return [], 0.0, 0.0
    t0, t1 = pts[0][0], pts[-1][0]
    if t1 <= t0 or len(pts) <= width:
        if t1 <= t0:
            return [sum(v for _, v in pts) / len(pts)], t0, t1
        width = min(width, len(pts))
    sums = [0.0] * width
    counts = [0] * width
    span = t1 - t0
    for t, v in pts:
        i = min(width - 1, int((t - t0) / span * width))
        sums[i] += v
        counts[i] += 1
    return [s / c if c else None for s, c in zip(sums, counts, strict=True)], t0, t1


def sparkline(values: Sequence[float | None], lo: float | None = None, hi: float | None = None) -> str:
    """One character per value, ▁ (lowest) to █ (highest); a space where there is no value."""
    known = [v for v in values if v is not None]
    if not known:
        return ""
    lo = min(known) if lo is None else lo
    hi = max(known) if hi is None else hi
    out = []
    for v in values:
        if v is None:
            out.append(" ")
        elif hi <= lo:
            out.append(SPARK[-1] if hi > 0 else SPARK[0])
        else:
            out.append(SPARK[max(0, min(len(SPARK) - 1, round((v - lo) / (hi - lo) * (len(SPARK) - 1))))])
    return "".join(out)


def bar(value: float, max_value: float, width: int = 24) -> str:
    """A horizontal bar in eighths of a character; `width` characters stand for max_value."""
    if max_value <= 0 or value <= 0:
        return ""
    eighths = round(min(value, max_value) / max_value * width * 8)
    full, part = divmod(eighths, 8)
    return FULL * full + (EIGHTHS[part] if part else "")


def human_duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    h, rem = divmod(int(seconds), 3600)
    return f"{h} h {rem // 60:02d} min" if h < 48 else f"{seconds / 86400:.1f} days"


def _per_server_items(per_server: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> list[tuple[str, float]]:
    if isinstance(per_server, Mapping):
        items = [(str(k), _num(v)) for k, v in per_server.items()]
    else:
        items = [(str(r.get("server")), _num(r.get("tokens"))) for r in per_server]
    return [(k, v) for k, v in items if v is not None]


def throughput_chart(series: Sequence[Mapping[str, Any]], width: int = 60) -> str:
    """The sparkline block with its axis: the bucket peak on top, the bucket low below, the span under it.

    The scale runs from the lowest to the highest bucket (not from zero), so a dip of a few
    percent (a server lost and re-admitted) shows; the two labels give the true range.
    """
    values, t0, t1 = resample(series, width)
    known = [v for v in values if v is not None]
    if not known:
        return "_no throughput samples yet_"
    lo, hi = min(known), max(known)
    line = sparkline(values, lo=lo, hi=hi)
    label_hi, label_lo = f"{hi:,.0f} tok/s", f"{lo:,.0f} tok/s"
    pad = max(len(label_hi), len(label_lo))
    start, end = "0 s", human_duration(t1 - t0)
    axis = " " * (pad + 2) + start
    if t1 > t0:
        axis += " " * max(1, len(line) - len(start) - len(end)) + end
    return "\n".join([
        "```",
        f"{label_hi.rjust(pad)} ┤{line}",
        f"{label_lo.rjust(pad)} └{'─' * len(line)}",
        axis,
        "```",
    ])


def tokens_table(per_server: Mapping[str, Any] | Sequence[Mapping[str, Any]], width: int = 24) -> str:
    items = _per_server_items(per_server)
    if not items:
        return "_no tokens yet_"
    total = sum(v for _, v in items)
    top = max(v for _, v in items)
    lines = ["| server | tokens | share | |", "| --- | ---: | ---: | --- |"]
    for name, v in sorted(items, key=lambda kv: kv[0]):
        share = v / total if total else 0.0
        lines.append(f"| {name} | {v:,.0f} | {share:.1%} | `{bar(v, top, width) or '·'}` |")
    lines.append(f"| **total** | **{total:,.0f}** | | |")
    return "\n".join(lines)


def throughput_markdown(series: Sequence[Mapping[str, Any]],
                        per_server: Mapping[str, Any] | Sequence[Mapping[str, Any]],
                        title: str = "Generation throughput", width: int = 60) -> str:
    """The whole artifact: heading, stats line, sparkline, per-server table."""
    vals = [v for v in (_num(p.get("tok_s")) for p in series) if v is not None]
    parts = [f"## {title}"]
    if vals:
        last = max(series, key=lambda p: _num(p.get("t")) or 0.0)
        parts.append(f"tok/s — mean **{sum(vals) / len(vals):,.0f}**, peak {max(vals):,.0f}, "
                     f"last {(_num(last.get('tok_s')) or 0):,.0f}; {len(vals)} samples")
    parts += [throughput_chart(series, width), "### Tokens per server", tokens_table(per_server)]
    return "\n\n".join(parts)


def write_throughput_artifact(cfg: Any, series: Sequence[Mapping[str, Any]],
                              per_server: Mapping[str, Any] | Sequence[Mapping[str, Any]], *,
                              key_parts: tuple[object, ...] = ("generation", "throughput"),
                              title: str = "Generation throughput") -> str:
    """Write the chart as a markdown artifact `<fleet>-generation-throughput`; return the markdown."""
    from prefect.artifacts import create_markdown_artifact

    from tasks.audit import artifact_key

    md = throughput_markdown(series, per_server, title)
    create_markdown_artifact(md, key=artifact_key(cfg, *key_parts), description=title)
    return md
