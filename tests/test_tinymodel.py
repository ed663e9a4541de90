"""fleet.tinymodel: a random-weight chat model built locally, and real `transformers serve`
serving it on CPU (marked `transformers`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet import tinymodel
from fleet.errors import ConfigError
from conftest import wait_until as _wait_until

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


# ------------------------------------------------------------------------------- helpers


def _free_port() -> int:
    from conftest import free_port

    return free_port()




@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "model"
    started = time.monotonic()
    tinymodel.build_tiny_model(out)
    # ~3-5 s here, nearly all of it importing torch + transformers; not asserted (a busy machine
    # is slower): what keeps it fast is its size, checked in test_build_writes_a_small_complete_model.
    print(f"built the tiny model in {time.monotonic() - started:.1f} s")
    return out


# ------------------------------------------------------------------------------- build


def test_import_is_lazy() -> None:
    code = "import sys, fleet.tinymodel; assert not {'torch', 'transformers', 'tokenizers'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_build_writes_a_small_complete_model(tiny_model: Path) -> None:
    names = {p.name for p in tiny_model.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        tinymodel.STAMP_NAME,
    } <= names
    size = sum(p.stat().st_size for p in tiny_model.iterdir())
    assert size < 2_000_000, size
    assert not [p for p in tiny_model.parent.iterdir() if p.name.startswith(".")], "temporary build dirs left"

    config = json.loads((tiny_model / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["vocab_size"] == 1024
    tok_config = json.loads((tiny_model / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>" and tok_config["pad_token"] == "<|endoftext|>"
    assert "<|im_start|>" in tok_config["chat_template"]
    gen = json.loads((tiny_model / "generation_config.json").read_text())
    assert config["eos_token_id"] in gen["eos_token_id"]

    stamp = tinymodel.read_stamp(tiny_model)
    assert stamp and stamp["params"]["arch"] == "qwen2" and stamp["params"]["seed"] == 0
    assert tinymodel.is_complete(tiny_model)


def test_build_is_idempotent_and_rebuilds_on_change(tmp_path: Path) -> None:
    out = tmp_path / "m"
    tinymodel.build_tiny_model(out, vocab_size=600)
    weights = out / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    assert tinymodel.build_tiny_model(out, vocab_size=600) == out
    assert weights.stat().st_mtime_ns == mtime   # reused, not rebuilt (checked by the file, not the clock)

    tinymodel.build_tiny_model(out, vocab_size=600, seed=1)  # other parameters: rebuilt in place
    assert tinymodel.read_stamp(out)["params"]["seed"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["m"]

    weights.write_bytes(b"truncated")  # a damaged model is not complete: rebuilt
    assert not tinymodel.is_complete(out)
    tinymodel.build_tiny_model(out, vocab_size=600, seed=1)
    assert tinymodel.is_complete(out)


def test_build_refuses_a_foreign_directory_and_bad_shapes(tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="refusing"):
        tinymodel.build_tiny_model(foreign)
    assert (foreign / "precious.txt").read_text() == "keep me"

    with pytest.raises(ConfigError, match="arch"):
        tinymodel.build_tiny_model(tmp_path / "x", arch="gpt2")
    with pytest.raises(ConfigError, match="kv_heads"):
        tinymodel.build_tiny_model(tmp_path / "x", heads=4, kv_heads=3)
    with pytest.raises(ConfigError, match="vocab_size"):
        tinymodel.build_tiny_model(tmp_path / "x", vocab_size=300)
    assert not (tmp_path / "x").exists()


def test_qwen3_shape_presets() -> None:
    for want, lo, hi in [(0.5, 0.5, 0.7), (1, 0.9, 1.2), (2, 1.5, 1.9)]:
        shape = tinymodel.qwen3_shape(want)
        assert shape["arch"] == "qwen3" and shape["vocab_size"] == 151_936 and shape["dtype"] == "bfloat16"
        assert lo < tinymodel.count_parameters(**shape) / 1e9 < hi


def test_loads_with_auto_classes_and_generates(tiny_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert len(tok) == model.config.vocab_size == 1024
    assert sum(p.numel() for p in model.parameters()) == tinymodel.count_parameters(
        **tinymodel.read_stamp(tiny_model)["params"]
    )

    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hello."},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nSay hello.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages, tokenize=False).endswith("Say hello.<|im_end|>\n")
    inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    assert inputs["input_ids"][0, 0].item() == tok.convert_tokens_to_ids("<|im_start|>")

    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :]
    assert 1 <= len(new) <= 8
    assert tok.decode(new, skip_special_tokens=True)

    # Every id of the embedding decodes to something (the vocabulary is padded with filler words).
    assert tok.decode([1023]).strip()


def test_qwen3_arch_builds_and_generates(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tinymodel.build_tiny_model(tmp_path / "q3", arch="qwen3", head_dim=32, dtype="bfloat16")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.dtype == torch.bfloat16
    tok = AutoTokenizer.from_pretrained(out)
    inputs = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    with torch.no_grad():
        out_ids = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out_ids.shape[1] > inputs["input_ids"].shape[1]


# ------------------------------------------------------------------------------- serve


@pytest.fixture(scope="module")
def served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    """A real `transformers serve` on CPU pinned to the tiny model: (base url, model id, log)."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    model_id = str(tiny_model)  # a pinned server answers only to the exact string it was started with
    argv = [
        sys.executable, "-m", "transformers.cli.transformers", "serve", model_id,
        "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # else it resolves huggingface.co
    with log.open("wb") as fh:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        import httpx

        def healthy() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"transformers serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                return httpx.get(f"{base}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        started = time.monotonic()
        _wait_until(healthy, timeout=240, what=f"transformers serve /health on {base}")   # a deadline only
        print(f"transformers serve healthy after {time.monotonic() - started:.1f} s")
        yield base, model_id, log
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass


@pytest.mark.transformers
def test_transformers_serve_chat_completion(served: tuple[str, str, Path]) -> None:
    import httpx

    base, model_id, log = served
    assert "Uvicorn running on" in log.read_text()

    models = httpx.get(f"{base}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [model_id]

    body = {
        "model": model_id,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there."}],
        "max_tokens": 16,
        "temperature": 0.6,
    }
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()
    choice = data["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"]
    assert choice["finish_reason"] in ("length", "stop")
    usage = data["usage"]
    assert usage["prompt_tokens"] > 10
    assert 1 <= usage["completion_tokens"] <= 16  # max_tokens is honoured
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    if choice["finish_reason"] == "length":
        assert usage["completion_tokens"] == 16

    # The model may be left out; any other name than the pinned one is refused.
    r = httpx.post(f"{base}/v1/chat/completions", json={**body, "model": None, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{base}/v1/chat/completions", json={**body, "model": "tiny"}, timeout=60)
    assert r.status_code == 400 and "pinned" in r.text
    # Fields outside the OpenAI schema (SGLang / vLLM extras such as top_k) are refused with 422.
    r = httpx.post(f"{base}/v1/chat/completions", json={**body, "top_k": 5}, timeout=60)
    assert r.status_code == 422


@pytest.mark.transformers
def test_transformers_serve_streams_usage(served: tuple[str, str, Path]) -> None:
    import httpx

    base, model_id, _ = served
    body = {
        "model": model_id,
        "messages": [{"role": "user", "content": "Count to three."}],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    # The usage comes in either shape the runner's client reads (hotpath/client.py walks `choices or ()`):
    # on the finish chunk itself (transformers 5.24 and before: `include_usage` ignored, usage always
    # sent), or as OpenAI sends it, a last chunk with no choices after the finish chunk (5.25 on, which
    # reads `include_usage`). A fresh install takes the newest transformers: the test holds for both.
    with_choices = [c for c in chunks if c.get("choices")]
    finish = with_choices[-1]
    assert finish["choices"][0]["finish_reason"] in ("length", "stop"), finish
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert len(usage) == 1, chunks[-3:]
    assert chunks[-1].get("usage") and (chunks[-1] is finish or chunks[-1]["choices"] == []), chunks[-3:]
    assert 1 <= usage[0]["completion_tokens"] <= 8
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in with_choices)
    assert text
