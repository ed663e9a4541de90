"""The local-venv stage: the engine's venv on the node's local disk, created with uv.

Keyed by a hash of the request (python, packages, index, find-links, import check); the
hash is written to `<venv>/.fleet-venv.json` only after the install and the import check
succeed, so the same request again is a no-op and a half-finished install is redone.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from typing import Any, TypedDict

from fleet.config import FleetConfig, NodeConfig
from fleet.errors import CommandFailed, PreflightFailed
from fleet.node import Node

STAMP = ".fleet-venv.json"

# What the venv is keyed by; "import" is a keyword, hence the functional form.
VenvRequest = TypedDict("VenvRequest", {
    "python": str | None, "packages": list[str], "index_url": str | None, "find_links": list[str], "import": str,
})

# Prints the seconds one import takes, in a fresh interpreter (what a server start pays).
_TIME_IMPORT = "import sys, time; t = time.perf_counter(); __import__(sys.argv[1]); print(time.perf_counter() - t)"

# sh -c FIND_UV fleet-find-uv WORKDIR: the first uv found, or nothing.
_FIND_UV = r"""
for c in "$(command -v uv 2>/dev/null)" "$HOME/.local/bin/uv" "$HOME/.cargo/bin/uv" "$1/uv/bin/uv"; do
  if [ -n "$c" ] && [ -x "$c" ]; then echo "$c"; exit 0; fi
done
exit 1
"""


@dataclass
class VenvResult:
    node: str
    path: str
    python: str
    adopted: bool
    request_hash: str
    packages: list[str]
    import_module: str
    import_seconds: float
    slow_import: bool
    uv: str | None
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def request_of(cfg: FleetConfig, import_module: str) -> VenvRequest:
    return {
        "python": cfg.venv.python,
        "packages": list(cfg.engine.packages),
        "index_url": cfg.venv.index_url,
        "find_links": list(cfg.venv.find_links),
        "import": import_module,
    }


def request_hash(request: VenvRequest) -> str:
    return hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()[:16]


def find_or_install_uv(node: Node, workdir: str) -> str:
    from fleet.workdir import ensure_workdir

    ensure_workdir(node, workdir)   # uv may be installed into it
    res = node.run(["sh", "-c", _FIND_UV, "fleet-find-uv", workdir], check=False, timeout=30)
    if res.ok and res.stdout.strip():
        return res.stdout.strip().splitlines()[0]
    # No uv: a private venv holding uv, from the node's own python3 and pip.
    home = f"{workdir}/uv"
    node.run(["python3", "-m", "venv", home], timeout=300)
    node.run([f"{home}/bin/python", "-m", "pip", "install", "--quiet", "uv"], timeout=900)
    return f"{home}/bin/uv"


def time_import(node: Node, python: str, module: str) -> float:
    res = node.run([python, "-c", _TIME_IMPORT, module], check=False, timeout=1800)
    if not res.ok:
        raise CommandFailed(
            f"the venv cannot import {module!r}", host=node.host, command=res.argv,
            exit_code=res.exit_code, stderr=res.stderr,
            remedy="check engine.packages (pins and extras) and engine.import_check",
        )
    try:
        return float(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return -1.0


def adopted_venv(node: Node, cfg: FleetConfig, node_cfg: NodeConfig, import_module: str) -> VenvResult | None:
    """What `ensure_venv` returns when it adopts the venv in place — its stamp matches this request (or
    venv.use_existing and its python exists) — with the engine's import timed; None where it would build
    (or refuse). One look at the stamp: the adopt-only bring-up asked whether the venv was adoptable,
    then `ensure_venv` looked again (two more node round trips, each an SSH exchange on a remote node)."""
    t0 = time.monotonic()
    path = cfg.venv.path.rstrip("/")
    python = f"{path}/bin/python"
    req = request_of(cfg, import_module)
    key = request_hash(req)
    uv: str | None = None
    if not cfg.venv.use_existing:
        stamp = node.read_text(f"{path}/{STAMP}")
        try:
            old = json.loads(stamp) if stamp else {}
        except json.JSONDecodeError:
            old = {}
        if not isinstance(old, dict) or old.get("hash") != key:
            return None
        uv = old.get("uv")
    if not node.exists(python):
        return None
    secs = time_import(node, python, import_module)
    return VenvResult(node_cfg.name, path, python, True, key, req["packages"], import_module, secs,
                      secs > cfg.venv.slow_import_s, uv, time.monotonic() - t0)


def ensure_venv(node: Node, cfg: FleetConfig, node_cfg: NodeConfig, import_module: str,
                network_fs: bool = False) -> VenvResult:
    """Create (or adopt) the engine venv on the node; time an import of the engine."""
    t0 = time.monotonic()
    path = cfg.venv.path.rstrip("/")
    python = f"{path}/bin/python"
    req = request_of(cfg, import_module)
    key = request_hash(req)

    if cfg.venv.use_existing:
        found = adopted_venv(node, cfg, node_cfg, import_module)
        if found is None:
            raise PreflightFailed(f"venv.use_existing is set but {python} does not exist", host=node.host,
                                  remedy="create the venv there, or set venv.use_existing = false to let fleet build it")
        return found

    if network_fs:
        raise PreflightFailed(f"venv path {path} is on a network filesystem", host=node.host,
                              remedy="set venv.path to a local disk (e.g. /opt/fleet/venv)")

    found = adopted_venv(node, cfg, node_cfg, import_module)
    if found is not None:
        return found

    uv = find_or_install_uv(node, node_cfg.workdir)
    # A stale or half-built venv is rebuilt from scratch: cheaper than reasoning about its state.
    node.run(["rm", "-f", "--", f"{path}/{STAMP}"], timeout=60)
    # Config values go as `--opt=value` and after `--`: a value starting with '-' is never an option.
    venv_argv = [uv, "venv", "--quiet", "--allow-existing"]
    if cfg.venv.python:
        venv_argv += [f"--python={cfg.venv.python}"]
    venv_argv += ["--", path]
    # UV_NATIVE_TLS is the older uv's name for UV_SYSTEM_CERTS; an unknown variable is ignored.
    uv_env = {"UV_SYSTEM_CERTS": "1", "UV_NATIVE_TLS": "1"} if cfg.venv.system_certs else None
    node.run(venv_argv, timeout=600, env=uv_env)
    if req["packages"]:
        install = [uv, "pip", "install", "--quiet", "--compile-bytecode", f"--python={python}"]
        if cfg.venv.index_url:
            install += [f"--index-url={cfg.venv.index_url}"]
        for link in cfg.venv.find_links:
            install += [f"--find-links={link}"]
        node.run([*install, "--", *req["packages"]], timeout=3600, env=uv_env)
    secs = time_import(node, python, import_module)
    node.write_text(f"{path}/{STAMP}", json.dumps({"hash": key, "request": req, "uv": uv,
                                                     "created": time.time()}, indent=2))
    return VenvResult(node_cfg.name, path, python, False, key, req["packages"], import_module, secs,
                      secs > cfg.venv.slow_import_s, uv, time.monotonic() - t0)
