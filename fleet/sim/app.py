"""The application behind the HTTP front: routes, the API key, probes, info and metrics.

The generation routes live in ``fleet.sim.generation``; this module answers everything
else the way SGLang does (same paths, same JSON shapes, same Prometheus names).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from typing import Any

from fleet.sim import faults
from fleet.sim.engine import (CHUNKED_PREFILL, GB, GRAPH_GB, KV_BYTES_PER_TOKEN_HALF, MAX_PREFILL,
                              SPEC_NUM_STEPS, WEIGHTS_GB, Engine)
from fleet.sim.generation import Generation
from fleet.sim.http_front import REASONS, TEXT, Answer, HttpConnection, Request, Resp, error_resp, json_resp
from fleet.sim.log import Log
from fleet.sim.options import VERSION

#: A route: ``(request, connection) -> answer``.
Route = Callable[[Request, HttpConnection], Answer]


class App:
    """Routes, validation, responses; the HTTP layer calls ``handle`` (``http_front.Routes``)."""

    def __init__(self, args: argparse.Namespace, log: Log, engine: Engine) -> None:
        self.args = args
        self.log = log
        self.engine = engine
        self.conns: set[HttpConnection] = set()
        self.created = int(time.time())
        self.api_key: bytes | None = args.api_key.encode() if args.api_key else None
        self.generation = gen = Generation(args, log, engine)
        self.routes: dict[str, tuple[str, Route]] = {
            "/health": ("GET", self.health),
            "/health_generate": ("GET", self.health_generate),
            "/model_info": ("GET", self.model_info),
            "/get_model_info": ("GET", self.model_info),
            "/server_info": ("GET", self.server_info),
            "/get_server_info": ("GET", self.server_info),
            "/v1/models": ("GET", self.list_models),
            "/metrics": ("GET", self.metrics),
            "/v1/chat/completions": ("POST", gen.chat),
            "/v1/completions": ("POST", gen.completions),
            "/generate": ("POST", gen.generate),
            "/sim/lockstep": ("GET", self.lockstep),
            "/sim/streams": ("GET", self.streams),
            "/sim/requests": ("GET", self.requests),
        }
        if getattr(args, "openai_only", False):   # a plain OpenAI-compatible server: none of SGLang's own paths
            self.routes = {k: v for k, v in self.routes.items() if k.startswith("/v1/")}

    # -- plumbing -----------------------------------------------------------------------

    def access(self, peer: str, req: Request, status: int) -> None:
        self.log.info(
            f'INFO:     {peer} - "{req.method} {req.target} HTTP/{req.version}" '
            f"{status} {REASONS.get(status, '')}"
        )

    def log_exception(self, exc: BaseException) -> None:
        self.log.info(f"ERROR:    Exception in ASGI application: {type(exc).__name__}: {exc}")

    def internal_error(self, exc: BaseException) -> Resp:
        self.log_exception(exc)
        return error_resp(500, f"{type(exc).__name__}: {exc}", "InternalServerError")

    def handle(self, req: Request, conn: HttpConnection) -> Answer:
        if self.engine.lockstep is not None:
            self.engine.lockstep.request(conn, req.path == "/v1/chat/completions")
        route = self.routes.get(req.path)
        if route is None:
            return json_resp(404, {"detail": "Not Found"})
        method, fn = route
        if req.method != method and not (req.method == "HEAD" and method == "GET"):
            return json_resp(405, {"detail": "Method Not Allowed"})
        # like SGLang's middleware: /health* and /metrics stay open for probes and scrapers
        if self.api_key is not None and not (req.path.startswith("/health") or req.path == "/metrics"):
            auth = req.headers.get(b"authorization")
            if auth != b"Bearer " + self.api_key:
                return json_resp(401, {"error": "Unauthorized"})
        return fn(req, conn)

    # -- probes and info ----------------------------------------------------------------

    def lockstep(self, req: Request, conn: HttpConnection) -> Resp:
        ls = self.engine.lockstep
        return json_resp(200, ls.counts()) if ls is not None else json_resp(404, {"detail": "no --lockstep-rows"})

    def streams(self, req: Request, conn: HttpConnection) -> Resp:
        """Streamed answers so far, open now, and the most open at once (tests/test_gen_refill.py)."""
        e = self.engine
        return json_resp(200, {"streamed": e.streams_total, "now": e.streams_now, "max_at_once": e.streams_max})

    def requests(self, req: Request, conn: HttpConnection) -> Resp:
        """Generation requests received, by the max_tokens each asked for (tests/test_reattach.py)."""
        return json_resp(200, {"by_max_tokens": {str(k): v for k, v in sorted(self.engine.by_max_tokens.items())}})

    def health(self, req: Request, conn: HttpConnection) -> Resp:
        return Resp(200 if self.engine.ready else 503, b"", TEXT)

    def health_generate(self, req: Request, conn: HttpConnection) -> Answer:
        if not self.engine.ready:
            return Resp(503, b"", TEXT)
        if faults.hung(self.args, self.engine):
            return faults.hang()
        # a one-token generation that does not wait for a slot (SGLang answers health
        # checks from recent scheduler activity when busy)
        return self._after(1.0 / self.engine.tps, Resp(200, b"", TEXT))

    async def _after(self, seconds: float, resp: Resp) -> Resp:
        await asyncio.sleep(seconds)
        return resp

    def model_info(self, req: Request, conn: HttpConnection) -> Resp:
        a = self.args
        return json_resp(200, {
            "model_path": a.model_path,
            "tokenizer_path": a.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "sim",
            "architectures": ["SimForCausalLM"],
        })

    def server_args(self) -> dict[str, Any]:
        a = self.args
        spec = a.speculative_algorithm
        return {
            "model_path": a.model_path,
            "tokenizer_path": a.model_path,
            "served_model_name": a.model_name,
            "host": a.host,
            "port": a.port,
            "context_length": a.context_length,
            "max_running_requests": a.max_running_requests,
            "max_total_tokens": None,
            "chunked_prefill_size": CHUNKED_PREFILL,
            "max_prefill_tokens": MAX_PREFILL,
            "mem_fraction_static": 0.88,
            "tp_size": 1,
            "dp_size": 1,
            "random_seed": a.seed,
            "trust_remote_code": True,
            "enable_metrics": True,
            "speculative_algorithm": spec,
            "speculative_num_steps": SPEC_NUM_STEPS if spec else None,
            "speculative_eagle_topk": 1 if spec else None,
            "speculative_num_draft_tokens": SPEC_NUM_STEPS + 1 if spec else None,
            "api_key_set": a.api_key is not None,
        }

    def server_info(self, req: Request, conn: HttpConnection) -> Resp:
        a, e = self.args, self.engine
        state: dict[str, Any] = {
            "last_gen_throughput": round(e.last_gen_throughput, 2),
            "memory_usage": {
                "weight": WEIGHTS_GB,
                "kvcache": round(2 * a.kv_cache_tokens * KV_BYTES_PER_TOKEN_HALF / GB, 2),
                "token_capacity": a.kv_cache_tokens,
                "graph": GRAPH_GB,
            },
        }
        if e.spec_accept:
            state["avg_spec_accept_length"] = round(e.spec_accept, 4)
        info = self.server_args()
        info.update({
            "max_total_num_tokens": a.kv_cache_tokens,
            "max_req_input_len": min(a.context_length, a.kv_cache_tokens) - 1,
            "internal_states": [state],
            "version": VERSION,
            "sim": {
                "tokens_per_s": a.tokens_per_s,
                "startup_s": a.startup_s,
                "first_request_delay_s": a.first_request_delay_s,
                "max_output_tokens_default": a.max_output_tokens_default,
                "ready": e.ready,
                "generation_requests": e.gen_counter,   # arrived (tests count what reached the server)
                "faults": faults.summary(a),
            },
        })
        return json_resp(200, info)

    def list_models(self, req: Request, conn: HttpConnection) -> Resp:
        a = self.args
        return json_resp(200, {"object": "list", "data": [{
            "id": a.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "sglang",
            "root": a.model_name,
            "parent": None,
            "max_model_len": a.context_length,
        }]})

    def metrics(self, req: Request, conn: HttpConnection) -> Resp:
        a, e = self.args, self.engine
        now = time.monotonic()
        labels = (f'model_name="{a.model_name}",engine_type="unified",tp_rank="0",pp_rank="0"')
        tl = f'model_name="{a.model_name}"'
        used = e.used_tokens(now)
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, value: str, lab: str = labels) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            lines.append(f"{name}{{{lab}}} {value}")

        metric("sglang:num_running_reqs", "gauge", "The number of running requests.",
               f"{len(e.running)}.0")
        metric("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.",
               f"{len(e.waiters)}.0")
        metric("sglang:num_used_tokens", "gauge", "The number of used tokens.", f"{used}.0")
        metric("sglang:token_usage", "gauge", "The token usage.",
               f"{min(used / a.kv_cache_tokens, 1.0):.4f}")
        metric("sglang:gen_throughput", "gauge", "The generation throughput (token/s).",
               f"{e.last_gen_throughput:.2f}")
        metric("sglang:max_total_num_tokens", "gauge",
               "Maximum total number of tokens in the KV cache pool.", f"{a.kv_cache_tokens}.0")
        metric("sglang:max_running_requests", "gauge", "The maximum number of running requests.",
               f"{a.max_running_requests}.0")
        metric("sglang:cache_hit_rate", "gauge", "The prefix cache hit rate.", "0.0")
        if e.spec_accept:
            metric("sglang:spec_accept_length", "gauge", "The average acceptance length of speculative decoding.",
                   f"{e.spec_accept:.4f}")
        metric("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
               f"{e.prompt_tokens_total}.0", tl)
        metric("sglang:generation_tokens_total", "counter", "Number of generation tokens processed.",
               f"{e.generation_tokens_total}.0", tl)
        metric("sglang:num_requests_total", "counter", "Number of requests processed.",
               f"{e.requests_total}.0", tl)
        # SGLang's scheduler counter (>= 0.5): its token progress as it goes, not when a request
        # ends (SGLang adds to it every log interval; the sim at each scrape). A wedged sim stops
        # it, a slow one moves it slowly: fleet's stall watchdog reads it.
        name = "sglang:realtime_tokens_total"
        lines.append(f"# HELP {name} Total number of tokens processed (updated on each log interval). "
                     "mode: prefill_compute, prefill_cache, decode.")
        lines.append(f"# TYPE {name} counter")
        for mode, value in (("prefill_compute", e.prompt_tokens_total), ("prefill_cache", 0),
                            ("decode", e.decoded_tokens(now))):
            lines.append(f'{name}{{{labels},mode="{mode}"}} {value}.0')
        name = "sglang:e2e_request_latency_seconds"
        lines.append(f"# HELP {name} Histogram of End-to-end request latency in seconds")
        lines.append(f"# TYPE {name} histogram")
        cum = 0
        for bound, count in zip(e.latency_buckets, e.latency_counts):
            cum += count
            lines.append(f'{name}_bucket{{{tl},le="{bound}"}} {cum}.0')
        cum += e.latency_counts[-1]
        lines.append(f'{name}_bucket{{{tl},le="+Inf"}} {cum}.0')
        lines.append(f"{name}_sum{{{tl}}} {e.latency_sum:.6f}")
        lines.append(f"{name}_count{{{tl}}} {cum}.0")
        return Resp(200, ("\n".join(lines) + "\n").encode(), b"text/plain; version=0.0.4; charset=utf-8")
