"""One small exception tree for fleet.

    FleetError                      every error fleet raises on purpose
    ├── TransientError              worth retrying: the same call may succeed later
    │   ├── NodeUnreachable         connection refused / reset / DNS / TCP timeout
    │   ├── ConnectionLost          an established connection dropped mid-call
    │   ├── CommandTimeout          a command ran past its deadline
    │   └── ServerNotReady          a server is still starting or answered 5xx / timed out
    └── FatalError                  retrying the same call will fail the same way
        ├── ConfigError             the fleet config is invalid (file, key, what, allowed)
        ├── AuthFailed              the node refused our key
        ├── HostKeyError            host key unknown or changed (never silently accepted)
        ├── CommandNotFound         exit code 127 on the node
        ├── CommandFailed           any other non-zero exit
        ├── PreflightFailed         a node failed a hard check (GPUs, RAM disk, network FS)
        ├── ServerFailed            a server died or logged a fatal line
        ├── InputError              a generation input that cannot be read (missing, a directory,
        │   │                       corrupt at a line/byte, no valid row) or an unusable --output
        │   ├── InputChanged        the input is not the version the job was planned on any more
        │   └── StoreError          object storage refused or failed (credentials, permission, bucket)
        ├── JobConflict             a second job into one output dir, or a change under a live job
        └── Stopped                 a wait given up because the run was asked to stop (Prefect's
                                    Cancel, SIGTERM, Ctrl-C: fleet/interrupt.py)

Every message names the host, what was run, and ends with a remedy. paramiko and OS
errors are translated into this tree at the node boundary (`fleet.node`), so nothing
above it needs to know which transport was used. Prefect tasks retry only a
`TransientError` worth retrying (tasks/policy.py): not ServerNotReady, whose wait already
took servers.ready_timeout_s.
"""

from __future__ import annotations

from collections.abc import Sequence

# A secret as records, logs and errors show it (pydantic's SecretStr rendering). Here, at the
# bottom of the core, so everything that masks can use it without importing the config.
MASK = "**********"


def tail(text: str | bytes | None, lines: int = 12) -> str:
    """The last `lines` non-empty lines of `text`, for error messages."""
    if not text:
        return ""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    kept = [ln for ln in text.splitlines() if ln.strip()]
    return "\n".join(kept[-lines:])


class FleetError(Exception):
    """Base of every error fleet raises on purpose."""

    transient = False

    def __init__(
        self,
        message: str,
        *,
        host: str | None = None,
        command: Sequence[str] | str | None = None,
        exit_code: int | None = None,
        stderr: str | None = None,
        remedy: str | None = None,
        path: str | None = None,
    ) -> None:
        self.reason = message
        self.logged = False  # a stage logged it in full already: the orchestrator need not repeat it
        self.path = path  # the file the error is about (a full disk names it)
        self.host = host
        self.command = command
        self.exit_code = exit_code
        self.stderr_tail = tail(stderr)
        self.remedy = remedy
        super().__init__(self._format())

    def _format(self) -> str:
        import shlex

        parts = []
        if self.host:
            parts.append(f"[{self.host}]")
        parts.append(self.reason)
        if self.command:
            cmd = self.command if isinstance(self.command, str) else shlex.join(self.command)
            if len(cmd) > 300:
                cmd = cmd[:300] + "…"
            parts.append(f"(command: {cmd}")
            parts[-1] += f", exit code {self.exit_code})" if self.exit_code is not None else ")"
        msg = " ".join(parts)
        if self.stderr_tail:
            msg += "\n  stderr: " + self.stderr_tail.replace("\n", "\n          ")
        if self.remedy:
            msg += f"\n  remedy: {self.remedy}"
        return msg

    def one_line(self) -> str:
        """A single line for CLIs: reason, host, remedy."""
        host = f"[{self.host}] " if self.host else ""
        fix = f" — {self.remedy}" if self.remedy else ""
        last = f" ({self.stderr_tail.splitlines()[-1]})" if self.stderr_tail else ""
        return f"{host}{self.reason}{last}{fix}"


class TransientError(FleetError):
    transient = True


class NodeUnreachable(TransientError):
    pass


class ConnectionLost(TransientError):
    pass


class CommandTimeout(TransientError):
    pass


class ServerNotReady(TransientError):
    pass


class FatalError(FleetError):
    pass


class ConfigError(FatalError):
    pass


class AuthFailed(FatalError):
    pass


class HostKeyError(FatalError):
    pass


class CommandNotFound(FatalError):
    pass


class CommandFailed(FatalError):
    pass


class PreflightFailed(FatalError):
    pass


class ServerFailed(FatalError):
    pass


class InputError(FatalError):
    pass


class InputChanged(InputError):
    """The input's pinned version (fleet.generation.data.pin) is gone or another one is there: reading
    on would mix two inputs in one output."""


class StoreError(InputError):
    """Object storage refused or failed an operation (fleet.generation.data.storeerrors): the cause in
    one line, never the credentials."""


class JobConflict(FatalError):
    pass


class Stopped(FatalError):
    pass


class Fenced(FatalError):
    """A multi-node job ended without this runner's chunk attempt (multinode/fence.py `ENDED_FILE`):
    what it put in the store counts for nothing and was removed; it stops."""


def is_transient(exc: BaseException | None) -> bool:
    """True for errors worth retrying (used as a Prefect retry_condition_fn helper)."""
    return isinstance(exc, TransientError)
