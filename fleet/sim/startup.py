"""Startup: SGLang's lines from ``server_args=...`` to ``The server is fired up and ready to roll!``,
spread over ``--startup-s``; the engine turns ready at the end.

Faults at start: ``--oom-at-start`` dies here with SGLang's OOM lines (``fleet.sim.faults``),
``--hang-at-start`` stops at ``Capture cuda graph begin`` and stays alive.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass

from fleet.sim import faults
from fleet.sim.determinism import hash_ints
from fleet.sim.engine import (CHUNKED_PREFILL, DRAFT_WEIGHTS_GB, GB, GPU_TOTAL_GB, GRAPH_GB,
                              KV_BYTES_PER_TOKEN_HALF, MAX_PREFILL, SPEC_NUM_STEPS, WEIGHTS_GB, Engine)
from fleet.sim.log import Log


def _server_args_line(args: argparse.Namespace) -> str:
    spec = args.speculative_algorithm
    fields = [
        ("model_path", args.model_path), ("tokenizer_path", args.model_path),
        ("tokenizer_mode", "auto"), ("load_format", "auto"), ("trust_remote_code", True),
        ("context_length", args.context_length), ("dtype", "auto"),
        ("host", args.host), ("port", args.port), ("mem_fraction_static", 0.88),
        ("max_running_requests", args.max_running_requests), ("max_total_tokens", None),
        ("chunked_prefill_size", CHUNKED_PREFILL), ("max_prefill_tokens", MAX_PREFILL),
        ("tp_size", 1), ("random_seed", args.seed), ("api_key", "***" if args.api_key else None),
        ("served_model_name", args.model_name), ("enable_metrics", True),
        ("speculative_algorithm", spec),
        ("speculative_num_steps", SPEC_NUM_STEPS if spec else None),
        ("speculative_num_draft_tokens", SPEC_NUM_STEPS + 1 if spec else None),
    ]
    return "server_args=ServerArgs(" + ", ".join(f"{k}={v!r}" for k, v in fields) + ")"


class _Timeline:
    """Waits until a share of --startup-s has passed since startup began."""

    def __init__(self, total: float) -> None:
        self.t0 = time.monotonic()
        self.total = total

    async def at(self, frac: float) -> None:
        delay = self.t0 + frac * self.total - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)


@dataclass
class _Memory:
    """The GPU memory figures the startup lines print (GB), from the KV cache size."""

    kv: int
    kv_half_gb: float
    avail0: float
    avail_w: float
    avail_kv: float
    avail_g: float

    @classmethod
    def of(cls, kv: int) -> _Memory:
        kv_half_gb = kv * KV_BYTES_PER_TOKEN_HALF / GB
        avail0 = GPU_TOTAL_GB - 0.53
        avail_w = avail0 - WEIGHTS_GB
        avail_kv = max(avail_w - 2 * kv_half_gb, 1.0)
        avail_g = max(avail_kv - GRAPH_GB, 0.5)
        return cls(kv, kv_half_gb, avail0, avail_w, avail_kv, avail_g)


async def startup(args: argparse.Namespace, log: Log, engine: Engine) -> int | None:
    """Print SGLang's startup lines spread over --startup-s, then mark the engine ready.

    Returns 1 after an --oom-at-start death, never returns under --hang-at-start, None
    when ready.
    """
    t = _Timeline(float(args.startup_s))
    mem = _Memory.of(args.kv_cache_tokens)

    log.info(_server_args_line(args))
    log.info("Using default HuggingFace chat template with detected content format: string")
    if not await _load_model(args, log, t, mem):
        return 1
    await _capture_graph(args, log, t, mem)
    avail_g = mem.avail_g
    if args.speculative_algorithm:
        avail_g = await _load_draft_model(log, t, mem)
    await _serve_lines(args, log, t, mem.kv, avail_g)
    engine.ready = True
    log.info("The server is fired up and ready to roll!")
    return None


async def _load_model(args: argparse.Namespace, log: Log, t: _Timeline, m: _Memory) -> bool:
    """Weights, then the KV cache; False after an --oom-at-start death (its lines printed)."""
    await t.at(0.05)
    log.info("Init torch distributed begin.", tp=True)
    log.info("Init torch distributed ends. mem usage=0.00 GB", tp=True)
    await t.at(0.10)
    log.info(f"Load weight begin. avail mem={m.avail0:.2f} GB", tp=True)
    await t.at(0.35)
    if args.oom_at_start == "weights":
        faults.oom_lines(log, "weights")
        return False
    log.info(f"Load weight end. type=SimForCausalLM, dtype=torch.bfloat16, avail mem={m.avail_w:.2f} GB, "
             f"mem usage={WEIGHTS_GB:.2f} GB.", tp=True)
    await t.at(0.40)
    if args.oom_at_start:
        faults.oom_lines(log, "kv-pool")
        return False
    log.info(f"KV Cache is allocated. #tokens: {m.kv}, K size: {m.kv_half_gb:.2f} GB, "
             f"V size: {m.kv_half_gb:.2f} GB", tp=True)
    log.info(f"Memory pool end. avail mem={m.avail_kv:.2f} GB", tp=True)
    return True


async def _capture_graph(args: argparse.Namespace, log: Log, t: _Timeline, m: _Memory) -> None:
    """CUDA graph capture: where --hang-at-start stops for good."""
    await t.at(0.45)
    log.info(f"Capture cuda graph begin. This can take up to several minutes. "
             f"avail mem={m.avail_kv:.2f} GB", tp=True)
    if args.hang_at_start:
        log.info("sim: --hang-at-start: never becoming ready")
        await asyncio.get_running_loop().create_future()
    await t.at(0.75)
    graph_s = 0.30 * t.total
    log.info(f"Capture cuda graph end. Time elapsed: {graph_s:.2f} s. mem usage={GRAPH_GB:.2f} GB. "
             f"avail mem={m.avail_g:.2f} GB.", tp=True)


async def _load_draft_model(log: Log, t: _Timeline, m: _Memory) -> float:
    """--speculative-algorithm: the draft model's weights, KV cache and graphs; the memory left."""
    avail_d = max(m.avail_g - DRAFT_WEIGHTS_GB, 0.5)
    log.info(f"Load weight begin. avail mem={m.avail_g:.2f} GB", tp=True)
    log.info(f"Load weight end. type=LlamaForCausalLMEagle3, dtype=torch.bfloat16, "
             f"avail mem={avail_d:.2f} GB, mem usage={DRAFT_WEIGHTS_GB:.2f} GB.", tp=True)
    log.info(f"KV Cache is allocated. #tokens: {m.kv}, K size: {m.kv_half_gb / 32:.2f} GB, "
             f"V size: {m.kv_half_gb / 32:.2f} GB", tp=True)
    await t.at(0.80)
    log.info(f"Capture cuda graph begin. This can take up to several minutes. "
             f"avail mem={avail_d:.2f} GB", tp=True)
    await t.at(0.85)
    log.info(f"Capture cuda graph end. Time elapsed: {0.05 * t.total:.2f} s. mem usage=0.21 GB. "
             f"avail mem={max(avail_d - 0.21, 0.5):.2f} GB.", tp=True)
    return max(avail_d - 0.21, 0.5)


async def _serve_lines(args: argparse.Namespace, log: Log, t: _Timeline, kv: int, avail_g: float) -> None:
    """The scheduler's summary, uvicorn's startup lines and the warm-up requests."""
    await t.at(0.88)
    log.info(f"max_total_num_tokens={kv}, chunked_prefill_size={CHUNKED_PREFILL}, "
             f"max_prefill_tokens={MAX_PREFILL}, max_running_requests={args.max_running_requests}, "
             f"context_len={args.context_length}, available_gpu_mem={avail_g:.2f} GB", tp=True)
    await t.at(0.90)
    log.info(f"INFO:     Started server process [{os.getpid()}]")
    log.info("INFO:     Waiting for application startup.")
    log.info("INFO:     Application startup complete.")
    log.info(f"INFO:     Uvicorn running on http://{args.host}:{args.port} (Press CTRL+C to quit)")
    await t.at(0.93)
    log.info(f'INFO:     127.0.0.1:{_warmup_port(args)} - "GET /model_info HTTP/1.1" 200 OK')
    log.info("Prefill batch. #new-seq: 1, #new-token: 7, #cached-token: 0, token usage: 0.00, "
             "#running-req: 0, #queue-req: 0, ", tp=True)
    await t.at(1.0)
    log.info(f'INFO:     127.0.0.1:{_warmup_port(args) + 2} - "POST /generate HTTP/1.1" 200 OK')


def _warmup_port(args: argparse.Namespace) -> int:
    return 40000 + (hash_ints(args.seed, args.port) % 20000)
