"""`transformers serve` (transformers 5.x, needs `transformers[serving]`), and its log.

Checked on transformers 5.24.0 here (CPU) — `transformers serve --help`, the source of
`transformers/cli/serve.py` and `cli/serving/`, and real runs (tests/data/logs/transformers_*):

- Command: `<venv>/bin/transformers serve [FORCE_MODEL] --host H --port P --device D`.
  The model is the optional positional FORCE_MODEL (there is no `--model` flag). Given one,
  the server loads it *before* uvicorn starts (`[transformers] Loading <path>` is the
  first line), never unloads it, and is pinned to it. Without one it starts empty and
  loads whatever a request names (from the Hub cache) — fleet always passes the path.
- Which model a request gets: pinned to FORCE_MODEL, a request may omit `model` or must
  send exactly the FORCE_MODEL string, here the model *path*; any other name (such as a
  served name) is answered `400 Server is pinned to '<path>'; requested '<name>'`. There
  is no `--served-model-name`: `request_model()` returns the path, and `/v1/models` lists
  the path as the model id.
- Ready: `GET /health` answers `{"status": "ok"}` once uvicorn listens, which is only
  after the model is loaded; with `--continuous-batching` it answers 503 if the batching
  worker died. Log: `INFO:     Uvicorn running on http://H:P (Press CTRL+C to quit)`.
  Not `Application startup complete.`: uvicorn prints that one *before* binding, so it
  also appears when the port is taken (then `[Errno 98] … address already in use`).
- Flags used: `--device` (engine.device, else "cuda" with one GPU, "auto" — layers spread
  over the visible GPUs — with several, "cpu" without), `--continuous-batching` (engine.
  continuous_batching), `--cb-max-memory-percent` from engine.mem_fraction_static with
  continuous batching (by default the KV cache takes most of the card),
  `--trust-remote-code`. No equivalent exists for context length, tensor parallelism,
  speculative decoding or an API key: those fields are not passed.
- No authentication at all: a bind beyond loopback would be open to anyone, so argv()
  refuses it; on loopback an API key is simply not needed by the server.
"""

from __future__ import annotations

import posixpath
from typing import TYPE_CHECKING

from fleet.engines.base import (
    BaseProfile,
    COMMON_FATAL,
    Fatal,
    LogRules,
    FlagSyntax,
    ServerSpec,
    extras,
    opt,
    rx,
    switch,
)
from fleet.errors import ConfigError
from fleet.net import is_loopback

if TYPE_CHECKING:
    from fleet.config import FleetConfig

TRANSFORMERS_RULES = LogRules(
    ready=(
        # uvicorn's line once the socket is bound (the pinned model is already loaded).
        rx(r"Uvicorn running on "),
    ),
    fatal=(
        *COMMON_FATAL,
        # The venv lacks fastapi/uvicorn/… (`pip install transformers[serving]`).
        Fatal("missing-deps", rx(r"Missing dependencies for serving"), "Missing dependencies"),
        # Before ready, any bare top-level exception line ends the process: the model is
        # loaded in the CLI's __init__, outside any handler. After ready such lines belong to
        # a failed request (uvicorn logs "Exception in ASGI application") and are not fatal.
        Fatal("startup-error", rx(r"^[A-Za-z_][\w.]*(?:Error|Exception): "), None, before_ready_only=True),
    ),
    facts=(),
)


def _device(cfg: FleetConfig, spec: ServerSpec) -> str:
    if cfg.engine.device:
        return cfg.engine.device
    if not spec.gpus:
        return "cpu"
    return "cuda" if len(spec.gpus) == 1 else "auto"


class TransformersProfile(BaseProfile):
    """`transformers serve`, pinned to the model path. Clients send `model = <the path>`."""

    name = "transformers"
    default_import = "transformers"
    rules: LogRules = TRANSFORMERS_RULES
    # The model is the positional FORCE_MODEL (fleet passes the path); no key, no TP flags.
    owned_flags = {"--host": "servers.host", "--port": "servers.base_port / servers.ports"}
    # A typer (click) command: exact option names and `--port=N`, no prefixes, no `_` folding
    # (`--po 1` and `--port_x 1` are "No such option" errors at start, not a second --port).
    flag_syntax = FlagSyntax(abbrev=False)
    # No /metrics: the runner streams its answers, each chunk a sign of token progress.
    stream_progress = True

    def argv(self, cfg: FleetConfig, spec: ServerSpec) -> list[str]:
        e = cfg.engine
        if not is_loopback(spec.host):
            raise ConfigError(
                f"transformers serve has no API key support; binding {spec.host} would expose "
                f"server {spec.index} on {spec.node} without authentication",
                remedy="set servers.host = '127.0.0.1' and reach the servers through forwarded ports",
            )
        cb = e.continuous_batching
        return [
            posixpath.join(posixpath.dirname(spec.python), "transformers"), "serve", spec.model_path,
            "--host", spec.host,
            "--port", str(spec.port),
            "--device", _device(cfg, spec),
            *switch("--continuous-batching", cb),
            *opt("--cb-max-memory-percent", e.mem_fraction_static if cb else None),
            *switch("--trust-remote-code", e.trust_remote_code),
            *extras(cfg, spec),
        ]

    def request_model(self, spec: ServerSpec) -> str:
        # Pinned servers accept only the FORCE_MODEL string (or no model at all).
        return spec.model_path
