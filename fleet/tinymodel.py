"""Build a random-weight chat model directory locally, in seconds, with no download.

What it writes (a directory `transformers`, `transformers serve`, vLLM and SGLang can load):

    config.json               Qwen2ForCausalLM or Qwen3ForCausalLM, random weights
    model.safetensors         (sharded with an index for large shapes)
    generation_config.json    eos = <|im_end|> and <|endoftext|>; Qwen3-like sampling defaults
    tokenizer.json            byte-level BPE trained here on a built-in corpus, padded to `vocab_size`
    tokenizer_config.json     ChatML chat template (<|im_start|> / <|im_end|>), eos / pad set
    fleet-tiny-model.json     the stamp: the build parameters and every file's size, written last

Two choices that matter downstream:

* The tokenizer vocabulary always equals the config's `vocab_size`. A BPE trained on a few
  dozen KB cannot reach 151,936 tokens, so the trained vocabulary is padded with readable
  filler words (" bako", " tidumi", ...) that encoding never produces but decoding does. A
  random model samples ids uniformly-ish over the whole vocabulary; without the padding
  every id beyond the tokenizer would decode to nothing and responses would come back empty.
* `generation_config.json` samples by default (temperature 0.6, top_p 0.95, top_k 20, as
  Qwen3 does). `transformers serve` never turns sampling *on* for a request, it only turns
  it off for `temperature: 0`; with greedy defaults a request's temperature would be ignored.

Idempotent: when `out_dir` already holds a complete model built with the same parameters
(per the stamp), `build_tiny_model` returns at once. A build is written into a temporary
sibling directory and renamed into place, so a killed build never leaves a half model
behind that looks complete. A non-empty directory that is not ours is never overwritten.

torch / transformers / tokenizers are imported lazily: `import fleet.tinymodel` is free.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleet.errors import ConfigError

if TYPE_CHECKING:  # imported lazily at run time (torch and transformers are heavy)
    from transformers import PreTrainedTokenizerFast

log = logging.getLogger(__name__)

STAMP_NAME = "fleet-tiny-model.json"
FORMAT_VERSION = 1

ARCHITECTURES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
DTYPES = ("float32", "bfloat16", "float16")

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]

# ChatML, as Qwen2.5 / Qwen3 use it, without tools or thinking: system / user / assistant
# turns and add_generation_prompt. Content may be a string or a list of {"type": "text"} parts.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] -%}"
    "{%- for part in message['content'] -%}{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Qwen3 shapes (hidden, layers, heads, kv_heads, head_dim, intermediate), vocab 151,936, tied
# embeddings. 0.6B / 1.7B / 4B are the published Qwen3 shapes; 1B is in between.
_QWEN3_PRESETS: dict[float, dict[str, int]] = {
    0.6: dict(hidden_size=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072),
    1.0: dict(hidden_size=1536, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=4608),
    1.7: dict(hidden_size=2048, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=6144),
    4.0: dict(hidden_size=2560, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=9728),
}
QWEN3_VOCAB = 151_936


def qwen3_shape(params_b: float) -> dict[str, Any]:
    """Keyword arguments for `build_tiny_model` giving a Qwen3-shaped model of about
    `params_b` billion parameters: the nearest of ~0.6B, ~1B, ~1.7B, ~4B (vocab 151,936,
    tied embeddings, bf16). Example: `build_tiny_model(out, **qwen3_shape(1.7))`."""
    if params_b <= 0:
        raise ConfigError(f"qwen3_shape: params_b must be > 0, got {params_b}")
    nearest = min(_QWEN3_PRESETS, key=lambda b: abs(math.log(b / params_b)))
    return dict(
        arch="qwen3",
        vocab_size=QWEN3_VOCAB,
        max_position=40_960,
        tie_word_embeddings=True,
        dtype="bfloat16",
        **_QWEN3_PRESETS[nearest],
    )


def count_parameters(
    *,
    hidden_size: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab_size: int,
    head_dim: int | None = None,
    tie_word_embeddings: bool = False,
    arch: str = "qwen2",
    **_ignored: Any,
) -> int:
    """Parameter count of the model `build_tiny_model` would write, without building it."""
    hd = head_dim or hidden_size // heads
    q, kv = heads * hd, kv_heads * hd
    attn = hidden_size * q + 2 * hidden_size * kv + q * hidden_size
    if arch == "qwen2":  # q/k/v biases
        attn += q + 2 * kv
    else:  # qwen3: q_norm / k_norm over head_dim
        attn += 2 * hd
    mlp = 3 * hidden_size * intermediate
    per_layer = attn + mlp + 2 * hidden_size  # two RMSNorms
    embed = vocab_size * hidden_size
    return layers * per_layer + embed * (1 if tie_word_embeddings else 2) + hidden_size


def build_tiny_model(
    out_dir: Path | str,
    *,
    arch: str = "qwen2",
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab_size: int = 1024,
    max_position: int = 32_768,
    head_dim: int | None = None,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: str = "float32",
    device: str = "cpu",
) -> Path:
    """Write a random-weight chat model into `out_dir` and return `out_dir`.

    `arch` is "qwen2" (Qwen2ForCausalLM) or "qwen3" (Qwen3ForCausalLM). `vocab_size` is the
    size of both the tokenizer and the embedding (>= 512). `dtype` is "float32", "bfloat16"
    or "float16". `device` ("cpu", "cuda", "cuda:0", ...) is only where the random weights
    are drawn; it is not part of the model's identity (the stamp). A large shape initialises
    far faster on a GPU: `qwen3_shape(1.7)` took 3.4 s with device="cuda" on an H200 and
    64 s on its 16 CPU cores; `qwen3_shape(0.6)` ~10 s on 2 CPU cores. Defaults: ~0.2M parameters, ~0.9 MB, built in well under a second
    (plus ~4 s to import torch + transformers). The small default unties the output head:
    with tied embeddings a random model's greedy output just repeats the last prompt token.
    """
    out_dir = Path(out_dir)
    params = _params(
        arch=arch,
        hidden_size=hidden_size,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        vocab_size=vocab_size,
        max_position=max_position,
        head_dim=head_dim,
        tie_word_embeddings=tie_word_embeddings,
        seed=seed,
        dtype=dtype,
    )
    if is_complete(out_dir, params):
        log.info("tiny model already complete at %s", out_dir)
        return out_dir
    if out_dir.exists() and not _replaceable(out_dir):
        raise ConfigError(
            f"refusing to build a tiny model into {out_dir}: it exists, is not empty and holds no {STAMP_NAME}; "
            "remedy: pass an empty or new directory"
        )

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    started = time.monotonic()
    try:
        tmp.mkdir()
        _write_model(tmp, params, device=device)
        for f in tmp.iterdir():  # save_pretrained writes the weights 0600: other users may serve them
            f.chmod(0o644)
        _write_stamp(tmp, params)
        _swap_into_place(tmp, out_dir, params)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("built tiny model %s in %.2f s at %s", params["arch"], time.monotonic() - started, out_dir)
    return out_dir


def read_stamp(out_dir: Path | str) -> dict[str, Any] | None:
    """The stamp of a model built here, or None when there is none or it is unreadable."""
    try:
        stamp = json.loads((Path(out_dir) / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def is_complete(out_dir: Path | str, params: dict[str, Any] | None = None) -> bool:
    """True when `out_dir` holds a complete model built here (every file the stamp lists is
    present with its size), and, when `params` is given, built with exactly those parameters."""
    out_dir = Path(out_dir)
    stamp = read_stamp(out_dir)
    if stamp is None or stamp.get("format") != FORMAT_VERSION:
        return False
    if params is not None and stamp.get("params") != params:
        return False
    files = stamp.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for name, size in files.items():
        try:
            if (out_dir / name).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


# ---------------------------------------------------------------------------- internals


def _params(**kw: Any) -> dict[str, Any]:
    arch = str(kw["arch"]).lower()
    if arch not in ARCHITECTURES:
        raise ConfigError(f"tiny model: unknown arch {kw['arch']!r}; allowed: {', '.join(ARCHITECTURES)}")
    dtype = str(kw["dtype"]).removeprefix("torch.")
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(dtype, dtype)
    if dtype not in DTYPES:
        raise ConfigError(f"tiny model: unknown dtype {kw['dtype']!r}; allowed: {', '.join(DTYPES)}")
    ints = ("hidden_size", "layers", "heads", "kv_heads", "intermediate", "vocab_size", "max_position", "seed")
    p: dict[str, Any] = {k: int(kw[k]) for k in ints}
    p["head_dim"] = int(kw["head_dim"]) if kw["head_dim"] else None
    p["tie_word_embeddings"] = bool(kw["tie_word_embeddings"])
    p["arch"] = arch
    p["dtype"] = dtype
    if min(p[k] for k in ints if k != "seed") < 1:
        raise ConfigError(f"tiny model: sizes must be positive: {p}")
    if p["heads"] % p["kv_heads"]:
        raise ConfigError(f"tiny model: heads ({p['heads']}) must be a multiple of kv_heads ({p['kv_heads']})")
    if p["head_dim"] is None and p["hidden_size"] % p["heads"]:
        raise ConfigError(
            f"tiny model: hidden_size ({p['hidden_size']}) must be a multiple of heads ({p['heads']}), "
            "or pass head_dim"
        )
    if p["vocab_size"] < 512:
        raise ConfigError(f"tiny model: vocab_size must be >= 512 (256 bytes + merges + specials), got {p['vocab_size']}")
    return p


def _replaceable(out_dir: Path) -> bool:
    """An existing out_dir may be replaced when it is an empty directory or one we built."""
    if not out_dir.is_dir():
        return False
    return not any(out_dir.iterdir()) or (out_dir / STAMP_NAME).exists()


def _swap_into_place(tmp: Path, out_dir: Path, params: dict[str, Any]) -> None:
    old = None
    if out_dir.exists():
        if not any(out_dir.iterdir()):
            out_dir.rmdir()
        else:
            old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}-{time.monotonic_ns()}"
            out_dir.rename(old)
    try:
        tmp.rename(out_dir)
    except OSError:
        # Someone else finished the same build first: keep theirs when it is what we want.
        if not is_complete(out_dir, params):
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_stamp(path: Path, params: dict[str, Any]) -> None:
    files = {
        f.name: f.stat().st_size for f in sorted(path.iterdir()) if f.is_file() and f.name != STAMP_NAME
    }
    stamp = {"format": FORMAT_VERSION, "params": params, "files": files}
    (path / STAMP_NAME).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")


def _write_model(path: Path, p: dict[str, Any], *, device: str) -> None:
    import torch
    import transformers

    tokenizer = _build_tokenizer(p["vocab_size"], p["max_position"])
    tokenizer.save_pretrained(path)
    _portable_tokenizer_config(path, tokenizer)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)

    config_cls_name, model_cls_name = ARCHITECTURES[p["arch"]]
    config_kwargs: dict[str, Any] = dict(
        vocab_size=p["vocab_size"],
        hidden_size=p["hidden_size"],
        intermediate_size=p["intermediate"],
        num_hidden_layers=p["layers"],
        num_attention_heads=p["heads"],
        num_key_value_heads=p["kv_heads"],
        max_position_embeddings=p["max_position"],
        tie_word_embeddings=p["tie_word_embeddings"],
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    if p["head_dim"] is not None:
        config_kwargs["head_dim"] = p["head_dim"]
    config = getattr(transformers, config_cls_name)(**config_kwargs)
    config.architectures = [model_cls_name]

    torch_dtype = getattr(torch, p["dtype"])
    torch.manual_seed(p["seed"])
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device(device):
            model = getattr(transformers, model_cls_name)(config)
    finally:
        torch.set_default_dtype(previous_dtype)
    model.eval()
    model.config.dtype = p["dtype"]

    gen = transformers.GenerationConfig(
        bos_token_id=None,
        eos_token_id=[eos_id, pad_id],
        pad_token_id=pad_id,
        do_sample=True,
        temperature=0.6,
        top_p=0.95,
        top_k=20,
    )
    model.generation_config = gen
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards" on stderr for a 1 MB file
    try:
        model.save_pretrained(path)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    del model


def _build_tokenizer(vocab_size: int, max_position: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on the built-in corpus, padded with filler words to exactly
    `vocab_size`, wrapped as a transformers fast tokenizer with the ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, 2048),
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)

    # Pad the BPE vocabulary with filler words up to vocab_size. They have no merges, so
    # encoding never yields them; decoding them gives readable text.
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    next_id = max(vocab.values()) + 1
    for word in _filler_words():
        if next_id >= vocab_size:
            break
        if word not in vocab:
            vocab[word] = next_id
            next_id += 1
    tok = Tokenizer.from_str(json.dumps(spec))
    if tok.get_vocab_size() != vocab_size:  # trained past the target (cannot happen with the cap above)
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab_size}")

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_position,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def _portable_tokenizer_config(path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    """Rewrite tokenizer_config.json in the shape both transformers 4.x and 5.x load:
    `PreTrainedTokenizerFast` (5.x writes `TokenizersBackend`, unknown to 4.x), the chat
    template inline (4.x before 4.5x does not read chat_template.jinja; 5.x reads either) and
    `additional_special_tokens` as a list (4.x wants `extra_special_tokens` to be a dict)."""
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("extra_special_tokens", None)
    cfg.pop("backend", None)
    cfg.update(
        tokenizer_class="PreTrainedTokenizerFast",
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        added_tokens_decoder={
            str(tokenizer.convert_tokens_to_ids(t)): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t in SPECIAL_TOKENS
        },
    )
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _filler_words() -> Iterator[str]:
    """" ba", " be", ... then two and three syllables: byte-level form ("Ġ" is the space)."""
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    syllables = [c + v for c in consonants for v in vowels]
    for n in (1, 2, 3, 4):
        for idx in range(len(syllables) ** n):
            parts = []
            for _ in range(n):
                idx, r = divmod(idx, len(syllables))
                parts.append(syllables[r])
            yield "Ġ" + "".join(parts)


_WORDS = (
    "the a an of to and in is it that for on with as was at by be this from or are not have "
    "model server request token batch node queue prompt answer result error retry health ready "
    "start stop run job data file path value key list time rate speed memory cache GPU CPU "
    "fast slow small large first last next every each one two three many some all none "
    "read write send load save build check test count wait return open close find make "
    "user system assistant question reason because when where which while then there here"
).split()

_CODE = '''def {name}(items, limit={n}):
    """Return the first {n} items that pass the check."""
    out = []
    for i, item in enumerate(items):
        if i >= limit:
            break
        if item is not None and item.{attr} > {n}:
            out.append(item)
    return out


class {cls}:
    def __init__(self, path: str, retries: int = {n}) -> None:
        self.path = path
        self.retries = retries

    async def {name}(self, client, payload: dict) -> dict:
        for attempt in range(self.retries):
            try:
                return await client.post(self.path, json=payload)
            except TimeoutError as exc:
                print(f"attempt {{attempt}} failed: {{exc}}")
        raise RuntimeError("gave up")
'''


def _corpus() -> list[str]:
    """~60 KB of deterministic English-ish prose, Python and JSON, generated here."""
    rng = random.Random(1234)
    texts: list[str] = []
    for _ in range(400):
        n = rng.randint(6, 18)
        sentence = " ".join(rng.choice(_WORDS) for _ in range(n))
        texts.append(sentence[0].upper() + sentence[1:] + rng.choice([".", ".", "?", "!"]))
    for i in range(40):
        name = rng.choice(["select", "fetch", "gather", "load_rows", "send_batch", "poll_health"])
        cls = rng.choice(["Client", "Runner", "Dispatcher", "ResultStore", "Server"])
        attr = rng.choice(["score", "size", "tokens", "latency"])
        texts.append(_CODE.format(name=name, cls=cls, attr=attr, n=rng.randint(1, 999)))
    for i in range(200):
        row = {
            "id": f"row-{i:06d}",
            "messages": [
                {"role": "user", "content": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 10)))},
            ],
            "max_tokens": rng.choice([32, 256, 4096]),
            "temperature": rng.choice([0.0, 0.6, 1.0]),
            "ok": rng.choice([True, False, None]),
        }
        texts.append(json.dumps(row))
    texts.append("0123456789 +-*/=<>()[]{}:;,.'\"`~!@#$%^&_|\\ \n\t")
    return texts
