"""Files to and from an SSH node over SFTP, on a session channel of the node's connection.

Both ways go through a temp file beside the target and a rename, so a reader (or a
concurrent copy of the same file) never sees half a file; uploads are 0600 (0700 when
executable), never readable by others.
"""

from __future__ import annotations

import os
import posixpath
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import paramiko

from fleet.errors import CommandFailed, CommandTimeout, FleetError
from fleet.node.ssh.commands import bounded_request, quietly

if TYPE_CHECKING:
    from fleet.node.ssh.node import SSHNode

__all__ = ["STALL_S", "get", "put"]

# The longest one SFTP read may wait for the node (a transfer goes on as long as data flows).
STALL_S = 120.0


@contextmanager
def _sftp(node: SSHNode, what: Sequence[str]) -> Iterator[paramiko.SFTPClient]:
    with node._session(what, None) as chan:
        try:
            # bounded: bounded_request closes the channel past connect_timeout_s
            if not bounded_request(chan, lambda: chan.invoke_subsystem("sftp"), node.target.connect_timeout_s):
                raise CommandTimeout(f"the node did not start SFTP within {node.target.connect_timeout_s:g} s",
                                     host=node.host, command=what,
                                     remedy="the node or its sshd is stopped or overloaded; fleet retries this")
            # Every read of the transfer must make progress within STALL_S (a stalled node or
            # sftp-server raised nothing before: paramiko's reads wait forever by default).
            chan.settimeout(STALL_S)
            sftp = paramiko.SFTPClient(chan)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise node._lost(what, exc) from exc
        try:
            yield sftp
        except FleetError:
            raise
        except TimeoutError as exc:
            raise CommandTimeout(f"{what[0]} stalled: no data for {STALL_S:g} s", host=node.host, command=what,
                                 remedy="the node or its disk stopped answering; fleet retries this") from exc
        except (paramiko.SSHException, EOFError, OSError) as exc:
            if not node.connected:
                raise node._lost(what, exc) from exc
            raise CommandFailed(f"{what[0]} failed: {exc}", host=node.host, command=what,
                                remedy="check the paths exist and are writable on both sides") from exc
        finally:
            quietly(sftp.close)


def put(node: SSHNode, local: str | Path, remote: str) -> None:
    """Upload beside the target, then rename (0600, 0700 when executable)."""
    what = ["sftp-put", str(local), remote]
    local = Path(local)
    if not local.is_file():
        raise CommandFailed(f"cannot copy {local} to {remote}: no such local file", host=node.host, command=what,
                            remedy="check the local path")
    parent = posixpath.dirname(remote)
    if parent:
        node.run(["sh", "-c", 'umask 077 && mkdir -p -- "$1"', "fleet-mkdir", parent], timeout=60)
    tmp = f"{remote}.{_part_suffix()}"
    with _sftp(node, what) as sftp:
        # Upload beside the target, then rename: a reader (or a concurrent upload of the
        # same file) never sees half a file.
        try:
            sftp.put(str(local), tmp)
            # fleet's files are 0600 (0700 when executable): never readable by others
            sftp.chmod(tmp, 0o700 if local.stat().st_mode & 0o111 else 0o600)
            try:
                sftp.posix_rename(tmp, remote)
            except OSError:  # a server without the posix-rename extension
                _remove_quietly(sftp, remote)
                sftp.rename(tmp, remote)
        except BaseException:
            _remove_quietly(sftp, tmp)
            raise


def get(node: SSHNode, remote: str, local: str | Path) -> None:
    """Download to a temp file beside `local`, then rename."""
    what = ["sftp-get", remote, str(local)]
    local = Path(local)
    tmp = local.with_name(f"{local.name}.{_part_suffix()}")
    try:
        local.parent.mkdir(parents=True, exist_ok=True)
        with _sftp(node, what) as sftp:
            sftp.get(remote, str(tmp))
        os.replace(tmp, local)
    finally:
        tmp.unlink(missing_ok=True)


def _part_suffix() -> str:
    return f"fleet-part-{os.getpid()}-{threading.get_ident()}"


def _remove_quietly(sftp: paramiko.SFTPClient, path: str) -> None:
    try:
        sftp.remove(path)
    except (OSError, EOFError, paramiko.SSHException):
        pass
