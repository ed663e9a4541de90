"""bench/gpu_busy.py only: the garbage collections of every Python process started with this
folder on PYTHONPATH and FLEET_GCWATCH_DIR set (the engine above all): per generation, how many
and their seconds, written to $FLEET_GCWATCH_DIR/gc-<pid>.json every 0.5 s. Then the
sitecustomize this one hides, if any, runs as it would have."""

from __future__ import annotations

import os
import sys


def _watch(where: str) -> None:
    import gc
    import json
    import threading
    import time

    counts, secs, started = [0, 0, 0], [0.0, 0.0, 0.0], [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            g = min(2, info.get("generation", 0))
            counts[g] += 1
            secs[g] += time.perf_counter() - started[0]

    def dump() -> None:
        path = os.path.join(where, f"gc-{os.getpid()}.json")
        while True:
            try:
                with open(path + ".tmp", "w") as f:
                    json.dump({"t": time.time(), "counts": counts, "secs": secs}, f)
                os.replace(path + ".tmp", path)
            except OSError:
                pass
            time.sleep(0.5)

    gc.callbacks.append(callback)
    threading.Thread(target=dump, name="gcwatch", daemon=True).start()


def _chain() -> None:
    """Run the sitecustomize further down sys.path, the one this file shadows."""
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    for p in sys.path:
        f = os.path.join(p or ".", "sitecustomize.py")
        if os.path.abspath(p or ".") != here and os.path.isfile(f):
            spec = importlib.util.spec_from_file_location("_sitecustomize_shadowed", f)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


try:
    if os.environ.get("FLEET_GCWATCH_DIR"):
        _watch(os.environ["FLEET_GCWATCH_DIR"])
except Exception as exc:  # a bench aid: never stop the process it watches
    print(f"gcwatch: {type(exc).__name__}: {exc}", file=sys.stderr)
_chain()
