"""Addresses: which hosts are loopback, and where a server bound to an address is reached from
its own node; and the TLS context every HTTP client of the process shares."""

from __future__ import annotations

import functools
import ipaddress
import ssl
import threading

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


_TLS_BUILD = threading.Lock()


def tls_context(url: str | None = None) -> ssl.SSLContext:
    """The TLS context an HTTP client for `url` is given. For https (or a client whose URLs are not
    known): httpx's own default (its CA bundle, or SSL_CERT_FILE / SSL_CERT_DIR), built once per process.
    For a plain-http URL: a client context with no CA loaded — it is never used, and were it ever
    asked to (a redirect to https), it would verify and so refuse every certificate.

    Why: httpx builds a new context for each client, loading the CA bundle each time: 30–50 ms of
    CPU on a 2-core machine, paid by every readiness poll, smoke and info fetch of every server
    (7 times in `fleet up` of 2 servers, 25 with 8); built once, it was still ≈ 65 ms of an
    adopt-only `fleet up` whose servers all speak plain HTTP (and twice that when two threads asked
    first at once). An SSLContext is safe to share between threads and clients."""
    if url is not None and url.lower().startswith("http://"):
        return _unused_context()
    with _TLS_BUILD:   # two first callers at once would both load the bundle
        return _default_context()


@functools.cache
def _default_context() -> ssl.SSLContext:
    import httpx

    return httpx.create_ssl_context()


@functools.cache
def _unused_context() -> ssl.SSLContext:
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)   # check_hostname and CERT_REQUIRED, no CA: refuses all
