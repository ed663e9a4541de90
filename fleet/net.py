"""Addresses: which hosts are loopback, and where a server bound to an address is reached from
its own node."""

from __future__ import annotations

import ipaddress

# The loopback names a server may be bound to (every 127.0.0.0/8 address is loopback too).
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# Bound to every interface: reached through loopback from the node itself.
WILDCARD_HOSTS = ("0.0.0.0", "::")


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and 'localhost': reachable from the node itself only."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def connect_host(bind: str) -> str:
    """The address that reaches a server bound to `bind` from the node it runs on."""
    return "127.0.0.1" if bind in WILDCARD_HOSTS or bind == "localhost" else bind
