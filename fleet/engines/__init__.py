"""Engine profiles: one per inference engine, each a pure argv builder, log reader and readiness path.

    profile = get_profile(cfg.engine.kind)
    argv, env = profile.argv(cfg, spec), profile.env(cfg, spec)   # what to start
    profile.ready_path                                            # GET it until 200
    verdict = profile.classify(log_text)                          # ready? fatal? numbers
    profile.request_model(spec)                                   # the "model" clients send

| kind | command | ready path | ready log line | clients send model = |
| --- | --- | --- | --- | --- |
| sglang | `python -m sglang.launch_server` | /health | The server is fired up and ready to roll! | served name |
| vllm | `python -m vllm.entrypoints.openai.api_server` | /health | Application startup complete. / Starting vLLM … server | served name |
| transformers | `<venv>/bin/transformers serve PATH` | /health | Uvicorn running on … | the model path |
| sim | `python <workdir>/bin/fleet_sim.pyz` | /health | (SGLang's) | served name |
"""

from __future__ import annotations

from fleet.engines.base import EngineProfile, LogVerdict, ServerSpec
from fleet.engines.sglang import SGLangProfile
from fleet.engines.sim import SimProfile
from fleet.engines.transformers import TransformersProfile
from fleet.engines.vllm import VLLMProfile
from fleet.errors import ConfigError

__all__ = ["PROFILES", "EngineProfile", "LogVerdict", "ServerSpec", "get_profile", "inspect_log"]

PROFILES: dict[str, EngineProfile] = {
    p.name: p for p in (SGLangProfile(), VLLMProfile(), TransformersProfile(), SimProfile())
}


def get_profile(kind: str) -> EngineProfile:
    """The profile of engine `kind` ("sglang", "vllm", "transformers", "sim")."""
    try:
        return PROFILES[kind]
    except KeyError:
        raise ConfigError(f"unknown engine {kind!r}",
                          remedy=f"set engine.kind to one of: {', '.join(PROFILES)}") from None


def inspect_log(text: str | bytes, engine: str) -> LogVerdict:
    """Classify a server log of `engine` (never raises on odd input: junk gives an empty verdict)."""
    return get_profile(engine).classify(text)
