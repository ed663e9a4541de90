"""The fleet config: one pydantic-settings model, read from TOML and `FLEET_*` env vars.

Precedence, highest first: `FLEET_<SECTION>__<KEY>` environment variables, then the TOML
file given with `-c/--config`, then the defaults below. The file is read by pydantic-settings'
`TomlConfigSettingsSource` (`read_toml`) and its data handed to the model as init values, the
source below the environment. Two things the source does not do are done around it, to keep
the errors one clear line with a remedy: it reads a missing file (or a directory) as empty —
every default — so the file is opened first and a missing one refused; and its syntax error
(tomllib's, "at line L, column C") becomes a ConfigError naming the file. Unknown keys are errors: a typo
must never silently fall back to a default on a machine billed by the hour.

The same model is the Prefect flow's parameter type, so every field carries a
description (it becomes the UI form and the README's schema table).
"""

from __future__ import annotations

import hashlib
import os
import json
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from fleet.errors import MASK, ConfigError
from fleet.net import is_loopback

EngineKind = Literal["sglang", "vllm", "transformers", "sim"]

# MASK (fleet.errors) is a value shown masked. A config that arrives with it (a flow-run
# parameter read back from the API) lost its secret on the way and must not be used.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# What an environment variable name may be (sh `export` and `env K=V` accept these): engine.env
# here, and every env a Node command sets (fleet.node).
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Environment variables fleet sets on the servers itself (the API key travels in them).
OWNED_ENV = {"VLLM_API_KEY": "servers.api_key", "FLEET_ENGINE_API_KEY": "servers.api_key",
             "FLEET_API_KEY": "servers.api_key", "FLEET_ENGINE_ENV": "engine.env"}


def no_control(value: Any, what: str) -> Any:
    """Refuse newline, NUL and other control characters in a path or name (or a list of them).

    A newline in a workdir made `status` parse no record and say "no servers recorded" while
    servers ran; a NUL cannot cross into argv at all. No legitimate path or name holds one."""
    items = value if isinstance(value, list | tuple) else [value]
    for item in items:
        text = str(item) if item is not None else ""
        m = _CONTROL.search(text)
        if m:
            raise ValueError(f"{what} holds a control character ({m.group()!r} at position {m.start()}) in "
                             f"{text!r}; paths and names may not contain newlines, NUL or other control characters")
    return value


def default_workdir(kind: str, user: str | None) -> str:
    """~/.cache/fleet of the user fleet runs as on the node: here $XDG_CACHE_HOME/fleet (or
    ~/.cache/fleet); over SSH the conventional home of the SSH user (/root or /home/<user>:
    set nodes[].workdir where homes live elsewhere)."""
    if kind == "local":
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        return os.path.join(cache if cache.startswith("/") else os.path.expanduser("~/.cache"), "fleet")
    import getpass

    user = user or getpass.getuser()
    return "/root/.cache/fleet" if user == "root" else f"/home/{user}/.cache/fleet"


def _expand_home(path: Any) -> Any:
    """`~` / `~/x` -> this user's home (only for paths on this machine)."""
    return os.path.expanduser(path) if isinstance(path, str) and path.startswith("~") else path


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class NodeConfig(_Section):
    """One machine that runs servers."""

    name: str = Field("local", min_length=1, pattern=r"^[a-z0-9][a-z0-9-]*$",
                      description="Short name used in artifacts, logs and ports tables (a-z, 0-9, -).")
    kind: Literal["local", "ssh"] = Field("local", description="'local': run on this machine (subprocess); 'ssh': over SSH.")
    host: str | None = Field(None, description="SSH host name or address (kind='ssh').")
    port: int = Field(22, ge=1, le=65535, description="SSH port.")
    user: str | None = Field(None, description="SSH user (default: the local user name).")
    key_file: Path | None = Field(None, description="Private key file for SSH auth.")
    key_secret: str | None = Field(None, description="Name of a Prefect Secret block holding the private key (instead of key_file).")
    block: str | None = Field(None, description="Name of a registered 'fleet-node' Prefect block that supplies host/port/user/key/host key.")
    known_hosts: Path | None = Field(None, description="known_hosts file to verify the host key against (default ~/.ssh/known_hosts).")
    host_key: str | None = Field(None, description="Pinned host key, 'ssh-ed25519 AAAA…' (takes precedence over known_hosts).")
    trust_on_first_use: bool = Field(False, description="Accept an unknown host key once and record it in known_hosts. Off by default.")
    connect_timeout_s: float = Field(15.0, gt=0, le=600, description="TCP + SSH handshake timeout.")
    keepalive_s: int = Field(15, ge=0, le=3600, description="SSH keepalive interval (0 = off).")
    workdir: str = Field("", description="Directory on the node for logs, pid files and manifests; must be the connecting user's and not writable by others (default: ~/.cache/fleet of that user; on a local node, ~ is your home).")
    ramdisk: str = Field("/dev/shm", description="RAM disk on the node where the model is staged.")
    gpus: list[int] | None = Field(None, description="GPU indices to use on this node (default: all that nvidia-smi lists).")
    servers: int | None = Field(None, ge=1, le=1024, description="Servers on this node (overrides servers.count here: nodes of different sizes in one fleet).")
    base_port: int | None = Field(None, ge=1024, le=65535, description="Port of server 0 on this node (overrides servers.base_port here; e.g. two nodes on one machine).")

    @field_validator("key_file", "known_hosts", mode="after")
    @classmethod
    def _expand_user(cls, v: Path | None) -> Path | None:
        return v.expanduser() if v is not None else None

    @field_validator("host", "user", "key_file", "key_secret", "block", "known_hosts", "host_key", "ramdisk",
                     "workdir", mode="before")
    @classmethod
    def _no_control(cls, v: Any, info: Any) -> Any:
        return no_control(v, f"nodes[].{info.field_name}")

    @field_validator("workdir", "ramdisk", mode="after")
    @classmethod
    def _absolute(cls, v: str, info: Any) -> str:
        # Absolute: the path goes to remote tools (find, rm, mkdir) where a leading '-' would
        # read as an option, and a relative path would depend on the remote shell's cwd.
        if v and not v.startswith("/"):
            raise ValueError(f"nodes[].{info.field_name} must be an absolute path (got {v!r})")
        return v

    @model_validator(mode="before")
    @classmethod
    def _local_home(cls, data: Any) -> Any:
        # A local node is this machine and this user: `~` in its paths is our home, so one
        # config (deployments/configs/local-sim.toml) gives each user their own directories.
        if isinstance(data, dict) and data.get("kind", "local") == "local":
            data = {**data, **{k: _expand_home(data[k]) for k in ("workdir", "ramdisk") if k in data}}
        return data

    @model_validator(mode="after")
    def _default_workdir(self) -> NodeConfig:
        # Per user, never a shared path: another user who created /tmp/fleet first owned it.
        if not self.workdir:
            self.__dict__["workdir"] = default_workdir(self.kind, self.user)
        return self

    @model_validator(mode="after")
    def _ssh_needs_host(self) -> NodeConfig:
        if self.kind == "ssh" and not (self.host or self.block):
            raise ValueError("an ssh node needs 'host' (or 'block' naming a fleet-node block)")
        if self.key_file and self.key_secret:
            raise ValueError("give either 'key_file' or 'key_secret', not both")
        return self


class SimConfig(_Section):
    """Behaviour of the simulated SGLang server (engine.kind = 'sim')."""

    startup_s: float = Field(1.0, ge=0, le=3600, description="Seconds before the server is ready.")
    first_request_delay_s: float = Field(0.0, ge=0, le=3600, description="Extra delay on the first request (CUDA graph / kernel warm-up).")
    tokens_per_s: float = Field(2000.0, gt=0, description="Decode speed per request stream.")
    max_running_requests: int = Field(64, ge=1, le=100000, description="Reported max running requests; excess requests queue.")
    kv_cache_tokens: int = Field(500000, ge=1, description="Reported KV cache size in tokens.")
    seed: int = Field(0, description="Seed: the same seed gives the same answers and faults.")


class EngineConfig(_Section):
    """Which inference engine to launch and how."""

    kind: EngineKind = Field("sim", description="Engine: sglang, vllm, transformers or sim (simulated SGLang).")
    packages: list[str] = Field(default_factory=list, description="Pinned packages for the node venv, e.g. ['sglang[all]==0.5.10'].")
    import_check: str | None = Field(None, description="Module imported (and timed) to prove the venv works; default per engine.")
    context_length: int | None = Field(None, ge=1, description="--context-length / --max-model-len.")
    mem_fraction_static: float | None = Field(None, gt=0, le=1, description="SGLang --mem-fraction-static / vLLM --gpu-memory-utilization.")
    trust_remote_code: bool = Field(False, description="--trust-remote-code.")
    speculative_algorithm: str | None = Field(None, description="SGLang --speculative-algorithm (e.g. EAGLE, EAGLE3, NEXTN).")
    speculative_num_steps: int | None = Field(None, ge=1, description="--speculative-num-steps.")
    speculative_eagle_topk: int | None = Field(None, ge=1, description="--speculative-eagle-topk.")
    speculative_num_draft_tokens: int | None = Field(None, ge=1, description="--speculative-num-draft-tokens.")
    speculative_draft_model_path: str | None = Field(None, description="--speculative-draft-model-path.")
    mamba_scheduler_strategy: str | None = Field(None, description="SGLang --mamba-scheduler-strategy (e.g. extra_buffer).")
    device: str | None = Field(None, description="transformers serve --device (cpu, cuda); default cuda when GPUs exist, else cpu.")
    continuous_batching: bool = Field(True, description="transformers serve --continuous-batching.")
    extra_args: list[str] = Field(default_factory=list, description="Extra argv appended to every server's command line.")
    env: dict[str, SecretStr] = Field(default_factory=dict, description="Extra environment variables for every server (values are secrets: masked everywhere fleet writes or logs, except names in env_public).")
    env_public: list[str] = Field(default_factory=list, description="Names in engine.env whose values are not secret and may be shown (e.g. ['NCCL_DEBUG']).")
    sim: SimConfig = Field(default_factory=SimConfig, description="Simulated server behaviour (kind='sim').")

    @field_validator("packages", "import_check", "speculative_draft_model_path", "extra_args", mode="before")
    @classmethod
    def _no_control(cls, v: Any, info: Any) -> Any:
        return no_control(v, f"engine.{info.field_name}")

    @field_validator("env", mode="after")
    @classmethod
    def _env_names(cls, v: dict[str, SecretStr]) -> dict[str, SecretStr]:
        for name, value in v.items():
            if not ENV_NAME.match(name):
                raise ValueError(f"engine.env: {name!r} is not a valid environment variable name "
                                 "(letters, digits and _, not starting with a digit)")
            if name in OWNED_ENV:
                raise ValueError(f"engine.env sets {name}, which fleet sets itself; use {OWNED_ENV[name]} instead")
            if value.get_secret_value() == MASK:
                raise ValueError(f"engine.env.{name} arrived masked ('**********'): the secret was lost on the way "
                                 "(flow-run parameters never carry secrets); pass the config as a TOML path or a "
                                 "block (block:…)")
        return v

    def env_values(self) -> dict[str, str]:
        """engine.env with the real values (for the server's environment only)."""
        return {k: v.get_secret_value() for k, v in self.env.items()}

    def shown_env(self) -> dict[str, str]:
        """engine.env as records, manifests and logs may show it: secret values masked."""
        return {k: v.get_secret_value() if k in self.env_public else MASK for k, v in self.env.items()}


class ModelConfig(_Section):
    """The model to serve."""

    source: str = Field("", description="Model directory on the node (often a network filesystem).")
    served_name: str | None = Field(None, description="Model name the API answers to (default: the directory name).")
    stage: bool = Field(True, description="Copy the model to the node's RAM disk once and serve it from there.")
    stage_margin_gb: float = Field(4.0, ge=0, description="Free space the RAM disk must keep beyond the model's size.")
    verify: bool = Field(False, description="Verify staged files by content hash (slower) rather than size + mtime.")
    copy_streams: int = Field(8, ge=1, le=64, description="Parallel copy streams while staging.")

    @field_validator("source", "served_name", mode="before")
    @classmethod
    def _no_control(cls, v: Any, info: Any) -> Any:
        return no_control(v, f"model.{info.field_name}")

    @property
    def name(self) -> str:
        return self.served_name or Path(self.source.rstrip("/")).name or "model"


class VenvConfig(_Section):
    """The engine's virtual environment on the node's local disk."""

    path: str = Field("/opt/fleet/venv", description="Venv path on the node; must be on a local (not network) filesystem (with only local nodes, ~ is your home).")
    python: str | None = Field(None, description="Python version or interpreter uv creates the venv with (default: uv's choice).")
    use_existing: bool = Field(False, description="Use the venv at 'path' as it is: no create, no install (only the import check).")
    index_url: str | None = Field(None, description="Package index for uv (default: uv's default).")
    find_links: list[str] = Field(default_factory=list, description="Extra local wheel directories for uv (--find-links).")
    system_certs: bool = Field(True, description="Let uv trust the node's system CA store (needed behind TLS-intercepting proxies).")
    slow_import_s: float = Field(20.0, gt=0, description="An engine import slower than this is flagged (network filesystem symptom).")

    @field_validator("path", "python", "index_url", "find_links", mode="before")
    @classmethod
    def _no_control(cls, v: Any, info: Any) -> Any:
        return no_control(v, f"venv.{info.field_name}")


class ServersConfig(_Section):
    """How many servers, where they listen."""

    count: int | None = Field(None, ge=0, le=1024, description="Servers per node (default: one per GPU group; 1 on a node without GPUs; 0: none, generation uses the [[endpoints]] only).")
    tensor_parallel: int = Field(1, ge=1, le=64, description="GPUs per server (tp size).")
    base_port: int = Field(30000, ge=1024, le=65535, description="Port of server 0; server i listens on base_port + i.")
    ports: list[int] | None = Field(None, description="Explicit ports, one per server (overrides base_port).")
    host: str = Field("127.0.0.1", description="Bind address on the node. Anything but loopback requires api_key.")
    api_key: SecretStr | None = Field(None, description="API key passed to the engine and sent by fleet's clients.")
    forward_ports: bool = Field(True, description="Reach servers on an SSH node through forwarded local ports.")
    ready_timeout_s: float = Field(900.0, gt=0, description="Longest wait for a server to become ready (death or fatal log lines fail at once).")
    stop_grace_s: float = Field(20.0, ge=0, description="Seconds between SIGTERM and SIGKILL when stopping a server.")
    extra_args_by_index: dict[int, list[str]] = Field(default_factory=dict, description="Extra argv for single servers, keyed by server index.")

    @model_validator(mode="after")
    def _check(self) -> ServersConfig:
        if self.ports is not None:
            bad = [p for p in self.ports if not 1 <= p <= 65535]
            if bad:
                raise ValueError(f"ports out of range 1..65535: {bad}")
            dup = sorted({p for p in self.ports if self.ports.count(p) > 1})
            if dup:
                raise ValueError(f"two servers on one port: {dup}; give each server its own port")
            if self.count is not None and len(self.ports) != self.count:
                raise ValueError(f"{len(self.ports)} ports for {self.count} servers")
        if not is_loopback(self.host) and self.api_key is None:
            raise ValueError(
                f"host={self.host!r} exposes servers beyond loopback without an API key (an empty or blank "
                "key counts as none); set servers.api_key (or FLEET_SERVERS__API_KEY), or bind 127.0.0.1 "
                "and use forwarded ports"
            )
        return self

    @field_validator("api_key", mode="after")
    @classmethod
    def _blank_key_is_none(cls, v: SecretStr | None) -> SecretStr | None:
        # "" (FLEET_SERVERS__API_KEY= in a shell) or spaces: no key. The engines treat an empty
        # --api-key as none, so the bind guard above must too, or it guards nothing.
        if v is None or not v.get_secret_value().strip():
            return None
        if v.get_secret_value() == MASK:
            raise ValueError("servers.api_key arrived masked ('**********'): the secret was lost on the way "
                             "(flow-run parameters never carry secrets); pass the config as a TOML path, "
                             "a block (block:…) or set FLEET_SERVERS__API_KEY where the flow runs")
        return v

    @field_validator("host", mode="before")
    @classmethod
    def _no_control(cls, v: Any) -> Any:
        return no_control(v, "servers.host")

    def port_for(self, index: int, node: NodeConfig | None = None) -> int:
        if node is not None and node.base_port is not None:
            base = node.base_port
        elif self.ports is not None:
            return self.ports[index]
        else:
            base = self.base_port
        port = base + index
        if port > 65535:
            raise ConfigError(f"server {index} would listen on port {port} > 65535",
                              remedy="lower servers.base_port or the server count")
        return port


class SmokeConfig(_Section):
    """Proof that each server answers."""

    prompt: str = Field("Say hello in five words.", description="User message of the smoke chat request.")
    max_tokens: int = Field(16, ge=1, le=4096, description="max_tokens of the smoke request.")
    first_timeout_s: float = Field(300.0, gt=0, description="Timeout of the first request (CUDA graph capture and kernel compilation happen here).")
    timeout_s: float = Field(60.0, gt=0, description="Timeout of later smoke requests.")
    stall_s: float = Field(60.0, ge=0, description="A server that, while a smoke request with a longer timeout waits, uses under a CPU-second and logs nothing for this long is hung, not warming up: failed then (0: off).")
    attempts: int = Field(4, ge=1, le=50, description="Smoke attempts per server before it is declared failed.")
    backoff_s: float = Field(2.0, ge=0, description="First retry delay; doubles each attempt.")
    backoff_max_s: float = Field(60.0, ge=0, description="Cap on one retry delay.")
    jitter: float = Field(0.25, ge=0, le=1, description="Random share added to each delay (0.25 = up to +25%).")
    kv_cache_min_ratio: float = Field(0.8, gt=0, le=1, description="Flag a server whose KV cache is below this share of its peers' median.")
    job_proof_s: float = Field(15.0, ge=0, le=3600, description="An adopted server that a live generation job of this fleet saw generate (a token counted, an answer) within this many seconds gets no smoke request: the job's progress is the proof, and a smoke would wait for a slot behind the job's rows. Older or no progress: smoked as usual (0: always smoke).")


GateAction = Literal["keep", "flag", "reject", "retry"]


class QualityConfig(_Section):
    """Per-row quality gates on each generated turn (fleet.generation.data.gates).

    keep: store the row as is; flag: store it with the reason in its `flags` column;
    reject: leave it out of the results, in quality_rejects.jsonl with the reason;
    retry: ask again with another seed, up to `retries` times, then reject."""

    empty_content: GateAction = Field("retry", description="Answer empty (after stripping whitespace) and no tool calls.")
    missing_reasoning: GateAction = Field("retry", description="No reasoning_content although reasoning is expected (see expect_reasoning).")
    think_markers: GateAction = Field("reject", description="'<think>' or '</think>' left in the content or the reasoning (reasoning parser missing or wrong).")
    truncated: GateAction = Field("flag", description="finish_reason 'length': the answer was cut at max_tokens.")
    repetition: GateAction = Field("flag", description="Degenerate repetition: the tail of the answer or of its reasoning is one short span repeated (see repetition_min_repeats).")
    model_mismatch: GateAction = Field("flag", description="The answer's `model` names another model than the one asked for (a Hub revision such as '@main' or a dated snapshot such as '-2024-08-06' is the same model).")
    implausible_usage: GateAction = Field("flag", description="Token counts no engine gives in the answer's time (over 100,000 completion tokens a second, over 2*max_tokens+16, a prompt over 2^24 tokens): the counts are dropped (left out of throughput and cost) whatever the action.")
    repetition_min_repeats: int = Field(8, ge=2, le=1000, description="Repeats of one span (1-64 words) at the end of the answer that count as degenerate.")
    retries: int = Field(2, ge=0, le=20, description="Extra tries (each with another seed) for a gate whose action is 'retry', before the row is rejected.")
    expect_reasoning: bool | None = Field(None, description="Whether rows should carry reasoning_content; unset: when chat_template_kwargs.enable_thinking is true.")


class GenerationConfig(_Section):
    """Defaults of the batch generation job."""

    max_tokens: int = Field(4096, ge=1, description="Default max output tokens per row.")
    temperature: float = Field(0.6, ge=0, le=5, description="Default sampling temperature.")
    top_p: float | None = Field(None, gt=0, le=1, description="Default top_p.")
    top_k: int | None = Field(None, ge=-1, description="Default top_k (-1: off; SGLang and vLLM take it in the request body).")
    min_p: float | None = Field(None, ge=0, le=1, description="Default min_p.")
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="Default presence_penalty.")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="Default frequency_penalty.")
    repetition_penalty: float | None = Field(None, gt=0, le=10, description="Default repetition_penalty (SGLang/vLLM extension; 1.0 = off).")
    seed: int | None = Field(None, description="Default sampling seed.")
    stop: list[str] | None = Field(None, description="Default stop strings.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Default chat_template_kwargs (e.g. enable_thinking).")
    reasoning_effort: dict[str, float] | None = Field(None, description="Per-row random reasoning_effort (gpt-oss style): choice -> weight, e.g. {low = 4, medium = 4, high = 2}; drawn from the row id (seeded, stable across resumes) unless the row sets its own.")
    regenerate: Literal["last-turn", "all-turns"] = Field("last-turn", description="'last-turn': generate the answer to the conversation as given (a trailing assistant turn is dropped); 'all-turns': regenerate every assistant turn in order, each request holding the regenerated earlier turns.")
    return_token_ids: bool = Field(False, description="Ask the engine for the token ids of each answer (the request field return_token_ids of vLLM and of recent SGLang: the prompt as rendered, the completion as sampled) and store them per turn (the token_ids column), for `fleet export --format speculators-tokens`.")
    input_rules: Literal["openai", "specforge"] = Field("openai", description="Which rows are rejects at input: 'openai': what an OpenAI-compatible server refuses; 'specforge': also what SpecForge's conversation check refuses (two user turns in a row, an empty user or system message, tool turns, content parts), before any request is spent on them.")
    limit: int | None = Field(None, ge=1, description="Read only the first N input rows (try a job on a few rows; raise it later to go on).")
    quality: QualityConfig = Field(default_factory=QualityConfig, description="Per-row quality gates.")

    @field_validator("reasoning_effort")
    @classmethod
    def _weights(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is not None and (not v or any(w <= 0 for w in v.values())):
            raise ValueError("reasoning_effort needs at least one choice, each with a weight > 0")
        return v
    max_concurrency_per_server: int = Field(256, ge=1, le=100000, description="Cap on in-flight requests per server.")
    request_timeout_s: float = Field(1800.0, gt=0, description="Timeout of one generation request.")
    max_response_mib: float = Field(64.0, gt=0, le=4096, description="Cap on one answer's size in MiB (far above any real completion): a bigger answer ends that request as an invalid answer, read no further; a server that keeps sending them is taken out.")
    max_attempts: int = Field(6, ge=1, le=100, description="Attempts per row before it goes to the errors file.")
    stall_s: float = Field(30.0, gt=0, le=3600, description="A server with rows in flight whose generated-token count does not advance for this long (and that finishes no row) is probed (/health_generate, else a one-token chat) and taken out if the probe fails, whatever the row length. Token counts come from the engine's /metrics (SGLang with --enable-metrics, vLLM, the sim) or, for transformers serve, from its streamed answers; a server whose /metrics counts no tokens is judged by finished rows instead (stall_min_s, stall_max_s).")
    stall_min_s: float = Field(30.0, gt=0, description="Servers that count no tokens: floor of the row clock, 3 x the server's recent p99 row time.")
    stall_max_s: float = Field(300.0, gt=0, description="Servers that count no tokens: ceiling of the row clock (also its value before any row completed).")
    commit_every_s: float = Field(10.0, ge=0.5, le=600, description="Seconds between commits of finished rows to Parquet shards (a kill -9 regenerates at most the rows finished since the last commit).")
    hedge_max_extra_fraction: float = Field(0.05, ge=0, le=1, description="Backup requests (MapReduce's backup tasks, per row): once the queue is empty, a server with free slots re-sends rows in flight elsewhere that it could finish sooner (a slower server's, an overdue row), and the rows of a server under stall suspicion go elsewhere before its probe decides; the first answer wins, the other request is cancelled, the row is written once. The tokens spent on cancelled losers stay within this share of the run's completion tokens (each backup reserves its max_tokens until it ends). 0: no backups.")
    retry_after_max_s: float = Field(120.0, gt=0, le=86400, description="A server that answers HTTP 429 (or 503 with Retry-After) gets no new row until the Retry-After it sent (seconds or an HTTP date; without one: 1 s, doubling while it keeps refusing), but never waits longer than this; its in-flight limit is halved and grows back by one per limit's worth of answers, and the row's attempt is not charged.")
    rate_limit_down_s: float = Field(900.0, gt=0, description="A server that has answered nothing but rate limits (429, 503 with Retry-After) for this long is taken out as down, with that reason, and probed back like any other.")
    admit_max_s: float = Field(600.0, gt=0, description="A job in which no server has been admitted since it started (each admission keeps failing) fails after this long, with each server's reason and a remedy, instead of waiting paused.")
    paused_max_s: float = Field(21600.0, gt=0, description="A job whose every server has been down for this long (servers that were up before) fails, with each server's reason and a remedy; until then it waits paused, and its console line says why.")
    shard_rows: int = Field(10000, ge=1, description="Rows per committed Parquet shard.")
    chunk_rows: int | None = Field(None, ge=1, description="Several nodes: the largest chunk of input lines one node takes at a time (default: rows / (8 × nodes), 100 to 20,000; later chunks shrink to a quarter of it, then by the nodes' measured rates).")
    node_lost_s: float = Field(120.0, gt=0, description="Several nodes: a node that does not answer, or whose runner stops moving or has no server up, for this long is lost; its chunk goes to another node.")
    runner_start_s: float = Field(300.0, gt=0, description="Several nodes: how long a chunk's runner may take to write its first progress (its start: Python's imports, reading its chunk, loading the ids done) before its node is lost; a start on a busy node can take longer than node_lost_s, which counts from then on. A node that does not answer is lost after node_lost_s all the same.")
    price_per_gpu_hour: float | None = Field(None, ge=0, description="GPU-hour price, to report measured $ per M tokens.")


ENV_PREFIX = "FLEET_"

class EndpointConfig(_Section):
    """An OpenAI-compatible server fleet did not start (an SGLang router, a vLLM deployment, a
    shared endpoint): the job's rows go to it beside (or instead of) the servers fleet launches."""

    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9][a-z0-9-]*$",
                      description="Short name (a-z, 0-9, -): the server is `endpoint/NAME` in tables, progress and each row.")
    url: str = Field(description="Base URL as the runner's node reaches it, e.g. http://10.0.0.5:30000 (a trailing /v1 is dropped; no credentials in it).")
    model: str | None = Field(None, min_length=1, description="The model name requests carry (default: the first id its /v1/models lists).")
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="Environment variable, where the flow runs, that holds its API key (handed to the runner through a 0600 file, never argv or job.json).")
    api_key_secret: str | None = Field(None, pattern=r"^[a-z0-9-]+$", description="Name of a Prefect Secret block that holds its API key (instead of api_key_env).")
    max_in_flight: int | None = Field(None, ge=1, le=100000, description="Requests in flight to it (default: its /server_info max_running_requests, else generation.max_concurrency_per_server). An SGLang router: the sum over its workers.")
    engine: Literal["openai", "sglang", "vllm", "transformers", "sim"] = Field("openai", description="What serves it, for the stall watchdog's progress signal: sglang, vllm and sim count tokens at /metrics; openai (anything else, a router) and transformers stream their answers, each chunk is progress.")

    @field_validator("url", mode="after")
    @classmethod
    def _url(cls, v: str) -> str:
        from urllib.parse import urlsplit

        no_control(v, "endpoints[].url")
        parts = urlsplit(v.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"endpoints[].url must be an http:// or https:// URL with a host (got {v!r})")
        if parts.username or parts.password:
            # a URL is written to job.json, progress, the manifest and every row: never a secret
            raise ValueError("endpoints[].url must not carry credentials; give the key with api_key_env or "
                             "api_key_secret")
        if parts.query or parts.fragment:
            raise ValueError(f"endpoints[].url takes no query or fragment (got {v!r})")
        url = v.strip().rstrip("/")
        return url[:-3].rstrip("/") if url.endswith("/v1") else url

    @model_validator(mode="after")
    def _one_key_source(self) -> EndpointConfig:
        if self.api_key_env and self.api_key_secret:
            raise ValueError(f"endpoint {self.name!r}: give either 'api_key_env' or 'api_key_secret', not both")
        return self


# FLEET_* variables that are not config keys: the env source skips them (FLEET_VENV would
# otherwise be read as the whole [venv] section). Every other FLEET_* variable is read as
# config, so one that names no setting is an error, like an unknown TOML key (a misspelled
# section must not be silently ignored). Add a variable here when fleet or its tooling uses one.
NOT_CONFIG_ENV: dict[str, str] = {
    "FLEET_API_KEY": "the servers' API key, handed to the detached runner (fleet/generation/job/runner.py)",
    "FLEET_ENGINE_ENV": "engine.env as JSON, handed to the detached runner (fleet/generation/job/remote.py)",
    "FLEET_ENGINE_API_KEY": "the API key, handed to an SGLang or sim server (fleet/engines/base.py)",
    "FLEET_DEMO_DIR": "where `fleet demo` keeps its state (fleet/demo.py)",
    "FLEET_VENV": "the venv dev.sh creates",
    "FLEET_PYTHON": "the interpreter dev.sh builds the venv with",
    "FLEET_WHEELS": "local wheel directories dev.sh installs from",
    "FLEET_TEST_SEED": "seed of the randomized store test (tests/test_gen_store.py)",
    "FLEET_FUZZ_EXAMPLES": "jobs of the answer fuzz test (tests/test_gen_answers.py)",
    "FLEET_TEST_SLOWDOWN": "factor the test suite's deadlines are multiplied by (tests/harness.py; default measured)",
    "FLEET_TEST_SLOWDOWN_MEASURED": "the factor the test suite measured at its start (tests/harness.py; set by it)",
    "FLEET_TEST_MYPY": "0: `./dev.sh test` skips its type check step (dev.sh)",
    "FLEET_QUICK_UP": "0: `fleet up` and `fleet generate` always run the flow in Prefect's engine, never the "
                      "quick path (flows/quickup.py, flows/quickgen.py; default 1)",
    "FLEET_QUICK_UP_DEBUG": "1: `fleet up` and `fleet generate` say on stderr why they left the quick path "
                            "(flows/quickup.py, flows/quickgen.py)",
    "FLEET_PREFECT_SERVER_IDLE_S": "idle seconds before the shared local Prefect server stops (flows/localserver.py)",
    "FLEET_PREFECT_PORT": "the port of the shared local Prefect server, int 1024-65535 (flows/localserver.py)",
    "FLEET_PREFECT_PORTS": "ports the shared local Prefect server may use, lo-hi within 1024-65535, the first free "
                           "one (flows/localserver.py)",
    "FLEET_PREFECT_SERVER_DIR": "the local Prefect server's state directory, in its own environment",
    "FLEET_STORE_SECRET": "names a Prefect Secret block holding the object store's variables: AWS_*, HF_TOKEN, … (blocks/credentials.py)",
    "FLEET_STORE_AWS_BLOCK": "names a prefect-aws AwsCredentials or S3Bucket block holding the object store's AWS credentials (blocks/credentials.py)",
    "FLEET_GCS_CREDENTIALS_JSON": "a Google credentials file's content, handed to a detached runner (fleet/generation/data/objstore.py)",
    "FLEET_GCWATCH_DIR": "where the GPU bench has the engine write its GC and memory record (bench/gcwatch/sitecustomize.py)",
    # set by fleet in the servers' own environment (never read as config, but a process
    # started from a server's shell may inherit them)
    "FLEET_ENGINE_API_KEY": "the API key handed to a server",
    "FLEET_ENGINE_ENV": "engine.env handed to a server",
}


class FleetConfig(BaseSettings):
    """A fleet: nodes, the engine, the model, and how to check and use the servers."""

    model_config = SettingsConfigDict(
        env_prefix="FLEET_", env_nested_delimiter="__", extra="forbid", validate_default=True,
    )

    name: str = Field("fleet", pattern=r"^[a-z0-9][a-z0-9-]*$", description="Fleet name (a-z, 0-9, -); prefixes pid files, artifacts and flow run names.")
    nodes: list[NodeConfig] = Field(default_factory=lambda: [NodeConfig()], min_length=1, description="Machines that run servers.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Inference engine.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Model to serve.")
    venv: VenvConfig = Field(default_factory=VenvConfig, description="Engine venv on each node.")
    servers: ServersConfig = Field(default_factory=ServersConfig, description="Servers per node and their ports.")
    smoke: SmokeConfig = Field(default_factory=SmokeConfig, description="Smoke test of each server.")
    generation: GenerationConfig = Field(default_factory=GenerationConfig, description="Batch generation defaults.")
    endpoints: list[EndpointConfig] = Field(default_factory=list, description="OpenAI-compatible servers fleet did not start, used by generation beside (or, with servers.count = 0, instead of) the ones it launches.")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment first: FLEET_* overrides whatever the TOML file (passed as init kwargs) says.
        if isinstance(env_settings, EnvSettingsSource):
            env_settings.env_vars = {k: v for k, v in env_settings.env_vars.items()
                                     if k.upper() not in NOT_CONFIG_ENV}
        return (env_settings, init_settings)

    @model_validator(mode="before")
    @classmethod
    def _local_venv_home(cls, data: Any) -> Any:
        # `~` in venv.path is our home when every node is this machine (see NodeConfig._local_home)
        if not isinstance(data, dict):
            return data
        nodes = data.get("nodes") or [{}]
        local = isinstance(nodes, list) and all(
            (n.get("kind", "local") if isinstance(n, dict) else getattr(n, "kind", None)) == "local" for n in nodes)
        venv = data.get("venv")
        if local and isinstance(venv, dict) and "path" in venv:
            data = {**data, "venv": {**venv, "path": _expand_home(venv["path"])}}
        return _env_names_keep_case(data)

    @model_validator(mode="after")
    def _unique_nodes(self) -> FleetConfig:
        names = [n.name for n in self.nodes]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"node names must be unique; repeated: {dup}")
        return self

    @model_validator(mode="after")
    def _extra_args_own_nothing(self) -> FleetConfig:
        # Imported here: the engine profiles import this module for their type hints.
        from fleet.engines import PROFILES
        from fleet.engines.base import owned_flag

        profile = PROFILES[self.engine.kind]
        lists: list[tuple[str, list[str]]] = [("engine.extra_args", self.engine.extra_args)]
        lists += [(f"servers.extra_args_by_index[{i}]", a) for i, a in sorted(self.servers.extra_args_by_index.items())]
        for where, args in lists:
            hit = owned_flag(args, profile.owned_flags, profile.flag_syntax)
            if hit:
                arg, flag, field_name = hit
                # the name as written, never its value: `--api-key=sk-…` would put the key in the message
                shown_arg = arg.split("=", 1)[0] + ("=…" if "=" in arg else "")
                raise ValueError(f"{where} sets {flag} ({shown_arg!r}), which fleet sets itself for {self.engine.kind}; "
                                 f"use {field_name} instead")
            hit = owned_flag(args, {f: "" for f in profile.settings_files}, profile.flag_syntax)
            if hit:
                shown = hit[1] if hit[0] == hit[1] else f"{hit[1]} ({hit[0]!r})"
                raise ValueError(f"{where} passes {shown}: {self.engine.kind} would read its settings "
                                 f"from a file fleet cannot check, which may set the host, the port or the API key "
                                 f"fleet sets; give each setting as its own flag in {where} instead (fleet checks "
                                 f"those)")
        return self

    @model_validator(mode="after")
    def _endpoints_fit(self) -> FleetConfig:
        names = [e.name for e in self.endpoints]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"endpoint names must be unique; repeated: {dup}")
        if self.servers.count == 0 and not self.endpoints:
            raise ValueError("servers.count = 0 launches no server: name the servers to use in [[endpoints]], or "
                             "let fleet launch some (servers.count >= 1)")
        if self.endpoints and len(self.nodes) > 1:
            raise ValueError("[[endpoints]] join a one-node job (its runner runs on that node); this config has "
                             f"{len(self.nodes)} nodes: keep one node, or run the endpoints in a config of their own")
        return self

    @property
    def launches_servers(self) -> bool:
        """False when generation uses only [[endpoints]] (servers.count = 0): nothing to bring up."""
        return self.servers.count != 0

    def fingerprint(self) -> str:
        """Stable short hash of the config (secrets excluded), for manifests and cache keys."""
        data = self.model_dump(mode="json", exclude={"servers": {"api_key"}})
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    def node(self, name: str) -> NodeConfig:
        """The node of this config called `name`."""
        for n in self.nodes:
            if n.name == name:
                return n
        raise ConfigError(f"fleet {self.name!r} has no node {name!r} (nodes: {', '.join(n.name for n in self.nodes)})",
                          remedy="name a node of the config")

    def api_key(self) -> str | None:
        return self.servers.api_key.get_secret_value() if self.servers.api_key else None

    def secrets(self) -> list[str]:
        """Every secret value in this config (the API key, engine.env values not in env_public),
        longest first: what redaction replaces in any text fleet shows."""
        found = [self.api_key() or ""]
        found += [v.get_secret_value() for k, v in self.engine.env.items() if k not in self.engine.env_public]
        return sorted({s for s in found if s}, key=len, reverse=True)


def _allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names allowed at `loc` (used to say what a typo should have been)."""
    current: Any = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        # unwrap list[X] / X | None
        for arg in getattr(ann, "__args__", ()) or ():
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                ann = arg
        current = ann
    return sorted(getattr(current, "model_fields", {}).keys())


def _env_names_keep_case(data: dict[str, Any]) -> dict[str, Any]:
    """FLEET_ENGINE__ENV__NCCL_DEBUG=INFO sets NCCL_DEBUG, not nccl_debug.

    pydantic-settings matches FLEET_* names case-insensitively and hands the keys of a dict
    field over lowercased; environment variable names are case-sensitive, so take each name's
    case back from the variable that set it (it overrides the file's value of the same name)."""
    engine = data.get("engine")
    if not isinstance(engine, dict) or not isinstance(engine.get("env"), dict):
        return data
    prefix = f"{ENV_PREFIX}ENGINE__ENV__"
    named = {n[len(prefix):].lower(): n[len(prefix):] for n in os.environ
             if n.upper().startswith(prefix) and n.upper() not in NOT_CONFIG_ENV}
    if not named:
        return data
    from_env = {named[k]: v for k, v in engine["env"].items() if k in named and named[k] != k}
    kept = {k: v for k, v in engine["env"].items() if not (k in named and named[k] != k)}
    return {**data, "engine": {**engine, "env": {**kept, **from_env}}}


def _unwrap(ann: Any) -> Any:
    """X | None -> X (the config's optional fields)."""
    args = typing.get_args(ann)
    if typing.get_origin(ann) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else ann
    return ann


def _env_problem(name: str) -> str | None:
    """Why the FLEET_* variable `name` names no setting, or None when it names one."""
    parts = name[len(ENV_PREFIX):].lower().split("__")
    current: Any = FleetConfig
    path: list[str] = []
    for i, part in enumerate(parts):
        fields = getattr(current, "model_fields", None)
        if fields is None:
            return None   # past a dict field (engine.env, …): any key is allowed
        if part not in fields:
            where = "in " + ".".join(path) if path else "at the top level"
            return (f"unknown key {part!r} {where}; allowed there: {', '.join(sorted(fields))}")
        path.append(part)
        ann = _unwrap(fields[part].annotation)
        origin = typing.get_origin(ann)
        rest = len(parts) - i - 1
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            current = ann
        elif origin is dict:
            return None if rest <= 1 else f"{'.'.join(path)} takes one level of keys"
        elif rest:
            kind = "a list" if origin is list else "a single value"
            return (f"{'.'.join(path)} is {kind}: set it whole ({ENV_PREFIX}{'__'.join(path).upper()}"
                    f"{'=<JSON list>' if origin is list else ''}) or in the TOML file")
    return None


def env_problems(environ: dict[str, str] | None = None) -> list[str]:
    """One line per FLEET_* environment variable that names no config setting."""
    env = os.environ if environ is None else environ
    out = []
    for name in sorted(env):
        if not name.upper().startswith(ENV_PREFIX) or name.upper() in NOT_CONFIG_ENV:
            continue
        why = _env_problem(name)
        if why:
            out.append(f"environment variable {name}: {why}")
    return out


def _env_var_for(loc: tuple[Any, ...], environ: dict[str, str] | None = None) -> str | None:
    """The FLEET_* variable that supplied the value at `loc`, if one did (env beats the file)."""
    env = os.environ if environ is None else environ
    want = [str(p).lower() for p in loc]
    best: str | None = None
    for name in env:
        if not name.upper().startswith(ENV_PREFIX) or name.upper() in NOT_CONFIG_ENV:
            continue
        parts = name[len(ENV_PREFIX):].lower().split("__")
        # FLEET_SERVERS (a whole section) supplies servers.base_port; FLEET_NODES__0__X breaks `nodes`
        n = min(len(parts), len(want))
        if n and parts[:n] == want[:n] and (best is None or len(parts) > len(best.split("__"))):
            best = name
    return best


def format_validation_error(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(err.get("loc", ()))
        key = ".".join(str(p) for p in loc) or "(top level)"
        var = _env_var_for(loc) if loc else None
        where = f"environment variable {var}" if var else source
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(FleetConfig, loc)
            lines.append(f"{where}: {key}: unknown key; allowed here: {', '.join(allowed)}")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        given = err.get("input")
        # an endpoint's url is refused when it carries credentials: never echo it
        secret = any(str(p) in ("api_key", "env", "private_key", "url") for p in loc)
        shown = "" if secret or isinstance(given, dict | list) or given is None else f" (got {given!r})"
        lines.append(f"{where}: {key}: {msg}{shown}")
    return "\n".join(lines)


_ENV_REMEDY = (f"fix or unset the variable: every {ENV_PREFIX}* variable is read as config "
               f"({ENV_PREFIX}<SECTION>__<KEY>), except {', '.join(NOT_CONFIG_ENV)}")


def _build(data: dict[str, Any], source: str) -> FleetConfig:
    """FleetConfig(**data) with FLEET_* env applied; every problem (file and env) in one ConfigError."""
    from pydantic_settings import SettingsError

    problems = env_problems()
    try:
        cfg = FleetConfig(**data)
    except ValidationError as exc:
        # an unknown variable also breaks validation (FLEET_NODES__0__X): say it once, the clear way
        bad = {ln.split(":", 1)[0] for ln in problems}
        lines = [ln for ln in format_validation_error(exc, source).splitlines() if ln.split(":", 1)[0] not in bad]
        # from None: pydantic's own text echoes every input (secrets too) into a traceback
        raise ConfigError("\n".join(problems + lines), remedy=_ENV_REMEDY if problems else None) from None
    except SettingsError as exc:
        # a whole section given as one variable that is not valid JSON
        import re

        m = re.search(r'field "([^"]+)"', str(exc))
        var = _env_var_for((m.group(1),)) if m else None
        raise ConfigError("\n".join(problems + [
            f"environment variable {var or ENV_PREFIX + '…'}: not valid JSON "
            "(a section or list set by one variable must be JSON, e.g. '{\"base_port\": 31000}')"]),
            remedy=_ENV_REMEDY) from exc
    if problems:
        raise ConfigError("\n".join(problems), remedy=_ENV_REMEDY)
    return cfg


def read_toml(path: Path) -> dict[str, Any]:
    """The config file's data, read by pydantic-settings' TomlConfigSettingsSource; a ConfigError
    naming the file, the line and the remedy when it cannot be read."""
    from pydantic_settings import TomlConfigSettingsSource

    try:
        # The source reads a missing file, or a directory, as empty (every default): a mistyped
        # -c must stop here instead of bringing up a default fleet.
        with path.open("rb"):
            pass
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found",
                          remedy="pass an existing file with -c; examples are in deployments/configs/") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    try:
        return TomlConfigSettingsSource(FleetConfig, toml_file=path)()
    except tomllib.TOMLDecodeError as exc:   # its message ends "(at line L, column C)"
        raise ConfigError(f"{path}: not valid TOML: {exc}", remedy="fix the syntax at the line shown") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: not UTF-8 text (byte {exc.start})",
                          remedy="save the file as UTF-8") from None


def load_config(path: str | Path | None = None, **overrides: Any) -> FleetConfig:
    """Read a fleet config from TOML (if given) + FLEET_* env; raise ConfigError with every problem."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        data = read_toml(Path(path))
    data.update(overrides)
    return _build(data, source)


def config_from_param(value: FleetConfig | dict[str, Any] | str | None) -> FleetConfig:
    """Accept what a flow parameter can carry: a config, its dict, or a TOML path."""
    if isinstance(value, FleetConfig):
        return value
    if value is None or isinstance(value, str):
        return load_config(value)
    return _build(value, "flow parameter 'config'")
