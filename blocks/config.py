"""Prefect block holding one fleet's config: what the deployments and schedules of that fleet run.

    fleet deploy -c deployments/configs/ssh-sglang.toml     # saves it (and the four deployments)
    prefect deployment run fleet/bringup-b200               # its runs read `block:fleet-config/b200`

One block per fleet, named after the fleet (`name` in the TOML). The UI shows it under
Blocks → Fleet Config as a form (every field with its description) and lets an operator
edit it; the secrets (servers.api_key, and any other SecretStr field of the config) are
stored encrypted and shown masked. Every run of the fleet's deployments loads it by name
when it starts, so an edit applies to the next run, schedules included.
"""

from __future__ import annotations

from typing import Any

from prefect.blocks.core import Block
from prefect.types import SecretDict
from pydantic import Field

from fleet.config import FleetConfig


class FleetConfigBlock(Block):
    """One fleet's config: nodes, engine, model, servers, smoke and generation settings."""

    _block_type_name = "Fleet Config"
    _block_type_slug = "fleet-config"
    _description = (
        "The config of one fleet (fleet deploy -c FILE saves it, named after the fleet). Every deployment "
        "of that fleet (bringup-NAME, revalidate-NAME, generate-NAME, teardown-NAME) reads it when a run starts."
    )
    _documentation_url = None

    config: FleetConfig = Field(..., description="The fleet config (the TOML file's content, validated). "
                                                 "engine.env is kept in engine_env below.")
    # Prefect masks a SecretStr field, but not the SecretStr values inside a dict (engine.env):
    # checked on 3.9.1, the API returned them in clear text. A SecretDict is masked as a whole.
    engine_env: SecretDict = Field(default_factory=lambda: SecretDict({}),
                                   description="engine.env: environment variables for every server (secret).")
    source: str | None = Field(None, description="Where it was read from when saved (for reference; not re-read).")

    @classmethod
    def of(cls, cfg: FleetConfig, source: str | None = None) -> FleetConfigBlock:
        env = {k: v.get_secret_value() if hasattr(v, "get_secret_value") else v for k, v in cfg.engine.env.items()}
        bare = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"env": {}})})
        return cls(config=bare, engine_env=SecretDict(env), source=source)

    def fleet_config(self) -> FleetConfig:
        """The config as saved, engine.env included."""
        env: dict[str, Any] = dict(self.engine_env.get_secret_value() or {})
        if not env:
            return self.config
        data = self.config.model_dump(mode="python")
        data["engine"]["env"] = env
        return FleetConfig(**data)
