"""``python -m fleet.sim --port P ...``: run the simulated SGLang server."""

from __future__ import annotations

import sys

from fleet.sim.server import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m fleet.sim"))  # argparse would say "__main__.py"
