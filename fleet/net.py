"""Addresses: which hosts are loopback, and where a server bound to an address is reached from
its own node; and the TLS context every HTTP client of the process shares."""

from __future__ import annotations

import functools
import ipaddress
import ssl

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


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The TLS context every HTTP client fleet makes is given: httpx's own default (its CA bundle,
    or SSL_CERT_FILE / SSL_CERT_DIR), built once per process.

    Why: httpx builds a new one for each client, loading the CA bundle each time: 30–50 ms of CPU
    on a 2-core machine, paid by every readiness poll, smoke and info fetch of every server (which
    speak plain HTTP: the context is never even used): 7 times in `fleet up` of 2 servers, 25 with
    8. An SSLContext is safe to share between threads and clients."""
    import httpx

    return httpx.create_ssl_context()
