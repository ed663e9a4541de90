"""The `fleet` flow's parameters: where the config comes from, and the run's name.

`config` arrives as a FleetConfig (the UI form, or a Python caller), its dict (JSON from
the API), a TOML path on the machine that runs the flow, `block:fleet-config/NAME` (the
Fleet Config block `fleet deploy` saves, blocks/config.py), `block:secret/NAME` (a Prefect
Secret block holding the config as a JSON object or TOML text; a bare `block:NAME` means
the same), or `variable:NAME` (a Prefect Variable holding either). Blocks and variables
let a deployment point at a config that lives in Prefect, edited in the UI, with the
SSH details kept out of the repo.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from collections.abc import Callable
from typing import Any

from fleet.config import FleetConfig, config_from_param
from fleet.errors import ConfigError

BLOCK_PREFIX = "block:"
VARIABLE_PREFIX = "variable:"


def _config_value(value: Any, where: str) -> dict[str, Any]:
    """A config held in Prefect: a JSON object, or TOML text."""
    if isinstance(value, str):
        try:
            value = tomllib.loads(value)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{where}: its text is not valid TOML: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{where} holds a {type(value).__name__}, not a fleet config",
                          remedy="store the config as a JSON object or as TOML text")
    return value


def config_from_block(ref: str) -> dict[str, Any]:
    """The fleet config in a Prefect block: `fleet-config/NAME` (what `fleet deploy` saves), `secret/NAME`
    (a Secret, JSON or TOML text; a bare NAME means this), or any `<type-slug>/NAME` block with a `value`."""
    from prefect.blocks.core import Block

    from blocks.config import FleetConfigBlock  # registers the fleet-config type, so Block.load knows it

    ref = ref if "/" in ref else f"secret/{ref}"
    try:
        block = Block.load(ref)
    except (ValueError, KeyError) as exc:  # no such block document / block type
        raise ConfigError(f"no Prefect block {ref!r}: {exc}",
                          remedy="create it (UI: Blocks → Secret) or pass the config inline or as a TOML path"
                          ) from exc
    if isinstance(block, FleetConfigBlock):
        return block.fleet_config().model_dump(mode="python")  # SecretStr values stay SecretStr
    value = block.get() if hasattr(block, "get") else getattr(block, "value", None)
    return _config_value(value, f"block {ref!r}")


def config_from_variable(name: str) -> dict[str, Any]:
    """The fleet config in a Prefect Variable (a JSON object, or TOML text)."""
    from prefect.variables import Variable

    value = Variable.get(name, default=None)
    if value is None:
        raise ConfigError(f"no Prefect variable {name!r}",
                          remedy=f"create it: prefect variable set {name} '<config as JSON>'; or pass the config "
                                 "inline or as a TOML path")
    return _config_value(value, f"variable {name!r}")


def resolve_config(value: FleetConfig | dict[str, Any] | str | None) -> FleetConfig:
    """The flow parameter `config`: a config, its dict, a TOML path, `block:secret/NAME` or `variable:NAME`."""
    if isinstance(value, str) and value.startswith(BLOCK_PREFIX):
        return config_from_param(config_from_block(value[len(BLOCK_PREFIX):]))
    if isinstance(value, str) and value.startswith(VARIABLE_PREFIX):
        return config_from_param(config_from_variable(value[len(VARIABLE_PREFIX):]))
    return config_from_param(value)


def run_name() -> str:
    """`<action>-<fleet name>`: read from the parameters, whatever form `config` took."""
    from prefect.runtime import flow_run

    params = flow_run.parameters or {}
    cfg = params.get("config")
    if isinstance(cfg, FleetConfig):
        name = cfg.name
    elif isinstance(cfg, dict):
        name = cfg.get("name") or "fleet"
    elif isinstance(cfg, str) and cfg.startswith((BLOCK_PREFIX, VARIABLE_PREFIX)):
        # The fleet's own name, not the block's or variable's: read what it holds (a bad
        # reference is reported by the flow itself; the run is then named after the reference).
        try:
            name = resolve_config(cfg).name
        except Exception:  # noqa: BLE001 - naming must never fail a run
            name = cfg.split(":", 1)[1].rsplit("/", 1)[-1]
    elif isinstance(cfg, str):
        try:
            name = str(tomllib.loads(Path(cfg).read_text()).get("name") or "fleet")
        except (OSError, tomllib.TOMLDecodeError):
            name = Path(cfg).stem  # the flow itself reports the bad file
    else:
        name = "fleet"
    return f"{params.get('action', 'bringup')}-{name}"


# The generation core speaks to `fleet generate` (`--input`, `--output`, `--retry-errors`); a
# deployment run is given the flow's parameters instead, so its messages must name those.
_CLI_OPTION = re.compile(r"(?<![\w-])--(input|output|retry-errors)(?![\w-])")


def parameter_words(message: str) -> str:
    """`message` with the CLI's options named as the flow's parameters: `--input` reads `` `input` ``."""
    return _CLI_OPTION.sub(lambda m: "`" + m.group(1).replace("-", "_") + "`", message)


def for_deployment(state: Any) -> Any:
    """A generate run's final state, its message in parameter words when a deployment started the run
    (the UI, `prefect deployment run`, a schedule); as it is for `fleet generate` (the CLI's words)."""
    from prefect.runtime import deployment

    message = getattr(state, "message", None)
    if not deployment.id or not message or parameter_words(message) == message:
        return state
    from tasks.states import RunFailed, failed

    if state.is_failed():
        return failed(parameter_words(message), state.data.data if isinstance(state.data, RunFailed) else None)
    return state.model_copy(update={"message": parameter_words(message)})


def lazy_schema_flow(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """`prefect.flow(**options)`, except that the flow's parameter schema is built when first asked
    for, not at import.

    Prefect's `Flow.__init__` builds the JSON schema of every parameter (for the fleet flow the
    whole FleetConfig, with pydantic.v1 imported to check for v1 models): ≈ 0.26 s of CPU, a third
    of `import flows.fleet` past Prefect's own import, paid by every `fleet up` and `fleet generate`
    that never looks at it. Nothing in a run reads `Flow.parameters`; a deployment builds its own
    schema from the function (`RunnerDeployment.from_flow` calls `parameter_schema(flow)`), and
    anything else that reads the attribute gets the same schema, built then."""
    import prefect.flows as pflows
    from prefect.utilities.callables import ParameterSchema, parameter_schema

    class LazySchemaFlow(pflows.Flow):   # type: ignore[type-arg]
        _schema: ParameterSchema | None = None

        @property   # type: ignore[override]
        def parameters(self) -> ParameterSchema:
            if self._schema is None:
                self._schema = parameter_schema(self.fn)
            return self._schema

        @parameters.setter
        def parameters(self, value: ParameterSchema | None) -> None:
            self._schema = value

    def build(fn: Callable[..., Any]) -> Any:
        real = pflows.parameter_schema
        pflows.parameter_schema = lambda _fn: None   # type: ignore[assignment,return-value]  # built lazily
        try:
            return LazySchemaFlow(fn=fn, **options)
        finally:
            pflows.parameter_schema = real

    return build
