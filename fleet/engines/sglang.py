"""SGLang: `python -m sglang.launch_server`, ready on `/health`, and its log.

Flags are the ones `sglang/srt/server_args.py` registers (checked against upstream; the
field name with `_` → `-` is the flag). `--mamba-scheduler-strategy` is what the seed job
and sglang 0.5.x use; newer SGLang renamed it `--mamba-radix-cache-strategy` and keeps the
old spelling as a deprecated alias, so the old one works on both.

`/health` answers 503 while the server starts or shuts down and 200 once it serves
(sglang ≥ 0.4; older ones answered 200 as soon as HTTP was up, before the warm-up: the
log's ready line is the stronger signal there). The log lines read here are listed in
DESIGN.md ("Facts: SGLang"); samples with their sources are in tests/data/logs/.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from fleet.engines.base import (
    API_KEY_ENV,
    BaseProfile,
    COMMON_FATAL,
    Fact,
    Fatal,
    LogRules,
    ServerSpec,
    Warn,
    check_gpu_count,
    extras,
    opt,
    rx,
    switch,
)

if TYPE_CHECKING:
    from fleet.config import FleetConfig

SGLANG_RULES = LogRules(
    ready=(
        # Logged after the server's own warm-up request succeeded (not before: uvicorn's
        # "Application startup complete" / "Uvicorn running on" come earlier and were
        # followed by "warmup error" in sglang#2468).
        rx(r"The server is fired up and ready to roll"),
    ),
    fatal=(
        # The KV pool would be empty or negative once weights are in: the usual cause is
        # a --mem-fraction-static too small for the weights (or too large for activations).
        Fatal("kv-no-memory", rx(r"Not enough memory\. Please try to increase --mem-fraction-static"),
              "Not enough memory"),
        *COMMON_FATAL,
        # At run time the KV pool could not hold one more decode step; sglang 0.5.x logs this
        # and raises, which kills the scheduler (older versions retracted requests instead).
        Fatal("kv-exhausted", rx(r"Decode out of memory\. Try to lower"), "Decode out of memory"),
        # A scheduler (one per TP rank) raised: the server is dead even if HTTP still answers.
        # Older versions: "Exception in ModelTpServer" / "… ControllerSingle".
        Fatal("scheduler-crash", rx(r"\bScheduler hit an exception|Exception in (?:ModelTpServer|ControllerSingle)"),
              "xception"),
        # Any other SGLang process (TokenizerManager, DetokenizerManager, DataParallelController,
        # MultiTokenizerRouter, …) logs "<Name> hit an exception" before it dies.
        Fatal("process-crash", rx(r"\b[A-Z]\w+ hit an exception"), "hit an exception"),
        # The launcher's reaction to a dead child process (scheduler, detokenizer); wording
        # changed from "Received sigquit from a child process" to "SIGQUIT received".
        Fatal("child-died", rx(r"Received sigquit from a child"), "sigquit"),
        Fatal("child-died", rx(r"SIGQUIT received"), "SIGQUIT"),
        # The server's own warm-up request failed: it never becomes ready.
        Fatal("warmup-failed", rx(r"Initialization failed\. warmup error"), "warmup error"),
    ),
    warnings=(
        # Hybrid (Mamba/linear-attention) models: concurrency is lower than asked for, and the
        # log is the only place that says so (sglang#38846).
        Warn("mamba-cap", rx(r"max_running_requests is capped to \d+"), "is capped to"),
        # The memory profile came out smaller than a user-given --max-total-tokens (a negative
        # profile precedes an OOM: sglang#7691).
        Warn("kv-profile", rx(r"is larger than the profiled value"), "profiled value"),
        # At run time: the KV cache filled and requests were pushed back to the queue.
        Warn("retract", rx(r"KV cache pool is full\. Retract requests"), "Retract requests"),
        Warn("retract", rx(r"Decode out of memory happened"), "out of memory happened"),
    ),
    facts=(
        # "Load weight end. [elapsed=…, ]type=…, dtype=…, avail mem=X GB[, mem usage=Y GB]."
        Fact(rx(r"avail mem=(?P<avail_mem_after_load_gb>[\d.]+) ?GB"), "Load weight end"),
        Fact(rx(r"mem usage=(?P<load_mem_usage_gb>[\d.]+) ?GB"), "Load weight end"),
        # "KV Cache is allocated. [dtype: …, ]#tokens: N, K size: X GB, V size: Y GB";
        # MLA models print one "KV size: Z GB" instead (kv_size_gb).
        Fact(rx(r"#tokens: (?P<kv_cache_tokens>\d+)"), "KV Cache is allocated"),
        Fact(rx(r"\bK size: (?P<k_size_gb>[\d.]+) ?GB"), "KV Cache is allocated"),
        Fact(rx(r"\bV size: (?P<v_size_gb>[\d.]+) ?GB"), "KV Cache is allocated"),
        Fact(rx(r"\bKV size: (?P<kv_size_gb>[\d.]+) ?GB"), "KV Cache is allocated"),
        # "Mamba Cache is allocated. max_mamba_cache_size: N, conv_state size: X GB, ssm_state size: Y GB …"
        Fact(rx(r"max_mamba_cache_size: (?P<mamba_cache_size>\d+)"), "Mamba Cache is allocated"),
        Fact(rx(r"\bconv_state size: (?P<mamba_conv_state_gb>[\d.]+) ?GB"), "Mamba Cache is allocated"),
        Fact(rx(r"\bssm_state size: (?P<mamba_ssm_state_gb>[\d.]+) ?GB"), "Mamba Cache is allocated"),
        # "max_running_requests is capped to N by the mamba state cache (…)"
        Fact(rx(r"capped to (?P<max_running_capped_by_mamba>\d+) by the mamba"), "is capped to"),
        # "Capture cuda graph end. Time elapsed: T s[. mem usage=…]" ("npu graph" on Ascend):
        # the target model's decode graphs, first rank. sglang 0.5.x also prints "Capture
        # draft [extend] cuda graph end" and "Capture piecewise CUDA graph end": not these.
        Fact(rx(r"Capture (?:target (?:decode )?)?(?:cuda|npu|cpu) graph end\. Time elapsed: "
                r"(?P<cuda_graph_s>[\d.]+) ?s", re.IGNORECASE), "raph end"),
        # The summary line; each field on its own so fields may come and go between versions.
        Fact(rx(r"max_total_num_tokens=(?P<max_total_num_tokens>-?\d+)"), "max_total_num_tokens="),
        Fact(rx(r"\bchunked_prefill_size=(?P<chunked_prefill_size>-?\d+)"), "max_total_num_tokens="),
        Fact(rx(r"\bmax_prefill_tokens=(?P<max_prefill_tokens>\d+)"), "max_total_num_tokens="),
        Fact(rx(r"\bmax_running_requests=(?P<max_running_requests>\d+)"), "max_total_num_tokens="),
        Fact(rx(r"\bcontext_len=(?P<context_len>\d+)"), "max_total_num_tokens="),
        Fact(rx(r"\bavailable_gpu_mem=(?P<available_gpu_mem_gb>[\d.]+) ?GB"), "max_total_num_tokens="),
        # Running gauges, last value wins: "Decode batch. #running-req: …, accept len: …,
        # gen throughput (token/s): …, #queue-req: …" ("Decode batch, …" in 0.5.x, and
        # "Decode batch [N], …" with SGLANG_LOG_FORWARD_ITERS).
        Fact(rx(r"(?:Decode|Prefill) batch\b.*?#running-req: (?P<running_req>\d+)"), " batch", "last"),
        Fact(rx(r"(?:Decode|Prefill) batch\b.*?#queue-req: (?P<queue_req>\d+)"), " batch", "last"),
        Fact(rx(r"Decode batch\b.*?accept len: (?P<accept_len>[\d.]+)"), "accept len", "last"),
        Fact(rx(r"Decode batch\b.*?gen throughput \(token/s\): (?P<gen_throughput>[\d.]+)"),
             "gen throughput", "last"),
    ),
)


# SGLang takes its key only as --api-key (server_args.py has no environment fallback), and
# argv sits in /proc/<pid>/cmdline, readable by every local user, for the server's whole
# life. This shim runs sglang's entry module in-process (as `python -m` does: runpy, same
# __main__ semantics, so spawned workers import it the same way) with the key appended to
# sys.argv from the environment; the kernel's copy of argv, what `ps` shows, never holds it,
# and the variable is dropped before any worker starts.
KEY_SHIM = ("import os,runpy,sys;k=os.environ.pop('FLEET_ENGINE_API_KEY','');m=sys.argv[1];"
            "sys.argv=[m,*sys.argv[2:],*(['--api-key',k] if k else [])];"
            "runpy.run_module(m,run_name='__main__',alter_sys=True)")


class SGLangProfile(BaseProfile):
    """SGLang's launch_server. Clients send `model = served_name` (set by --served-model-name)."""

    name = "sglang"
    default_import = "sglang"
    rules: LogRules = SGLANG_RULES
    key_env = API_KEY_ENV
    # server_args.py: model_path has the alias --model, tp_size the aliases --tp and
    # --tensor-parallel-size; admin_api_key is a key too.
    owned_flags = {
        "--host": "servers.host", "--port": "servers.base_port / servers.ports",
        "--api-key": "servers.api_key", "--admin-api-key": "servers.api_key",
        "--model-path": "model.source", "--model": "model.source",
        "--served-model-name": "model.served_name",
        "--tp-size": "servers.tensor_parallel", "--tp": "servers.tensor_parallel",
        "--tensor-parallel-size": "servers.tensor_parallel",
    }
    settings_files: tuple[str, ...] = ("--config",)   # a YAML file of server arguments (launch_server / serve --config)

    def argv(self, cfg: FleetConfig, spec: ServerSpec) -> list[str]:
        check_gpu_count(cfg, spec, self.name)
        e = cfg.engine
        tp = cfg.servers.tensor_parallel
        # With a key: the shim (see KEY_SHIM) runs the same module with the same flags.
        entry = ["-c", KEY_SHIM] if spec.api_key else ["-m"]
        return [
            spec.python, *entry, "sglang.launch_server",
            "--model-path", spec.model_path,
            "--served-model-name", spec.served_name,
            "--host", spec.host,
            "--port", str(spec.port),
            # /metrics with the token counters the runner's stall watchdog reads (a wedged
            # scheduler is found by its tokens not advancing, whatever the row length)
            "--enable-metrics",
            *opt("--context-length", e.context_length),
            *opt("--mem-fraction-static", e.mem_fraction_static),
            *opt("--tp-size", tp if tp > 1 else None),
            *switch("--trust-remote-code", e.trust_remote_code),
            *opt("--speculative-algorithm", e.speculative_algorithm),
            *opt("--speculative-num-steps", e.speculative_num_steps),
            *opt("--speculative-eagle-topk", e.speculative_eagle_topk),
            *opt("--speculative-num-draft-tokens", e.speculative_num_draft_tokens),
            *opt("--speculative-draft-model-path", e.speculative_draft_model_path),
            *opt("--mamba-scheduler-strategy", e.mamba_scheduler_strategy),
            *extras(cfg, spec),
        ]
