"""The Prefect layer's credential store for the core: fleet-node blocks and Secret blocks.

`fleet.node.credentials` defines what the core asks for; this answers from Prefect
(`PREFECT_API_URL`, or the embedded server's database). Installed by `flows/cli.py`
and passed by `tasks/nodes.py`.
"""

from __future__ import annotations

from typing import Any

from fleet.errors import ConfigError
from fleet.node.credentials import StoredNode


STORE_SECRET_ENV = "FLEET_STORE_SECRET"   # names a Secret block: the object store's variables (AWS_*, HF_TOKEN…), as JSON


def secret_value(name: str, *, remedy: str) -> Any:
    """The value of the Prefect Secret block `name` (text, or JSON as it was saved); ConfigError when
    it cannot be loaded. The error names the exception's type, not its text: a block's value must
    never reach a message."""
    try:
        from prefect.blocks.system import Secret

        # _sync=True: inside an event loop (an async flow) `load` would return a coroutine.
        block: Any = Secret.load(name, _sync=True)  # type: ignore[call-arg]
        return block.get()
    except Exception as exc:  # Prefect raises ValueError, httpx errors, …: all mean "no block"
        raise ConfigError(f"cannot load the Prefect Secret block {name!r}: {type(exc).__name__}",
                          remedy=remedy) from exc


def load_store_credentials() -> list[str]:
    """The object store's credentials from the Prefect Secret block that FLEET_STORE_SECRET names (its
    value: an object of the variables objstore.STORE_ENV names — AWS_*, HF_TOKEN, …; Secret keeps JSON as it
    is) into this process's environment, where s3fs (gcsfs, huggingface_hub) reads them and start_job hands
    them to each runner's 0600 env file. A variable already set wins. Returns the names set."""
    import json
    import os

    from fleet.generation.data.objstore import STORE_ENV

    name = os.environ.get(STORE_SECRET_ENV)
    if not name:
        return []
    values = secret_value(name, remedy="create it, and check PREFECT_API_URL")
    if isinstance(values, str):
        try:
            values = json.loads(values)
        except ValueError:
            values = None
    if not isinstance(values, dict) or not set(values) <= set(STORE_ENV):
        raise ConfigError(f"the Prefect Secret {name!r} is not an object of {', '.join(STORE_ENV)}",
                          remedy='save it as Secret(value={"AWS_ACCESS_KEY_ID": "…", "AWS_SECRET_ACCESS_KEY": '
                                 '"…"}).save(NAME)')
    set_now = [k for k, v in values.items() if not os.environ.get(k)]
    for k in set_now:
        os.environ[k] = str(values[k])
    return set_now


class PrefectCredentials:
    """Reads `FleetNode` and `Secret` blocks by name."""

    def node(self, name: str) -> StoredNode:
        try:
            from blocks.node import FleetNode

            # _sync=True: inside an event loop (an async flow) `load` would return a coroutine.
            block: Any = FleetNode.load(name, _sync=True)  # type: ignore[call-arg]
        except Exception as exc:  # Prefect raises ValueError, httpx errors, …: all mean "no block"
            raise ConfigError(f"cannot load the fleet-node block {name!r}: {exc}",
                              remedy="register and save it (prefect block register -m blocks.node), "
                                     "and check PREFECT_API_URL") from exc
        key = block.private_key.get_secret_value() if block.private_key is not None else None
        return StoredNode(host=block.host, port=block.port, user=block.user, private_key=key,
                          host_key=block.host_key, known_hosts_path=block.known_hosts_path, workdir=block.workdir)

    def secret(self, name: str) -> str:
        value = secret_value(name, remedy="create it (Secret(value=KEY_TEXT).save(NAME)) and check PREFECT_API_URL")
        if not isinstance(value, str):
            raise ConfigError(f"the Prefect Secret {name!r} does not hold text",
                              remedy="store the private key text as the secret's value")
        return value
