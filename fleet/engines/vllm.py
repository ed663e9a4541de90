"""vLLM's OpenAI-compatible server, ready on `/health`, and its log.

Entry point: `<venv python> -m vllm.entrypoints.openai.api_server --model PATH …`. It is
the module `vllm serve` itself runs (same `make_arg_parser`, same `run_server`; the file
keeps a `__main__` block for this use), so it takes the same flags; and it is started with
the venv's own interpreter, like SGLang, so no console script or PATH is involved and the
process shows up as that python in `ps`. `--model` is a flag here; only `vllm serve`
takes the model as a positional argument.

The server binds its port before it loads the model (to avoid port races), so a port
clash fails within seconds with `OSError: [Errno 98] Address already in use`, and uvicorn
only starts after the engine is up: `Starting vLLM server on …` (older: `Starting vLLM API
server 0 on …`) and uvicorn's `Application startup complete.` both mean ready, and
`/health` answers 200 from then on.

Speculative decoding goes in one JSON flag, `--speculative-config`, mapped from the
SGLang-shaped config fields: EAGLE → "eagle", EAGLE3 → "eagle3", NEXTN → "mtp",
STANDALONE → "draft_model", NGRAM → "ngram", DFLASH → "dflash" (others lower-cased);
`num_speculative_tokens` = speculative_num_steps, else speculative_num_draft_tokens − 1.
vLLM has no EAGLE top-k (tree) setting nor a Mamba scheduler strategy: those two fields
are not passed.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from fleet.engines.base import (
    BaseProfile,
    COMMON_FATAL,
    FlagSyntax,
    Fact,
    Fatal,
    LogRules,
    LogVerdict,
    ServerSpec,
    Warn,
    check_gpu_count,
    extras,
    opt,
    rx,
    switch,
)

if TYPE_CHECKING:
    from fleet.config import EngineConfig, FleetConfig

SPEC_METHODS = {
    "EAGLE": "eagle",
    "EAGLE3": "eagle3",
    "NEXTN": "mtp",
    "MTP": "mtp",
    "STANDALONE": "draft_model",
    "DRAFT_MODEL": "draft_model",
    "NGRAM": "ngram",
    "DFLASH": "dflash",
}


def speculative_config(e: EngineConfig) -> str | None:
    """The `--speculative-config` JSON for the config's speculative fields, or None."""
    if not e.speculative_algorithm:
        return None
    algo = e.speculative_algorithm.strip()
    conf: dict[str, Any] = {"method": SPEC_METHODS.get(algo.upper(), algo.lower())}
    if e.speculative_draft_model_path:
        conf["model"] = e.speculative_draft_model_path
    if e.speculative_num_steps:
        conf["num_speculative_tokens"] = e.speculative_num_steps
    elif e.speculative_num_draft_tokens and e.speculative_num_draft_tokens > 1:
        conf["num_speculative_tokens"] = e.speculative_num_draft_tokens - 1
    return json.dumps(conf, separators=(",", ":"))


def _small_kv_cache(v: LogVerdict) -> None:
    # "Maximum concurrency for N tokens per request: 0.60x": not even one request of the
    # full context length fits; long requests will be preempted or rejected.
    conc = v.facts.get("max_concurrency")
    if isinstance(conc, int | float) and conc < 1:
        v.warnings.append(f"kv-too-small: the KV cache holds {conc}x of one full-context request "
                          f"({v.facts.get('kv_cache_tokens', '?')} tokens for context {v.facts.get('context_len', '?')})")


VLLM_RULES = LogRules(
    ready=(
        # uvicorn, after the engine is up and the socket (bound before loading) is served.
        rx(r"Application startup complete"),
        # vLLM's own line just before uvicorn starts ("Starting vLLM API server 0 on …"
        # in older versions, "Starting vLLM server on …" in newer ones).
        rx(r"Starting vLLM (?:API )?server\b"),
    ),
    fatal=(
        # Weights fit but no KV block does (V0/V1 wording, and the V1 check against max_model_len).
        Fatal("kv-no-memory", rx(r"No available memory for the cache blocks"), "No available memory"),
        Fatal("kv-no-memory", rx(r"larger than the available KV cache memory"), "available KV cache memory"),
        # Another process (a leftover server?) holds the GPU's memory at startup.
        Fatal("gpu-busy", rx(r"on startup is less than desired GPU memory utilization"), "on startup is less than"),
        *COMMON_FATAL,
        # The engine core / workers died or never started; the API server follows them down.
        Fatal("engine-crash", rx(r"EngineCore failed to start"), "EngineCore failed"),
        Fatal("engine-crash", rx(r"EngineCore hit an exception"), "hit an exception"),
        Fatal("engine-crash", rx(r"WorkerProc hit an exception|WorkerProc failed to start"), "WorkerProc"),
        Fatal("engine-crash", rx(r"Engine core initialization failed"), "initialization failed"),
        Fatal("engine-crash", rx(r"Engine process failed to start"), "failed to start"),
        Fatal("engine-crash", rx(r"Engine core proc \S+ died unexpectedly"), "died unexpectedly"),
        Fatal("engine-crash", rx(r"\bEngineDeadError\b"), "EngineDeadError"),
        Fatal("engine-crash", rx(r"Process ApiServer_\d+ \(PID: \d+\) died"), "ApiServer_"),
    ),
    warnings=(
        # V0: a running request was evicted for lack of KV space (throughput falls).
        Warn("preempt", rx(r"is preempted by PreemptionMode"), "preempted"),
    ),
    facts=(
        # "Model loading took 12.66 GiB memory and 31.6 seconds" (older: "… took 0.2533 GiB
        # and …", "… took 0.2389 GB and …"); early V1: "Loading model weights took 67.7229 GB".
        Fact(rx(r"Model loading took (?P<load_mem_usage_gb>[\d.]+) ?Gi?B"), "Model loading took"),
        Fact(rx(r"Loading model weights took (?P<load_mem_usage_gb>[\d.]+) ?Gi?B"), "Loading model weights took"),
        # "Available KV cache memory: 16.23 GiB"
        Fact(rx(r"Available KV cache memory: (?P<kv_cache_mem_gb>[\d.]+) ?Gi?B"), "Available KV cache memory"),
        # "GPU KV cache size: 425,424 tokens"
        Fact(rx(r"GPU KV cache size: (?P<kv_cache_tokens>[\d,]+) tokens"), "GPU KV cache size"),
        # "Maximum concurrency for 65,536 tokens per request: 6.49x": N is max_model_len.
        Fact(rx(r"Maximum concurrency for (?P<context_len>[\d,]+) tokens per request: (?P<max_concurrency>[\d.]+)x"),
             "Maximum concurrency for"),
        # Fallbacks for the context length: the engine config dump and the non-default args.
        Fact(rx(r"\bmax_seq_len=(?P<context_len>\d+)"), "max_seq_len="),
        Fact(rx(r"'max_model_len': (?P<context_len>\d+)"), "'max_model_len'"),
        # "Graph capturing finished in 7 secs, took 0.95 GiB"
        Fact(rx(r"Graph capturing finished in (?P<cuda_graph_s>[\d.]+) secs?"), "Graph capturing finished"),
        # Periodic stats, last value wins: "Avg generation throughput: X tokens/s, Running: N
        # reqs, Waiting: M reqs, …" (V0: "… Swapped: …, Pending: M reqs").
        Fact(rx(r"Avg generation throughput: (?P<gen_throughput>[\d.]+) tokens/s"), "Avg generation", "last"),
        Fact(rx(r"\bRunning: (?P<running_req>\d+) reqs"), "Running: ", "last"),
        Fact(rx(r"\b(?:Waiting|Pending): (?P<queue_req>\d+) reqs"), " reqs", "last"),
        # "SpecDecoding metrics: Mean acceptance length: 2.63, …"
        Fact(rx(r"Mean acceptance length: (?P<accept_len>[\d.]+)"), "Mean acceptance length", "last"),
    ),
    finish=(_small_kv_cache,),
)


class VLLMProfile(BaseProfile):
    """vLLM's OpenAI server. Clients send `model = served_name` (set by --served-model-name)."""

    name = "vllm"
    default_import = "vllm"
    rules: LogRules = VLLM_RULES
    # api_server.py: `args.api_key or envs.VLLM_API_KEY` (the environment, not argv)
    key_env = "VLLM_API_KEY"
    # vllm's arg parser: --tensor-parallel-size has the short form -tp; the model is
    # --model here (a positional only for `vllm serve`).
    owned_flags = {
        "--host": "servers.host", "--port": "servers.base_port / servers.ports",
        "--api-key": "servers.api_key", "--model": "model.source",
        "--served-model-name": "model.served_name",
        "--tensor-parallel-size": "servers.tensor_parallel", "-tp": "servers.tensor_parallel",
    }
    # FlexibleArgumentParser (vllm/utils): `_` in a `--name` reads as `-` before argparse (whose
    # allow_abbrev it keeps), so `--api_key sk-…` is `--api-key`; `--api-key.x v` sets --api-key too.
    flag_syntax = FlagSyntax(abbrev=True, underscores=True, dotted=True)
    settings_files: tuple[str, ...] = ("--config",)   # a YAML file of server arguments (launch_server / serve --config)

    def argv(self, cfg: FleetConfig, spec: ServerSpec) -> list[str]:
        check_gpu_count(cfg, spec, self.name)
        e = cfg.engine
        tp = cfg.servers.tensor_parallel
        return [
            spec.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", spec.model_path,
            "--served-model-name", spec.served_name,
            "--host", spec.host,
            "--port", str(spec.port),
            *opt("--max-model-len", e.context_length),
            *opt("--gpu-memory-utilization", e.mem_fraction_static),
            *opt("--tensor-parallel-size", tp if tp > 1 else None),
            *switch("--trust-remote-code", e.trust_remote_code),
            *opt("--speculative-config", speculative_config(e)),
            *extras(cfg, spec),
        ]
