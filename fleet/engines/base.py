"""What every engine profile shares: the launch spec, the log verdict, and the log scanner.

An engine profile is pure: it turns a config and a `ServerSpec` into an argv list and an
environment, and turns log text into a `LogVerdict`. It never touches a machine; the
launch stage runs what it builds (through `fleet.node`) and feeds the log back in.

Log classification is line by line, with compiled regexes matched loosely (`search`, not
`match`): every engine wraps its lines in prefixes that change between versions and
deployments (`[2025-11-30 12:50:10 TP0] `, `(EngineCore_DP0 pid=441) INFO 11-24 … `,
another program's logger, CI prefixes, colour codes), and appends fields over time. So a
rule keys on the stable words of one message and reads each number with its own regex,
never on the layout of a whole line. A cheap substring test (`needle`) runs before each
regex so that scanning a multi-day log stays fast.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from fleet.errors import MASK
from fleet.net import LOOPBACK_HOSTS, connect_host  # noqa: F401  (LOOPBACK_HOSTS: re-exported)

if TYPE_CHECKING:
    from fleet.config import FleetConfig

# How SGLang and the sim receive servers.api_key (vLLM reads its own VLLM_API_KEY).
API_KEY_ENV = "FLEET_ENGINE_API_KEY"

# Facts that are whole numbers; every other numeric fact is a float.
INT_FACTS = frozenset({
    "kv_cache_tokens", "mamba_cache_size", "max_running_capped_by_mamba", "max_total_num_tokens",
    "chunked_prefill_size", "max_prefill_tokens", "max_running_requests", "context_len",
    "running_req", "queue_req",
})

# fleet writes the launch command as the log's first line (fleet.servers.launch); it names
# flags such as --mem-fraction-static and must never be read as engine output.
_FLEET_HEADER = "# fleet"
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# Labels that say a process died, not why; `LogVerdict.reason` prefers any other label.
GENERIC_FATAL_LABELS = frozenset({"scheduler-crash", "process-crash", "child-died", "engine-crash",
                                  "startup-error"})
_MAX_LINE = 400       # characters kept of one line in a verdict
_CONTEXT_BEFORE = 1   # lines of context kept around a fatal line
_CONTEXT_AFTER = 3


@dataclass(frozen=True)
class ServerSpec:
    """One server on one node, as the launch stage planned it."""

    node: str                      # node name (NodeConfig.name)
    index: int                     # server index on the node (0..)
    gpus: tuple[int, ...]          # GPU indices for CUDA_VISIBLE_DEVICES (empty on CPU)
    host: str                      # bind address on the node
    port: int                      # listen port
    model_path: str                # path on the node (RAM-disk copy or source)
    served_name: str               # model name the API answers to (where the engine lets us choose)
    python: str                    # the node venv's python executable (absolute path)
    workdir: str                   # node workdir; the sim lives at f"{workdir}/bin/fleet_sim.pyz"
    api_key: str | None = None     # API key the engine enforces (None: no auth)
    extra_args: tuple[str, ...] = ()   # per-server extra argv (servers.extra_args_by_index)

    @property
    def connect_host(self) -> str:
        """The address that reaches this server from its own node (a wildcard bind -> loopback)."""
        return connect_host(self.host)


@dataclass
class LogVerdict:
    """What one engine log says: ready or not, fatal lines, parsed numbers, warnings.

    `fatal[i]` is one string per failure kind, first occurrence only (a TP8 server prints
    the same OOM eight times): its first line is `"<label>: <log line>"`, the next few
    lines (indented) are the log lines around it. `fatal_labels[i]` is the label alone.
    """

    ready: bool = False                                   # the engine's ready line was seen
    fatal: list[str] = field(default_factory=list)        # fatal lines with a little context, in order
    facts: dict[str, float | int | str] = field(default_factory=dict)  # numbers parsed from the log
    warnings: list[str] = field(default_factory=list)     # "<label>: <log line>", first occurrence each
    fatal_labels: list[str] = field(default_factory=list)  # "oom", "port-in-use", … parallel to `fatal`

    @property
    def ok(self) -> bool:
        """Ready and nothing fatal: the only state in which a server should take work."""
        return self.ready and not self.fatal

    @property
    def state(self) -> Literal["failed", "ready", "starting"]:
        return "failed" if self.fatal else ("ready" if self.ready else "starting")

    @property
    def reason(self) -> str | None:
        """One line for an error message: the most telling fatal line, or None.

        The log order puts "Scheduler hit an exception: Traceback …" before the OOM that
        caused it; this skips such generic crash reports when a specific cause follows.
        """
        if not self.fatal:
            return None
        for entry, label in zip(self.fatal, self.fatal_labels, strict=False):
            if label not in GENERIC_FATAL_LABELS:
                return entry.splitlines()[0]
        return self.fatal[0].splitlines()[0]

    def as_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "reason": self.reason,
            "ready": self.ready,
            "fatal": list(self.fatal),
            "fatal_labels": list(self.fatal_labels),
            "facts": dict(self.facts),
            "warnings": list(self.warnings),
        }


@dataclass(frozen=True)
class FlagSyntax:
    """How an engine's command-line parser reads an option's name, so that `owned_flag` sees every
    spelling the engine takes for a flag fleet sets.

    argparse (SGLang, the sim, vLLM): `--flag value`, `--flag=value`, and any unambiguous prefix
    (`allow_abbrev`, the default), for `--long` names and for single-dash ones (`-t` is `-tp` when
    no other option starts with `-t`). vLLM's FlexibleArgumentParser first turns every `_` of a
    `--name` (up to its first `.`) into `-`, so `--api_key` and `--served-model_name=x` are
    `--api-key` and `--served-model-name`; and it reads `--name.key value` as `--name` with a JSON
    value (`dotted`). click (`transformers serve`, through typer): exact
    names and `--flag=value` only, no prefixes, no underscore folding."""

    abbrev: bool = True
    underscores: bool = False
    dotted: bool = False

    def name(self, arg: str) -> str:
        """The option name the parser looks up for `arg` (its value cut off, underscores folded)."""
        name = arg.split("=", 1)[0]
        if self.underscores and name.startswith("--"):
            head, dot, tail = name[2:].partition(".")
            name = "--" + head.replace("_", "-") + ("" if self.dotted else dot + tail)
        return name

    def names(self, name: str, flag: str) -> bool:
        """Does the option name `name` set `flag`?"""
        if name == flag:
            return True
        if not self.abbrev or not flag.startswith(name):
            return False
        # "--h" and "-" alone are no abbreviation argparse resolves to a flag fleet owns ("--h"
        # is ambiguous with --help in every argparse engine); a single-dash prefix needs one letter.
        return len(name) > 3 if name.startswith("--") else (len(name) >= 2 and not flag.startswith("--"))


ARGPARSE = FlagSyntax()


@runtime_checkable
class EngineProfile(Protocol):
    """One inference engine: how to start it, how to know it is ready, how to read its log."""

    name: str            # "sglang" | "vllm" | "transformers" | "sim"
    ready_path: str      # HTTP GET path that answers 200 once the server can take requests
    default_import: str  # module the venv stage imports to prove the install

    def argv(self, cfg: FleetConfig, spec: ServerSpec) -> list[str]: ...

    def env(self, cfg: FleetConfig, spec: ServerSpec) -> dict[str, str]: ...

    def shown_env(self, cfg: FleetConfig, env: dict[str, str]) -> dict[str, str]: ...

    def classify(self, log_text: str | bytes) -> LogVerdict: ...

    def request_model(self, spec: ServerSpec) -> str: ...

    owned_flags: dict[str, str]
    flag_syntax: FlagSyntax
    settings_files: tuple[str, ...]
    # The runner streams answers to see token progress (the engine counts none at /metrics).
    stream_progress: bool


class BaseProfile:
    """What the profiles share: CUDA_VISIBLE_DEVICES + engine.env, the rules' verdict, and
    clients naming the model by its served name. A profile overrides what differs."""

    name: str
    ready_path = "/health"
    default_import: str
    rules: LogRules
    # Flags fleet sets itself, each with the config field that sets it: extra_args may not
    # name them (see `owned_flag`). Every spelling the engine's parser accepts (`flag_syntax`).
    owned_flags: dict[str, str] = {}
    flag_syntax: FlagSyntax = ARGPARSE
    # Flags that read a file of settings (SGLang's and vLLM's `--config FILE.yaml`): such a file can
    # set the host, the port or the key behind fleet's back, and fleet cannot check what it holds.
    settings_files: tuple[str, ...] = ()
    # Token progress for the runner's stall watchdog: the engine's /metrics counters (False),
    # or streamed answers (True: an engine without counters, such as `transformers serve`).
    stream_progress = False

    # The environment variable that carries servers.api_key into the server (None: the
    # engine has no key). Never argv: /proc/<pid>/cmdline is readable by every local user.
    key_env: str | None = None

    def env(self, cfg: FleetConfig, spec: ServerSpec) -> dict[str, str]:
        env = gpu_env(cfg, spec)
        if spec.api_key and self.key_env:
            env[self.key_env] = spec.api_key
        return env

    def shown_env(self, cfg: FleetConfig, env: dict[str, str]) -> dict[str, str]:
        """`env` as records and logs may show it: the key and secret engine.env values masked."""
        hidden = {self.key_env} | {k for k in cfg.engine.env if k not in cfg.engine.env_public}
        return {k: MASK if k in hidden else v for k, v in env.items()}

    def classify(self, log_text: str | bytes) -> LogVerdict:
        return self.rules.classify(log_text)

    def request_model(self, spec: ServerSpec) -> str:
        return spec.served_name


# --------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class Fatal:
    """A line that means the server is dead or will not come up."""

    label: str
    pattern: re.Pattern[str]
    needle: str | None = None          # substring that must be present (fast pre-filter)
    before_ready_only: bool = False    # only fatal while starting (e.g. a bare top-level exception)


@dataclass(frozen=True)
class Warn:
    """A line worth surfacing that does not stop the server."""

    label: str
    pattern: re.Pattern[str]
    needle: str | None = None


@dataclass(frozen=True)
class Fact:
    """Numbers read from one kind of line; each named group is a fact key."""

    pattern: re.Pattern[str]
    needle: str | None = None
    keep: Literal["first", "last"] = "first"   # startup facts: first; running gauges: last


def rx(pattern: str, flags: int = 0) -> re.Pattern[str]:
    return re.compile(pattern, flags)


def to_number(key: str, raw: str) -> int | float:
    raw = raw.replace(",", "")
    return int(float(raw)) if key in INT_FACTS else float(raw)


def _clip(line: str) -> str:
    line = line.strip()
    return line if len(line) <= _MAX_LINE else line[:_MAX_LINE] + "…"


def _lines(text: str | bytes | None) -> list[str]:
    if not text:
        return []
    if isinstance(text, bytes | bytearray):
        text = bytes(text).decode("utf-8", "replace")
    if not isinstance(text, str):
        return []
    return text.splitlines()


@dataclass(frozen=True)
class LogRules:
    """The rules of one engine, and the scan that applies them to a log."""

    ready: tuple[re.Pattern[str], ...]
    fatal: tuple[Fatal, ...]
    facts: tuple[Fact, ...]
    warnings: tuple[Warn, ...] = ()
    # Checks on the finished verdict (e.g. "KV cache smaller than one request").
    finish: tuple[Callable[[LogVerdict], None], ...] = ()

    def classify(self, text: str | bytes | None) -> LogVerdict:
        lines = _lines(text)
        verdict = LogVerdict()
        seen_fatal: set[str] = set()
        seen_warn: set[str] = set()
        for i, raw in enumerate(lines):
            line = _ANSI.sub("", raw) if "\x1b" in raw else raw
            if not line or line.startswith(_FLEET_HEADER):
                continue
            if not verdict.ready and any(p.search(line) for p in self.ready):
                verdict.ready = True
                continue
            # The first rule that matches owns the line, even when its label was already
            # reported: a chained traceback repeats its message, and that repeat must not
            # fall through to a vaguer rule further down.
            for rule in self.fatal:
                if rule.before_ready_only and verdict.ready:
                    continue
                if rule.needle is not None and rule.needle not in line:
                    continue
                if rule.pattern.search(line):
                    if rule.label not in seen_fatal:
                        seen_fatal.add(rule.label)
                        verdict.fatal.append(_fatal_entry(rule.label, lines, i))
                        verdict.fatal_labels.append(rule.label)
                    break
            for warn in self.warnings:
                if warn.label in seen_warn or (warn.needle is not None and warn.needle not in line):
                    continue
                if warn.pattern.search(line):
                    seen_warn.add(warn.label)
                    verdict.warnings.append(f"{warn.label}: {_clip(line)}")
            for fact in self.facts:
                if fact.needle is not None and fact.needle not in line:
                    continue
                m = fact.pattern.search(line)
                if not m:
                    continue
                for key, raw in m.groupdict().items():
                    if raw is None or (fact.keep == "first" and key in verdict.facts):
                        continue
                    try:
                        verdict.facts[key] = to_number(key, raw)
                    except ValueError:
                        continue
        for check in self.finish:
            check(verdict)
        return verdict


def _fatal_entry(label: str, lines: list[str], i: int) -> str:
    before = [ln for ln in lines[max(0, i - _CONTEXT_BEFORE):i] if ln.strip()]
    after = [ln for ln in lines[i + 1:i + 1 + _CONTEXT_AFTER] if ln.strip()]
    head = f"{label}: {_clip(_ANSI.sub('', lines[i]))}"
    context = [_clip(_ANSI.sub("", ln)) for ln in before + after]
    return "\n".join([head, *("    " + c for c in context)])


# --------------------------------------------------------------------------- argv/env helpers


def gpu_env(cfg: FleetConfig, spec: ServerSpec) -> dict[str, str]:
    """The server's environment additions: unbuffered output, the user's env, its GPUs.

    PYTHONUNBUFFERED: vLLM logs to stdout, which Python block-buffers when it is a file;
    without it the log (and so the classifier) lags the server by kilobytes. The user's
    `engine.env` may override it. CUDA_VISIBLE_DEVICES comes last and wins: fleet assigns
    GPUs per server, and one global value would put every server on the same GPUs.
    """
    env = {"PYTHONUNBUFFERED": "1"}
    env.update(cfg.engine.env_values())
    if spec.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in spec.gpus)
    return env


def opt(flag: str, value: Any) -> list[str]:
    """`[flag, str(value)]` when value is set, else nothing."""
    return [] if value is None else [flag, str(value)]


def switch(flag: str, on: bool) -> list[str]:
    return [flag] if on else []


def extras(cfg: FleetConfig, spec: ServerSpec) -> list[str]:
    """Config-wide extra argv, then the per-server ones (later flags win in argparse)."""
    return [str(a) for a in cfg.engine.extra_args] + [str(a) for a in spec.extra_args]


def owned_flag(args: list[str] | tuple[str, ...], owned: dict[str, str],
               syntax: FlagSyntax = ARGPARSE) -> tuple[str, str, str] | None:
    """(the argument, the flag it sets, the config field to use instead) for the first extra
    argument that sets a flag fleet owns, else None.

    Every spelling `syntax` (the engine's parser) reads as that flag: `--flag value`,
    `--flag=value`, argparse's unambiguous abbreviations (`--ho 0.0.0.0` is `--host`), vLLM's
    underscores (`--tensor_parallel_size 8`): a later flag wins in argparse and click, so an extra
    `--host 0.0.0.0` would silently replace fleet's bind."""
    for arg in args:
        text = str(arg)
        if not text.startswith("-") or text in ("-", "--"):
            continue
        name = syntax.name(text)
        for flag, field_name in owned.items():
            if syntax.names(name, flag):
                return text, flag, field_name
    return None


def check_gpu_count(cfg: FleetConfig, spec: ServerSpec, engine: str) -> None:
    """A server given GPUs must get exactly tensor_parallel of them."""
    from fleet.errors import ConfigError

    tp = cfg.servers.tensor_parallel
    if spec.gpus and len(spec.gpus) != tp:
        raise ConfigError(
            f"{engine} server {spec.index} on {spec.node} got GPUs {list(spec.gpus)} "
            f"but servers.tensor_parallel is {tp}",
            remedy="give each server exactly tensor_parallel GPUs (check nodes[].gpus and servers.count)",
        )


# --------------------------------------------------------------------------- shared fatal rules

# Failures that read the same in every Python engine (they come from torch, CUDA, the
# socket layer or the Hub client, not from the engine), in the order they are tried.
COMMON_FATAL: tuple[Fatal, ...] = (
    # torch.OutOfMemoryError (torch >= 2.5) / torch.cuda.OutOfMemoryError (older): an
    # allocation failed, while loading weights, capturing graphs or serving.
    Fatal("oom", rx(r"OutOfMemoryError"), "OutOfMemoryError"),
    # The message itself, for engines that catch the exception and log only its text.
    Fatal("oom", rx(r"CUDA out of memory|CUDA error: out of memory"), "out of memory"),
    # Our port (uvicorn: "[Errno 98] error while attempting to bind on address … address
    # already in use"; vLLM binds before loading: "OSError: [Errno 98] Address already in
    # use"), SGLang's ZMQ ports ("zmq.error.ZMQError: Address already in use") or torch's
    # rendezvous store ("EADDRINUSE … address already in use"): a leftover server or two
    # servers given one port.
    Fatal("port-in-use", rx(r"[Aa]ddress already in use"), "lready in use"),
    # The first words of every NCCL failure ("RuntimeError: NCCL error", "DistBackendError:
    # NCCL error in: …"); NCCL's own INFO/WARN chatter never contains them.
    Fatal("nccl", rx(r"NCCL error"), "NCCL error"),
    # A CPU-only torch or no usable driver: the venv got the wrong torch build.
    Fatal("no-gpu", rx(r"Torch not compiled with CUDA enabled|Found no NVIDIA driver|No CUDA GPUs are available"),
          None),
    # Any other CUDA runtime error (illegal memory access, no kernel image for this GPU, …).
    Fatal("cuda-error", rx(r"CUDA error: (?!out of memory)"), "CUDA error: "),
    # The model path does not exist or holds no model: Hub clients then take the path for a
    # repo id ("Repo id must be in the form …") or fail to find config.json.
    Fatal("model-not-found", rx(r"Repo id must be in the form|is not a local folder and is not a valid model "
                                r"identifier|does not appear to have a file named config\.json|"
                                r"Can't load the configuration of"), None),
)
