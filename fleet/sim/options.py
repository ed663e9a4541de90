"""The simulator's command line: its flags (SGLang's where SGLang has one, fault knobs where not)."""

from __future__ import annotations

import argparse

VERSION = "sim-0.1"


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,   # None: argparse names the script; `fleet sim` passes its own name
        description="Simulated SGLang server (stdlib only): SGLang's endpoints and log lines, no GPU.",
    )
    a = p.add_argument
    a("--host", default="127.0.0.1", help="address to bind")
    a("--port", type=int, required=True, help="port to bind")
    a("--model-name", default="sim-model", help="served model name (/v1/models id)")
    a("--model-path", default="/dev/shm/sim-model", help="only reported")
    a("--startup-s", type=float, default=1.0, help="seconds before ready (503 until then)")
    a("--first-request-delay-s", type=float, default=0.0,
      help="extra delay on the first generation request only (kernel warm-up)")
    a("--tokens-per-s", type=float, default=2000.0, help="decode speed per request stream")
    a("--max-running-requests", type=int, default=64, help="concurrent generations; more queue")
    a("--kv-cache-tokens", type=int, default=500000, help="reported KV cache size (#tokens)")
    a("--context-length", type=int, default=8192, help="model context length")
    a("--seed", type=int, default=0,
      help="same seed -> same outputs and same fault decisions for the same requests")
    a("--api-key", default=None,
      help="require 'Authorization: Bearer KEY' (not on /health*, /metrics, like SGLang); "
           "default: the environment variable FLEET_ENGINE_API_KEY (how fleet passes it: not in argv)")
    a("--openai-only", action="store_true",
      help="answer only the OpenAI API (/v1/models, /v1/chat/completions, /v1/completions), 404 elsewhere: "
           "a server with no /health, /metrics or /server_info (a hosted endpoint, a router)")
    a("--speculative-algorithm", default=None,
      help="e.g. EAGLE: report an accept length in logs, /server_info and /metrics")
    a("--oom-at-start", nargs="?", const="kv-pool", default=None, choices=("kv-pool", "weights"),
      help="die before ready with SGLang's OOM lines, exit 1 "
           "(kv-pool: 'Not enough memory...', weights: torch.OutOfMemoryError)")
    a("--hang-at-start", action="store_true", help="never become ready; stay alive")
    a("--crash-after", type=int, default=None, metavar="N",
      help="die (exit 1) when the N-th generation request arrives")
    a("--hang-requests", action="store_true",
      help="ready and /health ok, but generations (and /health_generate) never answer")
    a("--hang-after", type=int, default=None, metavar="N",
      help="serve N generation requests, then hang like --hang-requests (a wedged scheduler: "
           "/health still answers, /health_generate and generations never do)")
    a("--burst-5xx", type=int, default=30, metavar="N",
      help="on SIGUSR1, answer the next N generation requests with HTTP 500 (a fault soak's burst)")
    a("--garbled-after", type=int, default=None, metavar="N",
      help="serve N generation requests, then answer every later one with HTTP 200 and a body of the "
           "right shape but wrong types (usage: \"lots\"): a server broken in its answers, not its process")
    a("--error-rate", type=float, default=0.0,
      help="share 0..1 of generation requests answered with HTTP 500 (deterministic)")
    a("--empty-rate", type=float, default=0.0,
      help="share 0..1 of chat answers with empty content (decided per prompt and request seed)")
    a("--think-leak-rate", type=float, default=0.0,
      help="share 0..1 of chat answers whose reasoning is left in the content as <think>...</think> "
           "(no reasoning_content): a missing reasoning parser")
    a("--loop-rate", type=float, default=0.0,
      help="share 0..1 of chat answers that end in one word repeated (degenerate repetition)")
    a("--lengths", default="uniform", metavar="uniform|lognormal:MEDIAN:SIGMA",
      help="completion lengths: uniform in 1..max_tokens with one in eight at the limit (default), or "
           "lognormal around MEDIAN tokens (a reasoning model's long tail), capped at max_tokens")
    a("--max-output-tokens-default", type=int, default=64,
      help="max tokens when a request gives none")
    a("--lockstep-rows", type=int, default=None, metavar="N",
      help="a test of how soon a client refills a slot: answer chat generations one at a time, only while "
           "--max-running-requests are held, until N have arrived (fleet/sim/lockstep.py; GET /sim/lockstep)")
    a("--log-interval-s", type=float, default=1.0,
      help="seconds between 'Decode batch' lines while running")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        p.error("--port must be 0..65535")
    if args.tokens_per_s <= 0:
        p.error("--tokens-per-s must be > 0")
    if args.max_running_requests < 1:
        p.error("--max-running-requests must be >= 1")
    if args.kv_cache_tokens < 1 or args.context_length < 2:
        p.error("--kv-cache-tokens must be >= 1 and --context-length >= 2")
    for flag in ("error_rate", "empty_rate", "think_leak_rate", "loop_rate"):
        if not 0.0 <= getattr(args, flag) <= 1.0:
            p.error(f"--{flag.replace('_', '-')} must be within 0..1")
    if args.garbled_after is not None and args.garbled_after < 0:
        p.error("--garbled-after must be >= 0")
    if args.crash_after is not None and args.crash_after < 1:
        p.error("--crash-after must be >= 1")
    if args.startup_s < 0 or args.first_request_delay_s < 0:
        p.error("--startup-s and --first-request-delay-s must be >= 0")
    if args.max_output_tokens_default < 1:
        p.error("--max-output-tokens-default must be >= 1")
    if args.lockstep_rows is not None and args.lockstep_rows < 1:
        p.error("--lockstep-rows must be >= 1")
    if args.log_interval_s <= 0:
        p.error("--log-interval-s must be > 0")
    if args.lengths != "uniform":
        try:
            kind, median, sigma = args.lengths.split(":")
            ok = kind == "lognormal" and float(median) >= 1 and float(sigma) >= 0
        except ValueError:
            ok = False
        if not ok:
            p.error("--lengths must be 'uniform' or 'lognormal:MEDIAN:SIGMA' (MEDIAN >= 1, SIGMA >= 0)")
