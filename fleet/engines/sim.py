"""The simulated SGLang server (fleet/sim): same API, same log lines, no GPU.

The launch stage copies it, as one zip file (`fleet.sim.bundle`), to `<workdir>/bin/fleet_sim.pyz`
on the node and runs it with the node venv's python (it needs only the standard library,
hence `json` as the import check). It prints SGLang-shaped log lines, so its log is read by SGLang's rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fleet.engines.base import API_KEY_ENV, BaseProfile, LogRules, ServerSpec, extras, opt
from fleet.engines.sglang import SGLANG_RULES

if TYPE_CHECKING:
    from fleet.config import FleetConfig

DEFAULT_CONTEXT_LENGTH = 8192


def sim_script(spec: ServerSpec) -> str:
    return f"{spec.workdir.rstrip('/')}/bin/fleet_sim.pyz"


class SimProfile(BaseProfile):
    """fleet's simulated SGLang. Clients send `model = served_name` (its --model-name)."""

    name = "sim"
    default_import = "json"
    rules: LogRules = SGLANG_RULES
    key_env = API_KEY_ENV   # the sim's --api-key defaults to it
    owned_flags = {
        "--host": "servers.host", "--port": "servers.base_port / servers.ports",
        "--api-key": "servers.api_key", "--model-path": "model.source", "--model-name": "model.served_name",
    }

    def argv(self, cfg: FleetConfig, spec: ServerSpec) -> list[str]:
        e = cfg.engine
        s = e.sim
        return [
            spec.python, sim_script(spec),
            "--host", spec.host,
            "--port", str(spec.port),
            "--model-name", spec.served_name,
            "--model-path", spec.model_path,
            "--startup-s", str(s.startup_s),
            "--first-request-delay-s", str(s.first_request_delay_s),
            "--tokens-per-s", str(s.tokens_per_s),
            "--max-running-requests", str(s.max_running_requests),
            "--kv-cache-tokens", str(s.kv_cache_tokens),
            "--context-length", str(e.context_length or DEFAULT_CONTEXT_LENGTH),
            # Each server its own seed, so faults differ between servers but repeat per run.
            "--seed", str(s.seed + spec.index),
            *opt("--speculative-algorithm", e.speculative_algorithm),
            *extras(cfg, spec),
        ]
