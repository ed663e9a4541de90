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


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def to_toml(data: dict[str, Any]) -> str:
    """TOML for the config shapes fleet writes: scalars, lists, tables, and arrays of tables."""
    lines: list[str] = []

    def table(prefix: str, d: dict[str, Any]) -> None:
        scalars = {k: v for k, v in d.items() if not isinstance(v, dict) and not _is_table_list(v) and v is not None}
        for k, v in scalars.items():
            lines.append(f"{k} = {_toml_value(v)}")
        for k, v in d.items():
            name = f"{prefix}.{k}" if prefix else k
            if isinstance(v, dict) and v:
                lines.extend(["", f"[{name}]"])
                table(name, v)
            elif _is_table_list(v):
                for item in v:
                    lines.extend(["", f"[[{name}]]"])
                    table(name, item)

    table("", data)
    return "\n".join(lines).lstrip() + "\n"


def _is_table_list(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


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
