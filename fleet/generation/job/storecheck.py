"""A node's store check, run by the runner's own entry point (`--check-store INPUT OUTPUT PROBE`): with
the environment its runner will have, the node reads the input's first bytes and writes, reads back and
removes a small probe object under the output; one JSON line on stdout says how it went.

Why here: the check must run the same python, the same code and the same packages as the node's chunks
(an SSH node runs it from its runner venv and zipapp); the multi-node controller asks for it before a job
and before a quarantined node rejoins (generation/multinode/nodecheck.py).
"""

from __future__ import annotations

import json
from typing import Any

CHECK_FLAG = "--check-store"
PROBE_DIR = "_probe"   # under the job's --output: the probe objects, each removed once read back


def run_checks(input_url: str, output_url: str, probe: str) -> dict[str, Any]:
    """What the node can do with the store, as the runner would: {"ok": True}, or {"ok": False, "step": what
    failed, "error": its exception, whole}. The probe object is removed (also when reading it back failed)."""
    from fleet.generation.data.objstore import Store, is_url

    step = f"load the store's packages for {output_url}"
    out = None
    rel = f"{PROBE_DIR}/{probe}"
    try:
        out = Store(output_url)
        if is_url(input_url):
            step = f"read the input {input_url}"
            _read_head(input_url)
        step = f"write a probe object under {output_url}"
        body = f"fleet node check {probe}\n".encode()
        out.write_bytes(rel, body)
        step = f"read the probe object back from {output_url}"
        if out.read_bytes(rel) != body:
            raise OSError("the probe object read back differs from what was written")
        step = f"remove the probe object under {output_url}"
        out.fs.rm(out._p(rel))
        return {"ok": True}
    except Exception as exc:   # any failure is the answer: said whole, with its type
        if out is not None and not step.startswith("remove"):
            try:
                out.fs.rm(out._p(rel))
            except Exception:   # it was never written, or this node cannot remove it: the answer stands
                pass
        return {"ok": False, "step": step, "error": f"{type(exc).__name__}: {exc}"}


def _read_head(url: str) -> None:
    """The first bytes of the input (a ranged read, not the object), or the listing of a directory."""
    from fleet.generation.data.objstore import Store

    parent, _, name = url.rstrip("/").rpartition("/")
    st = Store(parent)
    path = st._p(name)
    if st.fs.isdir(path):
        st.fs.ls(path, detail=False)
    else:
        st.fs.cat_file(path, start=0, end=64)


def check_main(argv: list[str]) -> int:
    """`runner --check-store INPUT OUTPUT PROBE`: one JSON line on stdout; exit 0 when every check passed."""
    if len(argv) != 3:
        print(json.dumps({"ok": False, "step": "parse its arguments", "error": f"usage: {CHECK_FLAG} INPUT OUTPUT PROBE"}))
        return 2
    result = run_checks(*argv)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 3
