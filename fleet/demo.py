"""`fleet demo`: the whole bring-up on this machine, under Prefect's embedded server.

transformers: a tiny random-weight chat model built locally, 2 real `transformers serve`
servers on CPU. sim: 4 simulated SGLang servers, a fresh uv venv, a small fake model.
The config it used is written next to its state, so `fleet status/down -c` work on it.
This module builds the demo's config; `flows/demo.py` runs it through the flow.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def demo_dir() -> Path:
    return Path(os.environ.get("FLEET_DEMO_DIR", f"/tmp/fleet-demo-{os.getuid()}"))


def free_port_block(n: int, start: int = 31000, stop: int = 60000) -> int:
    """First port p such that p .. p+n-1 are all free on 127.0.0.1."""
    for base in range(start, stop, n):
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free block of ports")


def to_toml(data: Mapping[str, Any]) -> str:
    """TOML text of a config dict (tomli-w). TOML has no null: a key set to None is left out, as
    the config treats a missing key (`model_dump(mode="json")` output can be written as is); TOML
    keys are strings: an int key (`servers.extra_args_by_index`) is written as its digits."""
    import tomli_w

    return tomli_w.dumps(_without_none(data))


def _without_none(d: Mapping[str, Any]) -> dict[str, Any]:
    def clean(v: Any) -> Any:
        if isinstance(v, Mapping):
            return _without_none(v)
        if isinstance(v, list | tuple):
            return [clean(x) for x in v]
        return v

    return {str(k): clean(v) for k, v in d.items() if v is not None}


def demo_config(engine: str, servers: int | None, state: Path) -> dict[str, Any]:
    n = servers or (2 if engine == "transformers" else 4)
    work = state / "work"
    common: dict[str, Any] = {
        "name": f"demo-{engine}",
        "nodes": [{"name": "local", "kind": "local", "workdir": str(work)}],
        "servers": {"count": n, "base_port": free_port_block(n), "ready_timeout_s": 300.0},
    }
    if engine == "transformers":
        from fleet.tinymodel import build_tiny_model

        model = build_tiny_model(state / "models" / "tiny-chat")
        common.update(
            engine={"kind": "transformers", "device": "cpu", "continuous_batching": False},
            model={"source": str(model), "stage": True, "stage_margin_gb": 0.05},
            # The demo's servers run from the venv fleet itself is installed in (it has transformers).
            venv={"path": sys.prefix, "use_existing": True},
            smoke={"first_timeout_s": 120.0, "timeout_s": 60.0, "attempts": 3, "max_tokens": 8},
        )
    else:
        model = state / "models" / "sim-model"
        model.mkdir(parents=True, exist_ok=True)
        (model / "config.json").write_text('{"architectures": ["SimForCausalLM"], "model_type": "sim"}\n')
        weights = model / "model.safetensors"
        if not weights.exists():
            weights.write_bytes(os.urandom(8 << 20))
        common.update(
            engine={"kind": "sim", "sim": {"startup_s": 2.0, "first_request_delay_s": 0.5}},
            model={"source": str(model), "stage": True, "stage_margin_gb": 0.05},
            venv={"path": str(state / "venv-sim")},
            smoke={"first_timeout_s": 30.0, "timeout_s": 10.0},
        )
    return common


def left_behind(cfg: Any, cfg_path: Path, freed: Mapping[str, Any] | None, *, keep: bool) -> str:
    """What the demo leaves on this machine, and where its servers' logs are: a person trying fleet
    should not find a RAM-disk copy or a server process later and wonder whose it is."""
    from fleet.servers import server_paths

    node = cfg.nodes[0]
    n = cfg.servers.count or len(cfg.servers.ports or [])
    logs = [server_paths(node.workdir, cfg.name, i).log for i in range(n)]
    lines = ["The servers' log files: " + " ".join(logs)]
    if freed is not None and freed.get("action") == "freed":
        size = f", {freed['bytes'] / 1e6:.1f} MB" if freed.get("bytes") else ""
        lines.append(f"RAM disk: the model's copy in {freed['path']} freed{size} (--keep-ramdisk keeps it)")
    elif freed is not None:
        lines.append(f"RAM disk: {freed.get('path') or node.ramdisk}: {freed.get('action')}")
    elif keep:
        lines.append(f"RAM disk: the model's copy under {node.ramdisk} stays while the servers use it; "
                     f"`fleet down -c {cfg_path} --free-ramdisk` frees it")
    else:
        lines.append(f"RAM disk: the model's copy under {node.ramdisk} kept (--keep-ramdisk); "
                     f"`fleet down -c {cfg_path} --free-ramdisk` frees it")
    lines.append("The local Prefect server that recorded the run stays up for the report commands and stops "
                 "itself after FLEET_PREFECT_SERVER_IDLE_S (600 s) unused; stop it now: "
                 ".venv/bin/python -m flows.localserver stop")
    return "\n".join(lines)
