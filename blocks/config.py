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

from prefect.blocks.core import Block
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

    config: FleetConfig = Field(..., description="The fleet config (the TOML file's content, validated).")
    source: str | None = Field(None, description="Where it was read from when saved (for reference; not re-read).")
