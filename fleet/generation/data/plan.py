"""`fleet plan`: how long a generation job takes and what its tokens cost.

The rate is **per GPU** by default: it is what one server on one GPU reports (SGLang's
`gen throughput (token/s)` log line, a bench against one server) and what a price per
GPU-hour is quoted against, so the same number carries from a one-GPU test to a node of
eight. Pass `tokens_per_s_is_per_gpu=False` when the rate given is the whole fleet's.
With tensor parallelism, "per GPU" is the server's rate divided by its GPUs.

    total tokens  = completions x avg_output_tokens
    fleet rate    = tokens_per_s x gpus                    (per-GPU rate)
    wall          = total tokens / fleet rate
    GPU-hours     = wall_h x gpus
    $ total       = GPU-hours x price_per_gpu_hour
    $ per M tok   = price_per_gpu_hour / (3600 x per-GPU rate / 1e6)   (independent of job size)

Output tokens only: prefill is paid for inside the measured decode rate, which is why the
rate should come from a run with realistic prompts. The seed job's arithmetic, made
consistent (tests/test_gen_export.py::test_plan_seed_job): 902,087 completions x 2,000
tokens on 4 GPUs at 316 tok/s per GPU is 16.5 days; 8 B200s at 1,470-2,600 tok/s per GPU and
$4.60 per GPU-hour is 1.8-1.0 days at $0.87-0.49 per M tokens.
"""

from __future__ import annotations

from typing import Any

__all__ = ["plan", "format_plan"]


def plan(
    *,
    completions: int,
    avg_output_tokens: float,
    tokens_per_s: float,
    price_per_gpu_hour: float | None = None,
    gpus: int = 1,
    tokens_per_s_is_per_gpu: bool = True,
) -> dict[str, Any]:
    """Wall time, GPU-hours and cost of generating `completions` rows (see the module docstring)."""
    if completions < 0:
        raise ValueError(f"completions must be >= 0, got {completions}")
    if avg_output_tokens <= 0:
        raise ValueError(f"avg_output_tokens must be > 0, got {avg_output_tokens}")
    if tokens_per_s <= 0:
        raise ValueError(f"tokens_per_s must be > 0, got {tokens_per_s}")
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    if price_per_gpu_hour is not None and price_per_gpu_hour < 0:
        raise ValueError(f"price_per_gpu_hour must be >= 0, got {price_per_gpu_hour}")
    per_gpu = tokens_per_s if tokens_per_s_is_per_gpu else tokens_per_s / gpus
    total_rate = per_gpu * gpus
    total_tokens = completions * avg_output_tokens
    wall_s = total_tokens / total_rate
    gpu_hours = wall_s / 3600 * gpus
    cost = gpu_hours * price_per_gpu_hour if price_per_gpu_hour is not None else None
    per_m = price_per_gpu_hour / (3600 * per_gpu / 1e6) if price_per_gpu_hour is not None else None
    return {
        "completions": completions,
        "avg_output_tokens": avg_output_tokens,
        "total_tokens": total_tokens,
        "gpus": gpus,
        "tokens_per_s_per_gpu": per_gpu,
        "tokens_per_s_total": total_rate,
        "wall_s": wall_s,
        "wall_h": wall_s / 3600,
        "wall_days": wall_s / 86400,
        "gpu_hours": gpu_hours,
        "price_per_gpu_hour": price_per_gpu_hour,
        "cost_usd": cost,
        "usd_per_m_tokens": per_m,
    }


def _duration(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 2 * 3600:
        return f"{s / 60:.1f} min"
    if s < 2 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days ({s / 3600:.0f} h)"


def format_plan(d: dict[str, Any]) -> str:
    """The plan as a few aligned lines for the CLI."""
    lines = [
        ("completions", f"{d['completions']:,} x {d['avg_output_tokens']:,.0f} tokens = "
                        f"{d['total_tokens'] / 1e6:,.1f} M output tokens"),
        ("rate", f"{d['tokens_per_s_per_gpu']:,.0f} tok/s per GPU x {d['gpus']} GPUs = "
                 f"{d['tokens_per_s_total']:,.0f} tok/s"),
        ("wall time", _duration(d["wall_s"])),
        ("GPU-hours", f"{d['gpu_hours']:,.1f}"),
    ]
    if d.get("cost_usd") is not None:
        lines.append(("cost", f"${d['cost_usd']:,.2f} at ${d['price_per_gpu_hour']:,.2f} per GPU-hour"))
        lines.append(("$ per M tokens", f"${d['usd_per_m_tokens']:,.3f}"))
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in lines)
