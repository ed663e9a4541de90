"""Prefect block for an SSH node: where it is and the key to reach it.

Register once per Prefect server:  prefect block register -m blocks.node
Save one per node (UI, or code):   FleetNode(host=..., user=..., private_key=...).save("gpu-node-1")
Use it from the fleet config:      [[nodes]] kind = "ssh"  block = "gpu-node-1"

The private key is a SecretStr: Prefect stores it encrypted and the UI never shows it.
`fleet.node.ssh.SSHNode.from_config` loads the block when `NodeConfig.block` names it.
"""

from __future__ import annotations

from prefect.blocks.core import Block
from pydantic import Field, SecretStr


class FleetNode(Block):
    """An SSH-reachable GPU node: host, user, private key and (pinned) host key."""

    _block_type_name = "Fleet Node"
    _block_type_slug = "fleet-node"
    _description = (
        "An SSH-reachable GPU node for fleet: host, port, user, private key and the host key "
        "to verify. Name it in the fleet config with nodes.block."
    )
    _documentation_url = None

    host: str = Field(..., min_length=1, description="SSH host name or address of the node.")
    port: int = Field(22, ge=1, le=65535, description="SSH port.")
    user: str | None = Field(None, description="SSH user (default: the user running the flow).")
    private_key: SecretStr | None = Field(
        None,
        description="Private key text (ed25519, ecdsa or rsa, unencrypted), '-----BEGIN … PRIVATE KEY-----' through END. "
                    "Leave empty to use the config's key_file or key_secret.",
    )
    host_key: str | None = Field(
        None,
        description="Pinned host public key, 'ssh-ed25519 AAAA…' (from /etc/ssh/ssh_host_ed25519_key.pub on the node). "
                    "Takes precedence over known_hosts.",
    )
    known_hosts_path: str | None = Field(
        None, description="known_hosts file to verify the host key against when none is pinned (default ~/.ssh/known_hosts)."
    )
    workdir: str = Field("/tmp/fleet", description="Directory on the node for logs, pid files and manifests.")
