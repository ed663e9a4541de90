"""What importing the flow costs a command (issue 37, item 2): `fleet up` and `fleet generate` import
flows.fleet before their flow runs; nothing they do not use is built there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_importing_the_fleet_flow_builds_no_parameter_schema_and_the_schema_is_unchanged() -> None:
    """Cost: Prefect's Flow built the JSON schema of the whole FleetConfig at import (and imported
    pydantic.v1 for it): ≈ 0.26 s of CPU per command that never reads it (bench/RESULTS.md). Now
    the import builds none; asked for, it is Prefect's own schema of the function, and a
    deployment's parameter schema (built from the function) is the same as before."""
    code = "import sys, flows.fleet as f; print(f.fleet._schema is None, 'pydantic.v1' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.stdout.split() == ["True", "False"], r.stdout + r.stderr[-2000:]

    from prefect.deployments.runner import RunnerDeployment
    from prefect.flows import Flow
    from prefect.utilities.callables import parameter_schema

    from flows.fleet import fleet

    assert isinstance(fleet, Flow) and fleet.name == "fleet"
    assert fleet.parameters == parameter_schema(fleet.fn)
    assert set(fleet.parameters.properties) >= {"config", "action", "input", "output"}
    dep = RunnerDeployment.from_flow(fleet, name="schema-check")
    assert dep._parameter_openapi_schema == parameter_schema(fleet.fn)
