"""The simulator as one file: a zip that ``python fleet_sim.pyz --port P ...`` runs.

The launcher puts it on the node (``fleet.servers.upload_sim_script``). It holds
``fleet/sim/*.py`` under a stand-in ``fleet/__init__.py`` (fleet's own may import more than
the standard library some day) and a ``__main__.py`` that calls ``fleet.sim.server.main``.
The sources are read as package resources, not paths: an SSH node's runner imports fleet
from a zip file.
"""

from __future__ import annotations

import io
import zipfile
from importlib import resources

#: Fixed member times: the same sources give the same bytes.
_DATE_TIME = (2020, 1, 1, 0, 0, 0)
_FLEET_INIT = '"""fleet\'s simulated SGLang server, shipped alone (fleet.sim.bundle)."""\n'
_MAIN = "import sys\nfrom fleet.sim.server import main\nsys.exit(main())\n"


def sources() -> dict[str, bytes]:
    """``fleet/sim/<module>.py`` -> source, for every module of the package."""
    pkg = resources.files("fleet.sim")
    return {f"fleet/sim/{entry.name}": entry.read_bytes()
            for entry in sorted(pkg.iterdir(), key=lambda e: e.name)
            if entry.is_file() and entry.name.endswith(".py")}


def build_pyz() -> bytes:
    """The zip's bytes (deterministic for the same sources)."""
    members = {"__main__.py": _MAIN.encode(), "fleet/__init__.py": _FLEET_INIT.encode(), **sources()}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            info = zipfile.ZipInfo(name, date_time=_DATE_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
    return buf.getvalue()
