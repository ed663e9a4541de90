"""Engine profiles: exact argv and env per engine, and the log classifiers against real logs.

The logs under tests/data/logs/ are verbatim output of SGLang, vLLM and `transformers
serve` (sources in tests/data/logs/README.md). Expected values below were read off those
files by eye, not produced by the code under test.
"""

from __future__ import annotations

import copy
import json
import pickle
import random
import time
from pathlib import Path
from typing import Any

import pytest

from fleet.config import FleetConfig
from fleet.engines import PROFILES, EngineProfile, LogVerdict, ServerSpec, get_profile, inspect_log
from fleet.engines.vllm import speculative_config
from fleet.errors import ConfigError

LOGS = Path(__file__).parent / "data" / "logs"
PY = "/opt/fleet/venv/bin/python"
MODEL = "/dev/shm/Qwen3-Next-80B"


def cfg_of(**sections: Any) -> FleetConfig:
    return FleetConfig(**sections)


def spec_of(**kw: Any) -> ServerSpec:
    base: dict[str, Any] = dict(node="gpu1", index=0, gpus=(0,), host="127.0.0.1", port=30000,
                                model_path=MODEL, served_name="qwen3-next", python=PY, workdir="/tmp/fleet")
    base.update(kw)
    return ServerSpec(**base)


def log(name: str) -> str:
    return (LOGS / name).read_text()


# --------------------------------------------------------------------------- registry


def test_every_kind_has_a_profile_that_meets_the_protocol() -> None:
    assert set(PROFILES) == {"sglang", "vllm", "transformers", "sim"}
    for kind, profile in PROFILES.items():
        assert isinstance(profile, EngineProfile)
        assert get_profile(kind) is profile
        assert profile.name == kind
        assert profile.ready_path == "/health"
    assert {k: p.default_import for k, p in PROFILES.items()} == {
        "sglang": "sglang", "vllm": "vllm", "transformers": "transformers", "sim": "json"}


def test_unknown_engine_is_a_config_error_naming_the_choices() -> None:
    with pytest.raises(ConfigError) as exc:
        get_profile("tgi")
    assert "sglang, vllm, transformers, sim" in str(exc.value)


# --------------------------------------------------------------------------- argv: sglang


def test_sglang_argv_of_the_seed_job() -> None:
    """The seed job's command line (DESIGN.md), one server per GPU, loopback, no key."""
    cfg = cfg_of(engine={"kind": "sglang", "trust_remote_code": True, "context_length": 8192,
                         "speculative_algorithm": "EAGLE", "speculative_num_steps": 3,
                         "mamba_scheduler_strategy": "extra_buffer"})
    spec = spec_of(index=3, gpus=(3,), port=30003)
    assert get_profile("sglang").argv(cfg, spec) == [
        PY, "-m", "sglang.launch_server",
        "--model-path", MODEL,
        "--served-model-name", "qwen3-next",
        "--host", "127.0.0.1",
        "--port", "30003",
        "--enable-metrics",
        "--context-length", "8192",
        "--trust-remote-code",
        "--speculative-algorithm", "EAGLE",
        "--speculative-num-steps", "3",
        "--mamba-scheduler-strategy", "extra_buffer",
    ]


def test_sglang_argv_minimal_has_only_the_required_flags() -> None:
    argv = get_profile("sglang").argv(cfg_of(), spec_of())
    assert argv == [PY, "-m", "sglang.launch_server", "--model-path", MODEL, "--served-model-name",
                    "qwen3-next", "--host", "127.0.0.1", "--port", "30000", "--enable-metrics"]


def test_sglang_argv_every_option_in_order_then_extras() -> None:
    cfg = cfg_of(
        engine={"kind": "sglang", "context_length": 32768, "mem_fraction_static": 0.85, "trust_remote_code": True,
                "speculative_algorithm": "EAGLE3", "speculative_num_steps": 5, "speculative_eagle_topk": 8,
                "speculative_num_draft_tokens": 32, "speculative_draft_model_path": "/dev/shm/draft",
                "mamba_scheduler_strategy": "no_buffer", "extra_args": ["--enable-cache-report"]},
        servers={"tensor_parallel": 2, "host": "0.0.0.0", "api_key": "sk-test"},
    )
    spec = spec_of(gpus=(2, 3), host="0.0.0.0", api_key="sk-test", extra_args=("--log-level", "debug"))
    # with a key, the shim runs the module and adds --api-key from the environment (never argv)
    from fleet.engines.sglang import KEY_SHIM

    assert get_profile("sglang").argv(cfg, spec) == [
        PY, "-c", KEY_SHIM, "sglang.launch_server", "--model-path", MODEL, "--served-model-name", "qwen3-next",
        "--host", "0.0.0.0", "--port", "30000", "--enable-metrics",
        "--context-length", "32768",
        "--mem-fraction-static", "0.85",
        "--tp-size", "2",
        "--trust-remote-code",
        "--speculative-algorithm", "EAGLE3",
        "--speculative-num-steps", "5",
        "--speculative-eagle-topk", "8",
        "--speculative-num-draft-tokens", "32",
        "--speculative-draft-model-path", "/dev/shm/draft",
        "--mamba-scheduler-strategy", "no_buffer",
        "--enable-cache-report",
        "--log-level", "debug",
    ]


def test_a_server_given_the_wrong_number_of_gpus_is_refused() -> None:
    cfg = cfg_of(servers={"tensor_parallel": 2})
    for kind in ("sglang", "vllm"):
        with pytest.raises(ConfigError, match="tensor_parallel is 2"):
            get_profile(kind).argv(cfg, spec_of(gpus=(0,)))


# --------------------------------------------------------------------------- argv: vllm


def test_vllm_argv_with_speculative_config() -> None:
    cfg = cfg_of(engine={"kind": "vllm", "trust_remote_code": True, "context_length": 8192,
                         "mem_fraction_static": 0.9, "speculative_algorithm": "EAGLE3",
                         "speculative_num_steps": 3, "speculative_draft_model_path": "/dev/shm/eagle3",
                         "speculative_eagle_topk": 4, "mamba_scheduler_strategy": "extra_buffer",
                         "extra_args": ["--max-num-seqs", "256"]},
                 servers={"tensor_parallel": 2})
    spec = spec_of(gpus=(4, 5), port=30002, api_key="k1", extra_args=("--seed", "7"))
    assert get_profile("vllm").argv(cfg, spec) == [
        PY, "-m", "vllm.entrypoints.openai.api_server",
        "--model", MODEL,
        "--served-model-name", "qwen3-next",
        "--host", "127.0.0.1",
        "--port", "30002",
        "--max-model-len", "8192",
        "--gpu-memory-utilization", "0.9",
        "--tensor-parallel-size", "2",
        "--trust-remote-code",
        "--speculative-config", '{"method":"eagle3","model":"/dev/shm/eagle3","num_speculative_tokens":3}',
        "--max-num-seqs", "256",
        "--seed", "7",
    ]


def test_vllm_argv_minimal() -> None:
    assert get_profile("vllm").argv(cfg_of(engine={"kind": "vllm"}), spec_of()) == [
        PY, "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL, "--served-model-name", "qwen3-next",
        "--host", "127.0.0.1", "--port", "30000"]


@pytest.mark.parametrize(("engine", "expected"), [
    ({}, None),
    ({"speculative_algorithm": "NEXTN", "speculative_num_steps": 3}, {"method": "mtp", "num_speculative_tokens": 3}),
    ({"speculative_algorithm": "EAGLE", "speculative_num_draft_tokens": 4}, {"method": "eagle", "num_speculative_tokens": 3}),
    ({"speculative_algorithm": "ngram"}, {"method": "ngram"}),
    ({"speculative_algorithm": "suffix"}, {"method": "suffix"}),
])
def test_vllm_speculative_config_maps_sglang_names(engine: dict[str, Any], expected: dict[str, Any] | None) -> None:
    out = speculative_config(cfg_of(engine=engine).engine)
    assert (json.loads(out) if out else None) == expected


# --------------------------------------------------------------------------- argv: transformers


def test_transformers_argv_on_cpu() -> None:
    cfg = cfg_of(engine={"kind": "transformers", "continuous_batching": False, "context_length": 4096,
                         "speculative_algorithm": "EAGLE"})
    spec = spec_of(gpus=(), python="/opt/fleet/venv/bin/python3.11")
    assert get_profile("transformers").argv(cfg, spec) == [
        "/opt/fleet/venv/bin/transformers", "serve", MODEL,
        "--host", "127.0.0.1", "--port", "30000", "--device", "cpu"]


def test_transformers_argv_on_one_gpu_with_continuous_batching() -> None:
    cfg = cfg_of(engine={"kind": "transformers", "continuous_batching": True, "mem_fraction_static": 0.5,
                         "trust_remote_code": True, "extra_args": ["--log-level", "info"]})
    spec = spec_of(gpus=(6,), port=30006, api_key="ignored-on-loopback")
    assert get_profile("transformers").argv(cfg, spec) == [
        "/opt/fleet/venv/bin/transformers", "serve", MODEL,
        "--host", "127.0.0.1", "--port", "30006", "--device", "cuda",
        "--continuous-batching", "--cb-max-memory-percent", "0.5",
        "--trust-remote-code", "--log-level", "info"]


def test_transformers_device_choice() -> None:
    p = get_profile("transformers")
    dev = lambda c, s: p.argv(c, s)[p.argv(c, s).index("--device") + 1]  # noqa: E731
    assert dev(cfg_of(servers={"tensor_parallel": 2}), spec_of(gpus=(0, 1))) == "auto"
    assert dev(cfg_of(engine={"device": "cuda:0"}), spec_of(gpus=())) == "cuda:0"


def test_transformers_refuses_a_public_bind_it_cannot_protect() -> None:
    """transformers serve has no API key: exposing it beyond loopback must fail at build time."""
    cfg = cfg_of(servers={"host": "0.0.0.0", "api_key": "sk"})
    with pytest.raises(ConfigError, match="no API key support"):
        get_profile("transformers").argv(cfg, spec_of(host="0.0.0.0", api_key="sk"))


def test_request_model_is_the_path_only_for_transformers() -> None:
    spec = spec_of()
    assert {k: p.request_model(spec) for k, p in PROFILES.items()} == {
        "sglang": "qwen3-next", "vllm": "qwen3-next", "transformers": MODEL, "sim": "qwen3-next"}


# --------------------------------------------------------------------------- argv: sim


def test_sim_argv_takes_sim_config_and_seeds_per_server() -> None:
    cfg = cfg_of(engine={"kind": "sim", "sim": {"startup_s": 2.5, "first_request_delay_s": 3, "tokens_per_s": 500,
                                                "max_running_requests": 16, "kv_cache_tokens": 123456, "seed": 40}})
    spec = spec_of(index=2, port=30002, workdir="/tmp/fleet/", gpus=())
    assert get_profile("sim").argv(cfg, spec) == [
        PY, "/tmp/fleet/bin/fleet_sim.pyz",
        "--host", "127.0.0.1", "--port", "30002",
        "--model-name", "qwen3-next", "--model-path", MODEL,
        "--startup-s", "2.5", "--first-request-delay-s", "3.0", "--tokens-per-s", "500.0",
        "--max-running-requests", "16", "--kv-cache-tokens", "123456",
        "--context-length", "8192", "--seed", "42"]


def test_sim_argv_optional_flags() -> None:
    cfg = cfg_of(engine={"kind": "sim", "context_length": 4096, "speculative_algorithm": "EAGLE",
                         "extra_args": ["--fail-rate", "0.1"]},
                 servers={"host": "0.0.0.0", "api_key": "sk"})
    argv = get_profile("sim").argv(cfg, spec_of(host="0.0.0.0", api_key="sk", extra_args=("--x",)))
    assert argv[argv.index("--context-length") + 1] == "4096"
    assert argv[argv.index("--seed"):] == ["--seed", "0", "--speculative-algorithm", "EAGLE",
                                           "--fail-rate", "0.1", "--x"]
    assert "sk" not in argv


def test_every_argv_item_is_a_string() -> None:
    cfg = cfg_of(engine={"context_length": 10, "mem_fraction_static": 0.5, "speculative_algorithm": "EAGLE",
                         "speculative_num_steps": 2})
    for profile in PROFILES.values():
        assert all(type(a) is str for a in profile.argv(cfg, spec_of()))


# --------------------------------------------------------------------------- env


def test_env_pins_gpus_and_adds_the_users_env() -> None:
    cfg = cfg_of(engine={"env": {"NCCL_DEBUG": "WARN", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}},
                 servers={"tensor_parallel": 2})
    for profile in PROFILES.values():
        env = profile.env(cfg, spec_of(gpus=(4, 5)))
        # fleet's per-server GPUs win over a global value, which would stack every server on the same GPUs
        assert env == {"PYTHONUNBUFFERED": "1", "NCCL_DEBUG": "WARN", "CUDA_VISIBLE_DEVICES": "4,5"}


def test_the_api_key_travels_in_the_environment_never_in_argv() -> None:
    """`--api-key sk-…` stayed in /proc/<pid>/cmdline (readable by every user) for the server's
    life. Each engine gets the key in the variable it reads (vLLM: VLLM_API_KEY; SGLang through
    fleet's shim; the sim: FLEET_ENGINE_API_KEY); transformers serve has no key at all."""
    key = "sk-in-env-only-7f3a"
    cfg = cfg_of(servers={"api_key": key})
    expect = {"sglang": "FLEET_ENGINE_API_KEY", "vllm": "VLLM_API_KEY", "sim": "FLEET_ENGINE_API_KEY",
              "transformers": None}
    for name, var in expect.items():
        profile = get_profile(name)
        argv = profile.argv(cfg_of(engine={"kind": name}, servers={"api_key": key}), spec_of(api_key=key))
        assert not any(key in a for a in argv), (name, argv)
        env = profile.env(cfg, spec_of(api_key=key))
        assert (env.get(var) == key) if var else (key not in env.values()), (name, env)
        assert key not in json.dumps(profile.shown_env(cfg, env))


def test_env_on_cpu_sets_no_gpus_and_the_user_may_override_unbuffered() -> None:
    cfg = cfg_of(engine={"env": {"PYTHONUNBUFFERED": "0"}})
    assert get_profile("transformers").env(cfg, spec_of(gpus=())) == {"PYTHONUNBUFFERED": "0"}
    assert get_profile("sim").env(cfg_of(), spec_of(gpus=())) == {"PYTHONUNBUFFERED": "1"}


# --------------------------------------------------------------------------- classifiers on real logs

REAL_LOGS: list[tuple[str, str, str, list[str], dict[str, float | int], list[str]]] = [
    # file, engine, state, fatal labels, facts (exact), warning labels
    ("sglang_startup_hybrid_tp2.log", "sglang", "starting", [], {
        "avail_mem_after_load_gb": 19.08, "load_mem_usage_gb": 3.76, "mamba_cache_size": 82,
        "mamba_conv_state_gb": 0.13, "mamba_ssm_state_gb": 7.29, "kv_cache_tokens": 580364, "k_size_gb": 4.15,
        "v_size_gb": 4.15, "max_total_num_tokens": 580364, "chunked_prefill_size": 2048,
        "max_prefill_tokens": 16384, "max_running_requests": 1, "context_len": 8192,
        "available_gpu_mem_gb": 3.63}, []),
    ("sglang_startup_gemma3.log", "sglang", "starting", [], {
        "avail_mem_after_load_gb": 131.08, "load_mem_usage_gb": 8.13, "kv_cache_tokens": 834615,
        "k_size_gb": 54.12, "v_size_gb": 54.12}, []),
    ("sglang_cuda_graph_b200.log", "sglang", "starting", [], {
        "kv_cache_tokens": 2243474, "k_size_gb": 59.91, "v_size_gb": 59.91, "cuda_graph_s": 5.37}, []),
    ("sglang_startup_summary_ready.log", "sglang", "starting", [], {
        "cuda_graph_s": 5.92, "max_total_num_tokens": 2261377, "chunked_prefill_size": 16384,
        "max_prefill_tokens": 16384, "max_running_requests": 4096, "context_len": 128000,
        "available_gpu_mem_gb": 37.06}, []),
    ("sglang_ready_line.log", "sglang", "ready", [], {}, []),
    ("sglang_warmup_error_v03.log", "sglang", "failed", ["warmup-failed"], {
        "avail_mem_after_load_gb": 9.69, "cuda_graph_s": 2.19, "max_total_num_tokens": 56524,
        "max_prefill_tokens": 16384, "max_running_requests": 2049, "context_len": 32768}, []),
    ("sglang_decode_eagle3.log", "sglang", "starting", [], {
        "running_req": 1, "queue_req": 0, "accept_len": 1.80, "gen_throughput": 165.59}, []),
    ("sglang_prefill_queue_eagle2.log", "sglang", "starting", [], {"running_req": 6, "queue_req": 57}, []),
    ("sglang_scheduler_crash_npu.log", "sglang", "failed", ["child-died", "scheduler-crash"], {}, []),
    ("sglang_mamba_pingpong_crash.log", "sglang", "failed", ["scheduler-crash"], {"running_req": 1, "queue_req": 1}, []),
    ("sglang_mamba_capped.log", "sglang", "starting", [], {"max_running_capped_by_mamba": 9}, ["mamba-cap"]),
    ("sglang_not_enough_memory.log", "sglang", "failed", ["kv-no-memory"], {}, []),
    ("sglang_negative_profile_dp8.log", "sglang", "starting", [], {
        "avail_mem_after_load_gb": 21.73, "load_mem_usage_gb": 166.59}, ["kv-profile"]),
    ("sglang_wrapped_by_other_logger.log", "sglang", "starting", [], {}, []),
    ("vllm_startup_kv_glm4v.log", "vllm", "starting", [], {
        "kv_cache_mem_gb": 16.23, "kv_cache_tokens": 425424, "context_len": 65536, "max_concurrency": 6.49,
        "cuda_graph_s": 7.0}, []),
    ("vllm_startup_model_loading.log", "vllm", "starting", [], {
        "load_mem_usage_gb": 2.0513, "kv_cache_mem_gb": 33.31, "kv_cache_tokens": 1587648, "context_len": 2048,
        "max_concurrency": 775.22}, []),
    ("vllm_v1_concurrency_pr12569.log", "vllm", "starting", [], {
        "load_mem_usage_gb": 67.7229, "context_len": 2048, "max_concurrency": 10.79}, []),
    ("vllm_server_ready.log", "vllm", "ready", [], {}, []),
    ("vllm_server_ready_ansi.log", "vllm", "ready", [], {}, []),
    ("vllm_engine_core_failed.log", "vllm", "failed", ["engine-crash"], {"load_mem_usage_gb": 0.2533}, []),
    ("vllm_engine_core_exception_v1_0.log", "vllm", "failed", ["engine-crash"], {"load_mem_usage_gb": 0.2389}, []),
    ("vllm_no_cache_blocks.log", "vllm", "failed", ["kv-no-memory"], {}, []),
    ("vllm_gpu_busy.log", "vllm", "failed", ["gpu-busy"], {}, []),
    ("vllm_port_in_use.log", "vllm", "failed", ["port-in-use"], {}, []),
    ("vllm_tcpstore_eaddrinuse.log", "vllm", "failed", ["port-in-use"], {}, []),
    ("vllm_worker_exception.log", "vllm", "failed", ["engine-crash"], {}, []),
    ("vllm_running_specdecode.log", "vllm", "starting", [], {
        "gen_throughput": 124.5, "running_req": 1, "queue_req": 0, "accept_len": 2.66}, []),
    ("vllm_running_v0.log", "vllm", "starting", [], {"gen_throughput": 116.4, "running_req": 2, "queue_req": 0}, []),
    ("transformers_serve_tiny_cb.log", "transformers", "ready", [], {}, []),
    ("transformers_serve_no_model.log", "transformers", "ready", [], {}, []),
    ("transformers_serve_port_in_use.log", "transformers", "failed", ["port-in-use"], {}, []),
    ("transformers_serve_missing_model.log", "transformers", "failed", ["model-not-found"], {}, []),
    ("transformers_serve_no_cuda.log", "transformers", "failed", ["no-gpu"], {}, []),
]


@pytest.mark.parametrize(("name", "engine", "state", "labels", "facts", "warns"), REAL_LOGS,
                         ids=[r[0] for r in REAL_LOGS])
def test_classifier_on_real_log(name: str, engine: str, state: str, labels: list[str],
                                facts: dict[str, float | int], warns: list[str]) -> None:
    v = inspect_log(log(name), engine)
    assert v.state == state
    assert v.fatal_labels == labels
    assert [f.split(":", 1)[0] for f in v.fatal] == labels
    assert v.facts == facts
    assert all(type(v.facts[k]) is type(facts[k]) for k in facts), "ints stay ints, sizes stay floats"
    assert [w.split(":", 1)[0] for w in v.warnings] == warns


def test_every_real_log_is_covered() -> None:
    assert {p.name for p in LOGS.glob("*.log")} == {r[0] for r in REAL_LOGS}


def test_fatal_entry_is_label_line_then_indented_context() -> None:
    v = inspect_log(log("vllm_gpu_busy.log"), "vllm")
    head, *context = v.fatal[0].splitlines()
    assert head.startswith("gpu-busy: (EngineCore_DP0 pid=17374) ERROR 09-28 15:47:24 [core.py:718] ValueError: "
                           "Free memory on device (3.22/4.0 GiB) on startup")
    assert context and all(c.startswith("    ") for c in context)
    assert "raise ValueError(" in context[0]        # the line before
    assert "Process EngineCore_DP0:" in context[1]   # the lines after


def test_a_crash_repeated_by_every_rank_is_reported_once() -> None:
    """TP8 prints the same OOM eight times; the verdict names it once (first occurrence)."""
    lines = [f"[2025-06-01 10:00:0{r} TP{r}] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."
             for r in range(8)]
    v = inspect_log("\n".join(lines), "sglang")
    assert v.fatal_labels == ["oom"] and "TP0" in v.fatal[0].splitlines()[0]


@pytest.mark.parametrize(("line", "label"), [
    # sglang 0.5.10 wordings, read from its source
    ("[2026-01-01 00:00:00] DetokenizerManager hit an exception: Traceback (most recent call last):", "process-crash"),
    ("[2026-01-01 00:00:00] MultiTokenizerRouter hit an exception: Traceback (most recent call last):", "process-crash"),
    ("[2026-01-01 00:00:00 TP0] Decode out of memory. Try to lower your batch size.", "kv-exhausted"),
    ("[2026-01-01 00:00:00] SIGQUIT received. signum=None, frame=None. It usually means one child failed.",
     "child-died"),
])
def test_sglang_other_fatal_wordings(line: str, label: str) -> None:
    assert inspect_log(line, "sglang").fatal_labels == [label]


def test_reason_prefers_the_cause_over_the_crash_report() -> None:
    """The scheduler's "hit an exception" comes first in the log; the reason is the OOM under it."""
    v = inspect_log(log("sglang_scheduler_crash_npu.log") + log("sglang_not_enough_memory.log"), "sglang")
    assert v.fatal_labels == ["child-died", "scheduler-crash", "kv-no-memory"]
    assert v.reason == "kv-no-memory: RuntimeError: Not enough memory. Please try to increase --mem-fraction-static."
    assert inspect_log(log("sglang_scheduler_crash_npu.log"), "sglang").reason == (
        "child-died: [2026-03-03 03:53:36] Received sigquit from a child process. It usually means the child failed.")
    assert inspect_log(log("sglang_ready_line.log"), "sglang").reason is None


def test_sim_log_is_read_with_sglang_rules() -> None:
    for name in ("sglang_startup_hybrid_tp2.log", "sglang_warmup_error_v03.log", "sglang_ready_line.log"):
        assert inspect_log(log(name), "sim") == inspect_log(log(name), "sglang")


def test_ready_then_fatal_is_failed_not_ok() -> None:
    """A scheduler crash after the ready line (at run time) must still fail the server."""
    text = log("sglang_ready_line.log") + log("sglang_scheduler_crash_npu.log")
    v = inspect_log(text, "sglang")
    assert v.ready and not v.ok and v.state == "failed"


# --------------------------------------------------------------------------- drift and prefixes


@pytest.mark.parametrize(("line", "expected"), [
    # a field added in the middle (newer SGLang: dtype) and one appended at the end
    ("[2026-01-01 00:00:00 TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 1234, K size: 1.50 GB, "
     "V size: 1.50 GB, page_size: 64", {"kv_cache_tokens": 1234, "k_size_gb": 1.5, "v_size_gb": 1.5}),
    # MLA models print one combined size (shape quoted in SGLang-log parsers on GitHub)
    ("[2025-11-04 05:27:13 DP0 TP0 EP0] KV Cache is allocated. #tokens: 524288, KV size: 17.16 GB",
     {"kv_cache_tokens": 524288, "kv_size_gb": 17.16}),
    # summary with fields removed, reordered and a new one appended
    ("[x] context_len=4096, max_total_num_tokens=99, max_running_requests=8, new_field=1",
     {"context_len": 4096, "max_total_num_tokens": 99, "max_running_requests": 8}),
    # "Decode batch," (comma, newer) with fields appended after #queue-req
    ("[x TP0] Decode batch, #running-req: 17, #token: 9, accept len: 3.25, gen throughput (token/s): 1234.5, "
     "#queue-req: 4, timestamp: 1.0", {"running_req": 17, "accept_len": 3.25, "gen_throughput": 1234.5,
                                        "queue_req": 4}),
    # graph capture of another device, extra fields after the time
    ("Capture npu graph end. Time elapsed: 8.04 s. mem usage=0.80 GB. avail mem=10.30 GB.", {"cuda_graph_s": 8.04}),
    # sglang 0.5.10 formats (read from its source): iteration counter, and draft/piecewise
    # captures that are not the target model's decode graphs
    ("[x TP0] Decode batch [1200], #running-req: 3, #token: 9, token usage: 0.01, cuda graph: True, "
     "gen throughput (token/s): 88.10, #queue-req: 2", {"running_req": 3, "gen_throughput": 88.1, "queue_req": 2}),
    ("Capture draft cuda graph end. Time elapsed: 3.10 s. mem usage=0.20 GB. avail mem=30.00 GB.\n"
     "Capture piecewise CUDA graph end. Time elapsed: 9.99 s.\n"
     "Capture cuda graph end. Time elapsed: 12.50 s. mem usage=1.44 GB. avail mem=38.05 GB.", {"cuda_graph_s": 12.5}),
    # colour codes around the numbers' line, CRLF endings
    ("\x1b[32m[x TP0] Load weight end. avail mem=70.5 GB, mem usage=9.25 GB.\x1b[0m\r\n",
     {"avail_mem_after_load_gb": 70.5, "load_mem_usage_gb": 9.25}),
])
def test_sglang_lines_are_matched_loosely(line: str, expected: dict[str, float | int]) -> None:
    assert inspect_log(line, "sglang").facts == expected


def test_vllm_one_line_kv_summary_and_tiny_kv_cache_warning() -> None:
    """Newer vLLM joins the two lines (vllm#54662); below one full request a warning is raised."""
    v = inspect_log("(EngineCore pid=1) INFO 09-01 [kv_cache_utils.py:2031] GPU KV cache size: 19,584 tokens, "
                    "Maximum concurrency for 32,768 tokens per request: 0.60x", "vllm")
    assert v.facts == {"kv_cache_tokens": 19584, "context_len": 32768, "max_concurrency": 0.6}
    assert [w.split(":", 1)[0] for w in v.warnings] == ["kv-too-small"]


def test_vllm_ready_lines_in_both_wordings() -> None:
    assert inspect_log("INFO:     Application startup complete.", "vllm").ready
    assert inspect_log("(APIServer pid=1) INFO 07-21 [api_server.py:616] Starting vLLM server on http://0.0.0.0:8000",
                       "vllm").ready
    assert not inspect_log("INFO 02-27 19:31:24 api_server.py:912] vLLM API server version 0.7.3", "vllm").ready


def test_transformers_application_startup_complete_is_not_ready() -> None:
    """uvicorn prints it before binding: it precedes the port-in-use error (captured here)."""
    text = log("transformers_serve_port_in_use.log")
    assert "Application startup complete." in text
    head = text.split("ERROR:")[0]
    assert not inspect_log(head, "transformers").ready


def test_transformers_request_errors_after_ready_are_not_fatal() -> None:
    text = (log("transformers_serve_tiny_cb.log") + "ERROR:    Exception in ASGI application\n"
            "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\nValueError: bad request body\n")
    v = inspect_log(text, "transformers")
    assert v.ok
    before = "[transformers] Loading /m\nTraceback (most recent call last):\nValueError: bad config\n"
    assert inspect_log(before, "transformers").fatal_labels == ["startup-error"]


def test_fleet_launch_header_is_not_engine_output() -> None:
    """fleet writes the command first; its flags must not read as fatal or ready lines."""
    header = ("# fleet launch: /v/bin/python -m sglang.launch_server --mem-fraction-static 0.8 "
              "--served-model-name 'Not enough memory. Please try to increase --mem-fraction-static' "
              "'The server is fired up and ready to roll!'\n")
    v = inspect_log(header, "sglang")
    assert v == LogVerdict()


def test_benign_lines_that_mention_memory_or_errors_are_not_fatal() -> None:
    benign = "\n".join([
        "[2025-03-07 23:50:27 TP0] Automatically reduce --mem-fraction-static to 0.760 because this is a multimodal model.",
        "(VllmWorkerProcess pid=1222523) INFO 08-17 23:29:30 model_runner.py:1011] CUDA graphs can take additional 1~3 "
        "GiB memory per GPU. If you are running out of memory, consider decreasing `gpu_memory_utilization` or "
        "enforcing eager mode.",
        "NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC",
        "[2025-11-30 11:18:06] Endpoint '/get_model_info' is deprecated and will be removed in a future version.",
    ])
    for engine in PROFILES:
        assert inspect_log(benign, engine).fatal == []


# --------------------------------------------------------------------------- junk input


@pytest.mark.parametrize("engine", sorted(PROFILES))
def test_junk_gives_an_empty_verdict_without_raising(engine: str) -> None:
    rng = random.Random(1234)
    junk = bytes(rng.randrange(256) for _ in range(64 * 1024))
    for text in ("", "\n\n\n", junk, junk.decode("latin-1"), "\x00" * 1000, "x" * 1_000_000, None):
        v = inspect_log(text, engine)  # type: ignore[arg-type]
        assert v == LogVerdict(), repr(text)[:40]


def test_numbers_that_do_not_parse_are_skipped() -> None:
    v = inspect_log("KV Cache is allocated. #tokens: 12, K size: 1.2.3 GB, V size: . GB", "sglang")
    assert v.facts == {"kv_cache_tokens": 12}


def test_verdict_serialises_and_copies() -> None:
    v = inspect_log(log("sglang_warmup_error_v03.log"), "sglang")
    d = v.as_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["state"] == "failed" and d["fatal_labels"] == ["warmup-failed"]
    assert pickle.loads(pickle.dumps(v)) == v
    assert copy.deepcopy(v) == v


def test_a_long_generation_log_is_classified_quickly() -> None:
    """A two-day run logs hundreds of thousands of decode lines; inspection must stay cheap."""
    line = ("[2025-10-22 10:27:58 TP0] Decode batch. #running-req: 64, #token: 412, token usage: 0.31, accept len: 2.80, "
            "accept rate: 0.45, cuda graph: True, gen throughput (token/s): 4165.59, #queue-req: 7, \n")
    text = log("sglang_startup_hybrid_tp2.log") + log("sglang_ready_line.log") + line * 100_000
    # CPU time of this process, not wall time: other work on a busy machine does not count
    t0 = time.process_time()
    v = inspect_log(text, "sglang")
    assert time.process_time() - t0 < 15
    assert v.ok and v.facts["running_req"] == 64 and v.facts["queue_req"] == 7


# --------------------------------------------------------------------------- real transformers serve


@pytest.mark.transformers
def test_transformers_profile_runs_real_transformers_serve(tmp_path: Path) -> None:
    """The built argv starts the real CLI; /health, the ready line and request_model() hold.

    Protects what was learned by running it: the model is positional, `Uvicorn running on`
    is the ready line, and a pinned server answers only to the model path (a served name
    gets 400).
    """
    import os
    import signal
    import subprocess
    import sys

    import httpx

    pytest.importorskip("fastapi")
    pytest.importorskip("torch")
    if not (Path(sys.executable).parent / "transformers").exists():
        pytest.skip("no transformers CLI next to this python")
    from fleet import tinymodel

    model = tinymodel.build_tiny_model(tmp_path / "tiny")
    from conftest import free_port

    port = free_port()
    profile = get_profile("transformers")
    cfg = cfg_of(engine={"kind": "transformers", "continuous_batching": False})
    spec = spec_of(gpus=(), port=port, model_path=str(model), python=sys.executable, workdir=str(tmp_path))
    log_path = tmp_path / "serve.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **profile.env(cfg, spec)}
    with log_path.open("w") as out:
        proc = subprocess.Popen(profile.argv(cfg, spec), stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            verdict = profile.classify(log_path.read_text())
            assert not verdict.fatal, verdict.fatal
            assert proc.poll() is None, f"transformers serve exited {proc.returncode}:\n{log_path.read_text()}"
            try:
                if httpx.get(url + profile.ready_path, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "transformers serve not ready in 120 s"
            time.sleep(0.2)
        assert profile.classify(log_path.read_text()).ok
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        r = httpx.post(url + "/v1/chat/completions", json={**body, "model": profile.request_model(spec)}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        r = httpx.post(url + "/v1/chat/completions", json={**body, "model": spec.served_name}, timeout=60)
        assert r.status_code == 400 and "pinned" in r.text
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("kind", ["sglang", "vllm", "transformers", "sim"])
def test_every_engine_names_its_port_as_the_launch_record_looks_for_it(kind: str) -> None:
    """One server per slot (issue 33, item 4): the old server of a slot is found by its pid file and
    by the port its record names (`fleet.servers.recorded_pid`: "--port N" in its command line), so
    every engine's argv must carry the port as `--port N`, whatever port the config asks for now."""
    from fleet.servers import _expect

    cfg = cfg_of(engine={"kind": kind})
    argv = get_profile(kind).argv(cfg, spec_of(port=35601, gpus=()))
    cmdline = " " + " ".join(argv) + " "
    expect = _expect({"port": 35601})
    assert expect is not None and f" {expect} " in cmdline, argv
    assert f" {_expect({'port': 35600})} " not in cmdline
