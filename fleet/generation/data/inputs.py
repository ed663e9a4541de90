"""Input rows for generation: stream JSONL (plain or gzip) or Parquet into `Request`s and `Reject`s.

One row per line (JSONL) or per table row (Parquet), in any of three shapes, chosen per row:

    OpenAI Batch   {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": [...], "max_tokens": 512, ...}}
    simple         {"id": "r1", "messages": [...], "temperature": 0.7}      # params at top level
                   {"id": "r1", "messages": [...], "params": {"tools": [...]}}  # or under "params"
    ShareGPT       {"id": "r1", "conversations": [{"from": "human", "value": "..."},
                                                  {"from": "gpt", "value": "..."}]}

Rules (each one documented here because it decides what ends up generated):

- **Params.** Batch rows: everything in `body` except `messages`. Simple rows: the keys under
  `params`, plus known sampling/tool keys at the top level (`rowshapes.KNOWN_PARAMS`); any other
  top-level key is the caller's metadata and is ignored. ShareGPT rows: `params`, and a
  top-level `tools` (list or JSON string, LLaMA-Factory style) and `system`. `model`,
  `stream` and `stream_options` are always dropped (the dispatcher sets them); `n` must be
  1 (one completion per id). A null value means "not given". Then the config defaults
  (`max_tokens`, `temperature`, `top_p`, `seed`, `stop`, `chat_template_kwargs`) fill what the
  row does not set; `chat_template_kwargs` merge key by key, the row winning;
  `max_completion_tokens` in a row replaces the default `max_tokens`.
- **ShareGPT.** A turn is `from`/`value` or `role`/`content` (both spellings in one turn must
  agree). `from` maps human/user -> user, gpt/assistant/model/chatgpt -> assistant,
  system -> system, tool/observation/function_response -> tool, and function_call -> an
  assistant message with `tool_calls` (value: JSON `{"name", "arguments"}` or a list of them).
  The text is a string or a list of content parts; every other key of a turn (`tool_calls`,
  `tool_call_id`, `name`, `reasoning_content`, a dataset's own) goes into the message as it is,
  as under `messages`: nothing of a turn is dropped. A tool turn without `tool_call_id` gets the
  next pending call's id.
  A trailing assistant turn is dropped: it is the answer being regenerated (with
  `generation.regenerate = "all-turns"` it is kept: every assistant turn is regenerated,
  see `fleet.generation.hotpath.work`, and the turn order is checked: the conversation may not open
  with an assistant turn nor hold two in a row).
- **Extra fields.** A row's other top-level keys (source, category, ...) are kept in
  `Request.extra` (the `extra` column), for exports that hand the input row back; for a ShareGPT
  row whose keys are not in the order "id", "conversations", the others, the order too
  (`rowshapes.KEY_ORDER`, stored in the `key_order` column): SpecForge keeps it.
- **Trainer rules.** `generation.input_rules = "specforge"` also rejects what SpecForge's
  conversation check refuses (`fleet.generation.data.trainerrules`: two user turns in a row, an
  empty user or system message, tool turns, content parts, ...), so no request is spent on a
  row the trainer would drop; the reason starts "SpecForge would refuse it:".
- **Limit.** `generation.limit = N` reads only the first N rows (blank lines not counted).
- **Ids.** `custom_id`, else `id` (a string, or an integer turned into its decimal string).
  A row without one gets `content_id(messages, row params)`: "h-" + the first 24 hex digits
  of the SHA-256 of the canonical JSON (sorted keys, no spaces, UTF-8) of the normalized
  messages and the row's *own* params (not the config defaults, so changing a default does
  not rename every row and break resume). Key order and input format do not change it.
- **Duplicates.** The first row with an id is the request; every later row with that id is
  a `Reject` "duplicate id (first at line N)". This holds even when the first row was
  itself rejected (the id stays taken) and even when the id is skipped as done: a duplicate
  is always reported, so nothing is dropped silently.
- **Rejects** (the job goes on): bad JSON or UTF-8, a row that is not an object, no/empty
  messages, a bad role, content of the wrong type, the last message from the assistant
  (nothing to generate), an id that is not a string/integer, a bad parameter type, an
  unsupported batch `url`/`method`. Each carries the 1-based line (JSONL, blank lines
  included in the numbering) or row number (Parquet) and the raw row (first 2,000 chars).
- **Blank lines** are skipped and counted (`InputStats.blank`), not rejected.
- **skip_ids** (resume): a request whose id it accepts is not yielded. Rejects are yielded on
  every pass (they are few and deterministic); `ResultStore.add_reject` ignores a line it
  already holds. Rows with an explicit id are checked before they are validated, so a done
  row is never validated again.
- **Planned resume.** When `skip_ids` is the store's done set (a `DigestSet`), a JSONL input is
  first *planned* (`resume.plan_resume`): one pass reads only each row's id into flat arrays, then
  duplicates and done ids are found in bulk (pyarrow compute); a second pass reads and validates only
  the planned lines. Same output, decided by the same rules; at 902,087 rows half done the
  plan is known in about a second of CPU instead of after the whole one-pass read.

Memory: ids seen so far are kept as 8-byte digests in an open-addressing table with the
first line of each (`_SeenIds`, about 24 MB per million ids), never as strings; a planned
resume holds 12 bytes per row (digest and line) plus pyarrow's sort scratch while it plans.

Where each part lives: `rows` (Request, Reject, InputStats, ids), `rowshapes` (the shapes, the
checks, the defaults), `sources` (the JSONL and Parquet readers and their errors), `resume`
(the planned resume); this module ties them into `iter_input`.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from fleet.generation.data.resume import digest_set, iter_planned, plan_resume
from fleet.generation.data.rows import DUPLICATE_REASON, Bad, InputStats, Reject, Request, content_id, digest, raw_text, type_name
from fleet.generation.data.rowshapes import apply_defaults, param_defaults, row_id, shape
from fleet.generation.data.sources import is_parquet, jsonl_rows, parquet_rows

if TYPE_CHECKING:
    from fleet.config import GenerationConfig

__all__ = ["iter_input"]


class _SeenIds:
    """Ids seen so far -> the first line of each: open addressing over two flat arrays.

    About 24 bytes per id at the 50 % load ceiling (8-byte digest + 4-byte line, table
    doubled), against ~70 bytes per id for a Python set of ints and ~120 for a dict.
    """

    __slots__ = ("_keys", "_lines", "_mask", "_n")

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._keys = array("Q", bytes(8 * capacity))
        self._lines = array("I", bytes(4 * capacity))
        self._mask = capacity - 1
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def first_line(self, d: int, line: int) -> int:
        """Record digest `d` at `line` if new (returns 0), else return the line it was first seen at."""
        d = d or 1  # 0 marks an empty slot
        keys, mask = self._keys, self._mask
        i = d & mask
        while True:
            k = keys[i]
            if k == d:
                return self._lines[i]
            if k == 0:
                keys[i] = d
                self._lines[i] = line
                self._n += 1
                if self._n * 2 > mask:
                    self._grow()
                return 0
            i = (i + 1) & mask

    def _grow(self) -> None:
        old_keys, old_lines = self._keys, self._lines
        cap = (self._mask + 1) * 2
        keys = array("Q", bytes(8 * cap))
        lines = array("I", bytes(4 * cap))
        mask = cap - 1
        for k, ln in zip(old_keys, old_lines):
            if k:
                i = k & mask
                while keys[i]:
                    i = (i + 1) & mask
                keys[i] = k
                lines[i] = ln
        self._keys, self._lines, self._mask = keys, lines, mask


def iter_input(
    path: str | Path,
    defaults: GenerationConfig | None,
    *,
    skip_ids: Callable[[str], bool] | None = None,
    stats: InputStats | None = None,
    plan: bool = True,
) -> Iterator[Request | Reject]:
    """Stream `path` (JSONL, JSONL.gz or Parquet) as Requests and Rejects, in input order.

    Never holds more than one Parquet batch or one line of text; see the module docstring for
    every rule. `stats`, when given, is filled in as the rows go by.

    A resume of a JSONL input whose `skip_ids` is a non-empty `DigestSet`'s `__contains__` (the
    store's `done_ids()`) is planned first (`plan_resume`: the ids only, then the planned lines
    are read again and validated); `plan=False` keeps the one-pass reader. Both yield the same.
    """
    path = Path(path)
    st = stats if stats is not None else InputStats()
    done = digest_set(skip_ids)
    if plan and done is not None and len(done) and not is_parquet(path):
        yield from iter_planned(path, defaults, plan_resume(path, defaults, done), st)
        return
    dflt = param_defaults(defaults)
    all_turns = defaults is not None and defaults.regenerate == "all-turns"
    rules = defaults.input_rules if defaults is not None else "openai"
    limit = defaults.limit if defaults is not None else None
    seen = _SeenIds()
    rows = parquet_rows(path, st) if is_parquet(path) else jsonl_rows(path, st)  # InputError: no such file, a directory
    for line, obj, raw in rows:
        if limit is not None and st.rows >= limit:
            break
        st.rows += 1
        rid: str | None = None
        try:
            if isinstance(obj, Bad):
                raise obj
            if not isinstance(obj, dict):
                raise Bad(f"row is not a JSON object (got {type_name(obj)})")
            rid = row_id(obj, ("custom_id", "id"))
            if rid is not None:
                first = seen.first_line(digest(rid), line)
                if first:
                    st.duplicates += 1
                    raise Bad(f"{DUPLICATE_REASON} (first at line {first})")
                if skip_ids is not None and skip_ids(rid):
                    st.skipped += 1
                    continue
            msgs, own, extra = shape(obj, all_turns, rules)
            if rid is None:
                rid = content_id(msgs, own)
                first = seen.first_line(digest(rid), line)
                if first:
                    st.duplicates += 1
                    raise Bad(f"{DUPLICATE_REASON} (first at line {first})")
                if skip_ids is not None and skip_ids(rid):
                    st.skipped += 1
                    continue
        except Bad as bad:
            st.rejects += 1
            yield Reject(line=line, id=rid, reason=str(bad.args[0]), raw=raw_text(raw if raw is not None else obj))
            continue
        except RecursionError:
            st.rejects += 1
            yield Reject(line=line, id=rid, reason="row nested too deeply", raw=raw_text(raw if raw is not None else obj))
            continue
        st.requests += 1
        yield Request(id=rid, line=line, messages=msgs, params=apply_defaults(dflt, own), extra=extra)

