"""SSH key text: private keys in, public host keys parsed, fingerprints out (pure; no I/O).

The fingerprints are the ones `ssh-keygen -lf` prints, so an error can be checked against
the node out of band.
"""

from __future__ import annotations

import base64
import hashlib
import io

import paramiko

from fleet.errors import ConfigError

__all__ = ["algorithms_for", "fingerprint", "fingerprint_b64", "known_hosts_name", "load_private_key",
           "parse_public_key"]

_KEY_CLASSES: tuple[type[paramiko.PKey], ...] = (paramiko.Ed25519Key, paramiko.ECDSAKey, paramiko.RSAKey)


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style fingerprint, e.g. 'SHA256:abc…' (what `ssh-keygen -lf` prints)."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def fingerprint_b64(b64: str) -> str:
    digest = hashlib.sha256(base64.b64decode(b64)).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def load_private_key(text: str, *, source: str) -> paramiko.PKey:
    """Parse an ed25519, ECDSA or RSA private key (OpenSSH or PEM text)."""
    # Keys pasted into env vars or UI fields often arrive with literal "\n" or CRLF.
    if "\\n" in text and "\n" not in text.strip():
        text = text.replace("\\n", "\n")
    text = text.replace("\r\n", "\n").strip() + "\n"
    for cls in _KEY_CLASSES:
        try:
            return cls.from_private_key(io.StringIO(text))
        except paramiko.PasswordRequiredException:
            raise ConfigError(f"the private key from {source} is encrypted with a passphrase",
                              remedy="give fleet an unencrypted key (e.g. a deploy key kept in a Prefect Secret)") from None
        except (paramiko.SSHException, ValueError, TypeError, IndexError):
            continue
    raise ConfigError(f"cannot parse the private key from {source} (tried ed25519, ecdsa, rsa)",
                      remedy="give the full private key text, '-----BEGIN … PRIVATE KEY-----' through the END line")


def parse_public_key(text: str, *, source: str) -> tuple[str, str]:
    """(key type, base64) from 'ssh-ed25519 AAAA… [comment]' or a known_hosts line."""
    tokens = text.split()
    for i, tok in enumerate(tokens[:-1]):
        if tok.startswith(("ssh-", "ecdsa-", "sk-")):
            b64 = tokens[i + 1]
            try:
                base64.b64decode(b64, validate=True)
            except ValueError:
                break
            return tok, b64
    raise ConfigError(f"cannot parse the host key {text!r} from {source}",
                      remedy="give it as 'ssh-ed25519 AAAA…' (a line of the host's /etc/ssh/ssh_host_*_key.pub)")


def known_hosts_name(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


def algorithms_for(key_type: str) -> list[str]:
    # An RSA host key is offered under the rsa-sha2-* signature names.
    return ["rsa-sha2-512", "rsa-sha2-256", "ssh-rsa"] if key_type == "ssh-rsa" else [key_type]
