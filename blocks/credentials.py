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
# names a prefect-aws block: `NAME` or `aws-credentials/NAME` (AwsCredentials), `s3-bucket/NAME` (S3Bucket: its credentials)
STORE_AWS_BLOCK_ENV = "FLEET_STORE_AWS_BLOCK"
STORE_BLOCK_ENVS = (STORE_SECRET_ENV, STORE_AWS_BLOCK_ENV)
AWS_EXTRA_REMEDY = "pip install 'fleet[aws]' (prefect-aws), or unset " + STORE_AWS_BLOCK_ENV


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


def aws_block_values(ref: str) -> dict[str, str]:
    """The AWS_* variables a prefect-aws block holds: `ref` is `NAME` or `aws-credentials/NAME` (an
    AwsCredentials block) or `s3-bucket/NAME` (an S3Bucket block, whose credentials are taken). Keys,
    session token, region and `aws_client_parameters.endpoint_url` (AWS_ENDPOINT_URL, which botocore
    honours: an S3-compatible server). A profile or a role to assume is refused: a runner on a node has
    neither the profile's files nor a way to assume the role. Errors never hold a block's value."""
    try:
        from prefect_aws import AwsCredentials, S3Bucket
    except ImportError as exc:
        raise ConfigError(f"{STORE_AWS_BLOCK_ENV} is set but prefect-aws is not installed",
                          remedy=AWS_EXTRA_REMEDY) from exc
    slug, _, name = ref.rpartition("/")
    kinds: dict[str, Any] = {"": AwsCredentials, "aws-credentials": AwsCredentials, "s3-bucket": S3Bucket}
    if slug not in kinds or not name:
        raise ConfigError(f"{STORE_AWS_BLOCK_ENV}={ref!r} names no AwsCredentials or S3Bucket block",
                          remedy="set it to NAME, aws-credentials/NAME or s3-bucket/NAME")
    try:
        # _sync=True: inside an event loop (an async flow) `load` would return a coroutine.
        block: Any = kinds[slug].load(name, _sync=True)
    except Exception as exc:  # Prefect raises ValueError, httpx errors, …: all mean "no block"
        raise ConfigError(f"cannot load the prefect-aws block {ref!r}: {type(exc).__name__}",
                          remedy="create it, and check PREFECT_API_URL") from exc
    creds: Any = block.credentials if slug == "s3-bucket" else block
    if creds.profile_name or creds.assume_role_arn:
        raise ConfigError(f"the prefect-aws block {ref!r} names a profile or a role to assume, which a node's "
                          "runner cannot use", remedy="save the access keys (or temporary ones) in the block instead")
    secret = creds.aws_secret_access_key
    values = {"AWS_ACCESS_KEY_ID": creds.aws_access_key_id,
              "AWS_SECRET_ACCESS_KEY": secret.get_secret_value() if secret is not None else None,
              "AWS_SESSION_TOKEN": creds.aws_session_token, "AWS_REGION": creds.region_name,
              "AWS_ENDPOINT_URL": creds.aws_client_parameters.endpoint_url}
    return {k: str(v) for k, v in values.items() if v}


def load_store_credentials() -> list[str]:
    """The object store's credentials from Prefect blocks into this process's environment, where s3fs
    (gcsfs, huggingface_hub) reads them and start_job hands them to each runner's 0600 env file: the Secret
    block FLEET_STORE_SECRET names (its value: an object of the variables objstore.STORE_ENV names — AWS_*,
    HF_TOKEN, …; Secret keeps JSON as it is), then the prefect-aws block FLEET_STORE_AWS_BLOCK names
    (aws_block_values). A variable already set wins. Returns the names set."""
    import os

    set_now = _set_unset(_secret_block_values())
    ref = os.environ.get(STORE_AWS_BLOCK_ENV)
    return set_now + (_set_unset(aws_block_values(ref)) if ref else [])


def _set_unset(values: dict[str, Any]) -> list[str]:
    import os

    set_now = [k for k, v in values.items() if not os.environ.get(k)]
    for k in set_now:
        os.environ[k] = str(values[k])
    return set_now


def _secret_block_values() -> dict[str, Any]:
    import json
    import os

    from fleet.generation.data.objstore import STORE_ENV

    name = os.environ.get(STORE_SECRET_ENV)
    if not name:
        return {}
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
    return values


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
