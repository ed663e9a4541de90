"""The `speculators` exports, loaded by the real speculators 0.9.0 (issue 24).

speculators and its companion hs-connectors (both pure Python) are installed once, without
their dependencies, into `.venv/speculators-0.9.0/` (about 1 MB, ~10 s the first time): the
test venv already has what its data loaders import (torch CPU, transformers, datasets). The
install failing fails the test; nothing is skipped. The loaders run in a subprocess with that
folder on PYTHONPATH, on files `fleet export` wrote:

- `speculators` (conversations): `load_raw_dataset`, then `load_and_preprocess_dataset` with a
  stand-in for vLLM's `/v1/chat/completions/render` (the tiny model's chat template through
  its tokenizer, which is what that endpoint does) — one training row per assistant turn;
- `speculators-tokens` (pre-tokenized): `load_raw_dataset`, then `load_and_preprocess_dataset`
  with no render endpoint: the rows pass through with their own input_ids and loss_mask.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.generation.data.export import export
from fleet.generation.data.manifest import write_manifest
from fleet.generation.data.store import ResultStore

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / ".venv" / "speculators-0.9.0"
PACKAGES = ["speculators==0.9.0", "hs-connectors==0.9.0"]


def _installed() -> Path:
    if (TARGET / "speculators" / "__init__.py").is_file() and (TARGET / "hs_connectors").is_dir():
        return TARGET
    tmp = TARGET.with_name(TARGET.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)   # a half install of an interrupted run
    r = subprocess.run(["python3", "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(tmp), *PACKAGES],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"installing {PACKAGES} failed (this test needs them):\n{r.stderr[-2000:]}"
    tmp.rename(TARGET)
    return TARGET


LOADERS = r'''
import json, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from fleet.tinymodel import build_tiny_model
from transformers import AutoTokenizer
from speculators.data_generation.preprocessing import load_raw_dataset, load_and_preprocess_dataset

model_dir, conv_file, tok_file = sys.argv[1:4]
build_tiny_model(model_dir)
tok = AutoTokenizer.from_pretrained(model_dir)

class Render(BaseHTTPRequestHandler):
    """vLLM's /v1/chat/completions/render, stood in: the chat template applied by the tokenizer."""
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ids = tok.apply_chat_template(body["messages"], add_generation_prompt=body["add_generation_prompt"],
                                      tokenize=True, return_dict=False)
        if body.get("truncate_prompt_tokens"):
            ids = ids[: body["truncate_prompt_tokens"]]
        data = json.dumps({"token_ids": list(ids)}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
    def log_message(self, *a):
        pass

srv = ThreadingHTTPServer(("127.0.0.1", 0), Render)
threading.Thread(target=srv.serve_forever, daemon=True).start()
out = {}
for name, path, endpoint in (("conv", conv_file, f"http://127.0.0.1:{srv.server_port}"), ("tok", tok_file, None)):
    raw, _ = load_raw_dataset(path)
    ds, _ = load_and_preprocess_dataset(model_dir, [path], seq_length=2048, build_dataset_num_proc=1,
                                        render_endpoint=endpoint)
    out[name] = {"raw_rows": len(raw), "raw_columns": sorted(raw.column_names), "rows": len(ds),
                 "supervised": sorted(int(r["loss_mask"].sum()) for r in ds),
                 "input_ids": sorted([int(x) for x in r["input_ids"]] for r in ds)}
print("RESULT " + json.dumps(out))
'''

CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "one plus one"},
        {"role": "assistant", "content": "two", "reasoning_content": "add"}, {"role": "user", "content": "and two more"}]


@pytest.mark.timeout(900)
def test_speculators_loaders_take_both_exports(tmp_path):
    """What fleet writes for speculators is what speculators 0.9.0 loads: the conversation file
    (extra fields kept) through its render path, one row per assistant turn; the pre-tokenized
    file through its pass-through, keeping the sampled ids and their loss mask exactly."""
    target = _installed()
    out = tmp_path / "job"
    with ResultStore(out) as s:
        s.add_result({"id": "a", "messages": CONV, "completion": "four", "finish_reason": "stop",
                      "extra": {"source": "unit"},
                      "token_ids": [{"prompt": [1, 2, 3], "completion": [40, 41]},
                                    {"prompt": [1, 2, 3, 40, 41, 4], "completion": [50, 51, 52]}]})
        s.add_result({"id": "b", "messages": CONV[1:2], "completion": "hi", "finish_reason": "stop",
                      "extra": {"source": "unit"}, "token_ids": [{"prompt": [7, 8], "completion": [9]}]})
    write_manifest(out, {"state": "done"})
    conv, tok = tmp_path / "conv.jsonl", tmp_path / "tok.jsonl"
    assert export(out, "speculators", conv).rows == 2
    assert export(out, "speculators-tokens", tok).rows == 3
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(ROOT)]), "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    r = subprocess.run([sys.executable, "-c", LOADERS, str(tmp_path / "model"), str(conv), str(tok)],
                       capture_output=True, text=True, env=env, timeout=800, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.split("RESULT ", 1)[1])
    assert got["conv"]["raw_rows"] == 2 and "source" in got["conv"]["raw_columns"]
    assert got["conv"]["rows"] == 3 and all(n > 0 for n in got["conv"]["supervised"])  # a: 2 turns, b: 1
    assert got["tok"]["raw_columns"] == ["id", "input_ids", "loss_mask", "metadata", "primary_id"]
    assert got["tok"]["rows"] == 3 and got["tok"]["supervised"] == [1, 2, 3]
    assert got["tok"]["input_ids"] == [[1, 2, 3, 40, 41], [1, 2, 3, 40, 41, 4, 50, 51, 52], [7, 8, 9]]
