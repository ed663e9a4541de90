"""The SSH node: paramiko on a socket we open ourselves.

    target.py      what to connect to (`SSHTarget`), resolved from config, blocks and key files
    keys.py        key text: private keys, public host keys, fingerprints (pure)
    hostkey.py     host-key checking: pinned key, known_hosts, trust on first use
    connection.py  socket, handshake, authentication, fast retries; the exit-signal patch
    commands.py    one command on a channel: remote argv, stdin, output against a deadline
    forward.py     local port forwarding over the node's connection (why hand-written: there)
    transfer.py    files over SFTP: beside the target, then renamed
    node.py        `SSHNode`: the `Node` seam over all of the above (sessions, commands, files, ports)

Errors leave this package only as fleet errors (see `fleet.errors`):

    socket refused / reset / DNS / TCP timeout  -> NodeUnreachable (after fast retries)
    host key unknown or changed                 -> HostKeyError
    key refused                                 -> AuthFailed
    bad key text, bad pinned host key           -> ConfigError
    connection dropped while a command ran      -> ConnectionLost (next call reconnects)
    past the deadline / exit 124 from `timeout` -> CommandTimeout
"""

from __future__ import annotations

from fleet.node.ssh.commands import remote_argv
from fleet.node.ssh.keys import fingerprint, load_private_key
from fleet.node.ssh.node import SSHNode
from fleet.node.ssh.target import SSHTarget

__all__ = ["SSHNode", "SSHTarget", "fingerprint", "load_private_key", "remote_argv"]
