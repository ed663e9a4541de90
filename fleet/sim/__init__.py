"""The simulated SGLang server (``fleet.sim.server``): SGLang's endpoints and log lines, no GPU.

``server.py`` is a single stdlib-only file so the launcher can copy it to a node and run it
with a bare interpreter; nothing here may import from it at package import time.
"""

from __future__ import annotations

from pathlib import Path

#: The file the launcher copies to a node and runs as ``python server.py --port P ...``.
SERVER_FILE = Path(__file__).with_name("server.py")

__all__ = ["SERVER_FILE"]
