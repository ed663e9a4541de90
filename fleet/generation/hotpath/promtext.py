"""Prometheus text format, read just far enough to follow an engine's token counters.

    samples = parse(text, names)      # [(name, labels, value)] of the named series only
    token_count(text)                 # the engine's token-progress total, or None
    generated_tokens(text)            # tokens it has generated so far, as it decodes, or None

An engine's `/metrics` body is large (every histogram bucket, once per tensor-parallel rank)
and is read every few seconds per server, so `parse` keeps only the lines whose metric name
is asked for (a `str.startswith` on a tuple, before any split) and never builds the rest.

Which series say "the server generates" (`PROGRESS`):

| engine | series | advances |
| --- | --- | --- |
| SGLang ≥ 0.5 | `sglang:realtime_tokens_total{mode=prefill_compute/prefill_cache/decode}` | every scheduler log interval (40 decode steps; each prefill batch) |
| SGLang | `sglang:inter_token_latency_seconds_count` | each batch of tokens the tokenizer receives (every 50 tokens of a non-streamed request) |
| SGLang | `sglang:generation_tokens_total`, `sglang:prompt_tokens_total` | only when a request *finishes* (a fallback: old versions) |
| vLLM (V1) | `vllm:generation_tokens_total`, `vllm:prompt_tokens_total` | every engine step |
| fleet's sim | SGLang's names | as it decodes |

Newer SGLang builds spell the prefix `sglang_` (prometheus multiprocess mode); both count.
The total is a sum of counters: it moves whenever any of them moves, and a server that
restarted (counters back to zero) moves it too, which is right — it is not wedged.

Which series count generated tokens *as they are generated* (`generated_tokens`: the job's rate
and ETA, rows of minutes included): vLLM's `generation_tokens_total` (every step, summed over
its data-parallel engines) and SGLang's `realtime_tokens_total{mode="decode"}` (every log
interval). SGLang's `generation_tokens_total` is not one of them: it moves only when a request
finishes, so with rows of minutes it says no more than the finished rows do (the job counts
those itself, and estimates the rows in flight: `fleet.generation.hotpath.tokens`).
"""

from __future__ import annotations

import math

__all__ = ["GENERATED", "PROGRESS", "generated_tokens", "parse", "token_count"]

Sample = tuple[str, dict[str, str], float]

# The series whose sum is the server's token progress (see the table above).
PROGRESS: tuple[str, ...] = tuple(
    f"{prefix}{name}"
    for prefix in ("sglang:", "sglang_")
    for name in ("realtime_tokens_total", "inter_token_latency_seconds_count", "generation_tokens_total",
                 "prompt_tokens_total")
) + ("vllm:generation_tokens_total", "vllm:prompt_tokens_total")

# The series that count generated tokens as they decode (see the module docstring).
_VLLM_GENERATED = "vllm:generation_tokens_total"
_SGLANG_REALTIME = ("sglang:realtime_tokens_total", "sglang_realtime_tokens_total")
GENERATED: tuple[str, ...] = (_VLLM_GENERATED, *_SGLANG_REALTIME)


def _labels(body: str) -> dict[str, str] | None:
    """`a="x",b="y\\"z"` -> {"a": "x", "b": 'y"z'}; None when malformed."""
    out: dict[str, str] = {}
    i, n = 0, len(body)
    while i < n:
        while i < n and body[i] in " ,":
            i += 1
        if i >= n:
            break
        eq = body.find("=", i)
        if eq < 0 or eq + 1 >= n or body[eq + 1] != '"':
            return None
        key = body[i:eq].strip()
        j, chars = eq + 2, []
        while j < n and body[j] != '"':
            if body[j] == "\\" and j + 1 < n:
                j += 1
                chars.append({"n": "\n"}.get(body[j], body[j]))
            else:
                chars.append(body[j])
            j += 1
        if j >= n:
            return None
        out[key] = "".join(chars)
        i = j + 1
    return out


def _sample(line: str) -> Sample | None:
    """One sample line (`name{labels} value [timestamp]`), or None when it is not one."""
    brace = line.find("{")
    space = line.find(" ")
    if brace >= 0 and (space < 0 or brace < space):
        close = line.rfind("}")
        if close < brace:
            return None
        name, labels, rest = line[:brace], _labels(line[brace + 1:close]), line[close + 1:]
        if labels is None:
            return None
    else:
        if space < 0:
            return None
        name, labels, rest = line[:space], {}, line[space:]
    fields = rest.split()
    if not fields:
        return None
    try:
        value = float(fields[0])   # also "+Inf", "NaN", "1.2e+06"
    except ValueError:
        return None
    return name.strip(), labels, value


def parse(text: str, names: tuple[str, ...]) -> list[Sample]:
    """The samples of the metrics named `names` (exact names: `x_total`, `x_count`, …)."""
    wanted = set(names)
    out: list[Sample] = []
    for line in text.splitlines():
        if not line.startswith(names):   # comments, and every series not asked for
            continue
        s = _sample(line)
        if s is not None and s[0] in wanted:
            out.append(s)
    return out


def token_count(text: str) -> float | None:
    """The sum of the engine's token-progress counters (`PROGRESS`); None when it has none."""
    samples = parse(text, PROGRESS)
    values = [v for _, _, v in samples if math.isfinite(v)]
    return sum(values) if values else None


def generated_tokens(text: str) -> float | None:
    """Tokens the engine has generated so far, counted as it decodes (`GENERATED`); None when it
    has no such counter (an SGLang build that counts tokens only when a request finishes)."""
    values = [v for name, labels, v in parse(text, GENERATED)
              if math.isfinite(v) and (name == _VLLM_GENERATED or labels.get("mode") == "decode")]
    return sum(values) if values else None
