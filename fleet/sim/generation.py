"""The generation endpoints: /v1/chat/completions, /v1/completions and /generate.

Each request is validated as SGLang validates it (same status codes, same wording), then
planned (``fleet.sim.engine.Plan``: how many tokens, which words, all from hashes), then held
on a slot for its decode time and answered whole or streamed as server-sent events.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
import zlib
from collections.abc import Callable, Coroutine
from typing import Any

from fleet.sim import faults
from fleet.sim.determinism import SALT_ID, SALT_LEN, SALT_TEXT, digest, hash_ints, words_for
from fleet.sim.engine import Engine, Plan
from fleet.sim.http_front import Answer, HttpConnection, Request, Resp, error_resp, json_resp
from fleet.sim.log import Log

_FAST_S = 0.0005  # generations shorter than this are answered without a timer
_STREAM_CHUNK_S = 0.02  # a streamed response sends one chunk per this much decode time


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _text_of(content: Any) -> str:
    """The text of an OpenAI message content: a string or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out: list[str] = []
        for part in content:
            if isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str):
                    out.append(text)
            elif isinstance(part, str):
                out.append(part)
        return "".join(out)
    return str(content)


def _prompt_tokens_of_text(text: str) -> int:
    return len(text) // 4 + 1


_VOCAB = 500   # ids fit the smallest tiny model (fleet.tinymodel: vocab_size >= 512)


def _token_id(piece: str) -> int:
    return zlib.crc32(piece.encode("utf-8", "surrogatepass")) % _VOCAB


def prompt_token_ids(messages: list[Any]) -> list[int]:
    """The sim's rendering of a prompt as token ids (return_token_ids): one id per 4 characters
    of each message's text, as many as its prompt-token count."""
    ids: list[int] = []
    for m in messages:
        text = _text_of(m.get("content"))
        ids.extend(_token_id(text[4 * i: 4 * i + 4]) for i in range(_prompt_tokens_of_text(text)))
    return ids


def lognormal_length(spec: str, h: int, max_tokens: int) -> int:
    """A completion length from a 64-bit hash: lognormal around MEDIAN (``lognormal:MEDIAN:SIGMA``,
    Box-Muller on the hash's two halves), within 1..max_tokens."""
    _, median, sigma = spec.split(":")
    u1 = ((h & 0xFFFFFFFF) + 0.5) / 2.0**32
    u2 = ((h >> 32 & 0xFFFFFFFF) + 0.5) / 2.0**32
    z = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
    return max(1, min(max_tokens, int(float(median) * math.exp(float(sigma) * z))))


class _Reject(Exception):
    """Raised while validating a request; carries the response to send."""

    def __init__(self, resp: Resp) -> None:
        super().__init__(resp.status)
        self.resp = resp


class Generation:
    """The generation routes of ``fleet.sim.app.App``: validation, planning, answering."""

    def __init__(self, args: argparse.Namespace, log: Log, engine: Engine) -> None:
        self.args = args
        self.log = log
        self.engine = engine
        self.models = {args.model_name, args.model_path, "default"}

    # -- generation: shared steps -------------------------------------------------------

    def _arrive(self) -> int:
        """Count a generation request; --crash-after dies here, on arrival of request N."""
        e = self.engine
        e.gen_counter += 1
        n = e.gen_counter
        if self.args.crash_after is not None and n >= self.args.crash_after:
            faults.crash(self.log, n)
        return n

    def _body(self, req: Request) -> dict[str, Any]:
        try:
            body = json.loads(req.body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _Reject(error_resp(400, f"Invalid JSON body: {exc}", "BadRequestError")) from None
        if not isinstance(body, dict):
            raise _Reject(error_resp(400, "The request body must be a JSON object.", "BadRequestError"))
        return body

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model not in self.models:
            raise _Reject(error_resp(404, f"The model `{model}` does not exist.", "NotFoundError"))

    def _max_tokens(self, value: object, prompt_tokens: int, generate: bool = False) -> int:
        """SGLang's context check (tokenizer_manager._validate_one_request), same wording."""
        ctx: int = self.args.context_length

        def reject(message: str) -> _Reject:
            if generate:
                return _Reject(json_resp(400, {"error": {"message": message}}))
            return _Reject(error_resp(400, message, "BadRequestError"))

        if prompt_tokens >= ctx:
            raise reject(f"The input ({prompt_tokens} tokens) is longer than the model's "
                         f"context length ({ctx} tokens).")
        if value is None:
            default: int = self.args.max_output_tokens_default
            return max(0, min(default, ctx - prompt_tokens - 1))
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise reject(f"max_tokens must be a non-negative integer, got {value!r}.")
        if value + prompt_tokens >= ctx:
            raise reject(
                f"Requested token count exceeds the model's maximum context length of {ctx} "
                f"tokens. You requested a total of {value + prompt_tokens} tokens: "
                f"{prompt_tokens} tokens from the input messages and {value} tokens for the "
                f"completion. Please reduce the number of tokens in the input messages or the "
                f"completion to fit within the limit."
            )
        return value

    def _plan(self, key: int, prompt_tokens: int, max_tokens: int, body_seed: Any, ignore_eos: bool) -> Plan:
        seed = self.args.seed
        self.engine.by_max_tokens[max_tokens] = self.engine.by_max_tokens.get(max_tokens, 0) + 1
        if isinstance(body_seed, int) and not isinstance(body_seed, bool):
            key = hash_ints(key, body_seed)
        if ignore_eos or max_tokens == 0:
            n = max_tokens
        elif self.args.lengths != "uniform":
            n = lognormal_length(self.args.lengths, hash_ints(seed, SALT_LEN, key), max_tokens)
        else:
            h = hash_ints(seed, SALT_LEN, key)
            # one in eight runs into the limit; the rest stop somewhere in 1..max_tokens
            n = max_tokens if h % 8 == 0 else 1 + (h >> 3) % max_tokens
        return Plan(self.engine.next_rid(), prompt_tokens, n, max_tokens, hash_ints(seed, SALT_TEXT, key),
                    self.engine.tps)

    def _id(self, prefix: str, plan: Plan) -> str:
        return f"{prefix}{hash_ints(self.args.seed, SALT_ID, plan.rid, plan.key):016x}"

    def _run(self, plan: Plan, build: Callable[[], Resp]) -> Answer:
        """Hold a slot for the plan's duration, then ``build()`` the response.

        Instant generations with a free slot are answered synchronously (no task, no timer):
        that is what lets one core serve thousands of requests per second.
        """
        e = self.engine
        if e.try_admit():
            delay = e.start(plan)
            wait = plan.duration + delay
            if wait <= _FAST_S:
                e.finish(plan)
                return build()
            return self._run_admitted(plan, wait, build)
        return self._run_queued(plan, build)

    async def _run_lockstep(self, conn: HttpConnection, build: Callable[[], Resp]) -> Resp:
        """--lockstep-rows: answered when it is its turn (fleet.sim.lockstep), not after a decode time."""
        assert self.engine.lockstep is not None
        await self.engine.lockstep.hold(conn)
        return build()

    async def _run_admitted(self, plan: Plan, wait: float, build: Callable[[], Resp]) -> Resp:
        e = self.engine
        done = False
        try:
            await asyncio.sleep(wait)
            done = True
        finally:
            e.finish(plan, completed=done)
        return build()

    async def _run_queued(self, plan: Plan, build: Callable[[], Resp]) -> Resp:
        e = self.engine
        await e.admit()
        delay = e.start(plan)
        return await self._run_admitted(plan, plan.duration + delay, build)

    async def _stream(self, req: Request, conn: HttpConnection, plan: Plan,
                      chunks: Callable[[list[str], int], bytes], first: bytes,
                      last: bytes | Callable[[], bytes]) -> None:
        """Hold a slot and write SSE events: ``first``, one per token group, ``last``."""
        e = self.engine
        e.streams_total += 1
        e.streams_now += 1
        e.streams_max = max(e.streams_max, e.streams_now)
        try:
            await self._stream_admitted(req, conn, plan, chunks, first, last)
        finally:
            e.streams_now -= 1

    async def _stream_admitted(self, req: Request, conn: HttpConnection, plan: Plan,
                               chunks: Callable[[list[str], int], bytes], first: bytes,
                               last: bytes | Callable[[], bytes]) -> None:
        e = self.engine
        if not e.try_admit():
            await e.admit()
        delay = e.start(plan)
        done = False
        try:
            if delay:
                await asyncio.sleep(delay)
            conn.stream_start(req)
            if first:
                conn.stream_write(first)
            per = max(1, int(e.tps * _STREAM_CHUNK_S))
            words = words_for(plan.key, plan.completion_tokens)
            sent = 0
            for i in range(0, len(words), per):
                group = words[i : i + per]
                await asyncio.sleep(len(group) / e.tps)
                conn.stream_write(chunks(group, sent))
                sent += len(group)
            done = True
        finally:
            e.finish(plan, completed=done)
        conn.stream_write(last() if callable(last) else last)
        conn.stream_end()
        return None

    @staticmethod
    def _usage(plan: Plan) -> dict[str, int]:
        return {"prompt_tokens": plan.prompt_tokens, "completion_tokens": plan.completion_tokens,
                "total_tokens": plan.prompt_tokens + plan.completion_tokens}

    # -- /v1/chat/completions -----------------------------------------------------------

    def chat(self, req: Request, conn: HttpConnection) -> Answer:
        if not self.engine.ready:
            return error_resp(503, "The server is not ready yet.", "ServiceUnavailableError")
        n = self._arrive()
        try:
            body = self._body(req)
            self._check_model(body)
            messages, prompt_tokens = self._chat_messages(body)
            mt = body.get("max_completion_tokens")
            if mt is None:
                mt = body.get("max_tokens")
            max_tokens = self._max_tokens(mt, prompt_tokens)
        except _Reject as r:
            return r.resp
        fault = faults.injected(self.args, self.engine, n)
        if fault is not None:
            return fault
        plan = self._plan(digest(messages), prompt_tokens, max_tokens, body.get("seed"),
                          bool(body.get("ignore_eos")))
        model = body.get("model") or self.args.model_name
        kwargs = body.get("chat_template_kwargs")
        thinking = isinstance(kwargs, dict) and bool(kwargs.get("enable_thinking"))
        n_reason = plan.completion_tokens // 3 if thinking and plan.completion_tokens >= 2 else 0
        cid = self._id("chatcmpl-", plan)
        created = int(time.time())
        if body.get("stream"):
            return self._chat_stream(req, conn, body, plan, cid, created, model, n_reason)
        ids = prompt_token_ids(messages) if body.get("return_token_ids") is True else None
        if self.engine.lockstep is not None:
            return self._run_lockstep(conn, lambda: self._chat_answer(plan, cid, created, model, n_reason, thinking,
                                                                      ids))
        return self._run(plan, lambda: self._chat_answer(plan, cid, created, model, n_reason, thinking, ids))

    @staticmethod
    def _chat_messages(body: dict[str, Any]) -> tuple[list[Any], int]:
        """The request's messages and their prompt tokens; rejects what SGLang rejects."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _Reject(error_resp(400, "messages: a non-empty list is required.", "BadRequestError"))
        prompt_tokens = 0
        for m in messages:
            if not isinstance(m, dict):
                raise _Reject(error_resp(400, "messages: each message must be an object.", "BadRequestError"))
            prompt_tokens += _prompt_tokens_of_text(_text_of(m.get("content")))
        return messages, prompt_tokens

    def _chat_stream(self, req: Request, conn: HttpConnection, body: dict[str, Any], plan: Plan, cid: str,
                     created: int, model: Any, n_reason: int) -> Coroutine[Any, Any, None]:
        opts = body.get("stream_options")
        include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            return _sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                         "model": model, "choices": [{"index": 0, "delta": delta,
                         "logprobs": None, "finish_reason": finish}]})

        def chunks(group: list[str], sent: int) -> bytes:
            out = []
            reason_part = group[: max(0, n_reason - sent)]
            content_part = group[len(reason_part):]
            if reason_part:
                text = " ".join(reason_part)
                out.append(chunk({"reasoning_content": text if sent == 0 else " " + text}))
            if content_part:
                text = " ".join(content_part)
                first_content = sent + len(reason_part) == n_reason
                out.append(chunk({"content": text if first_content else " " + text}))
            return b"".join(out)

        last = chunk({}, plan.finish)
        if include_usage:
            last += _sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                          "model": model, "choices": [], "usage": self._usage(plan)})
        last += b"data: [DONE]\n\n"
        first = chunk({"role": "assistant", "content": ""})
        return self._stream(req, conn, plan, chunks, first, last)

    def _chat_answer(self, plan: Plan, cid: str, created: int, model: Any, n_reason: int,
                     thinking: bool, prompt_ids: list[int] | None = None) -> Resp:
        """The chat.completion; with `prompt_ids` (the request asked return_token_ids) also vLLM's
        `prompt_token_ids` and the choice's `token_ids`: one id per word generated, as sampled."""
        words = words_for(plan.key, plan.completion_tokens)
        content = " ".join(words[n_reason:])
        reasoning = " ".join(words[:n_reason]) if thinking else None
        content, reasoning = faults.spoil(self.args, plan.key, words, n_reason, content, reasoning)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        message["tool_calls"] = None
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None,
                                  "finish_reason": plan.finish, "matched_stop": None}
        doc: dict[str, Any] = {"id": cid, "object": "chat.completion", "created": created, "model": model,
                               "choices": [choice], "usage": self._usage(plan)}
        if prompt_ids is not None:
            choice["token_ids"] = [_token_id(w) for w in words]
            doc["prompt_token_ids"] = prompt_ids
        return json_resp(200, doc)

    # -- /v1/completions ----------------------------------------------------------------

    def completions(self, req: Request, conn: HttpConnection) -> Answer:
        if not self.engine.ready:
            return error_resp(503, "The server is not ready yet.", "ServiceUnavailableError")
        n = self._arrive()
        try:
            body = self._body(req)
            self._check_model(body)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, str):
                prompt_tokens = _prompt_tokens_of_text(prompt)
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                prompt_tokens = len(prompt)
            else:
                raise _Reject(error_resp(400, "prompt: a string or a list of token ids is required.",
                                         "BadRequestError"))
            max_tokens = self._max_tokens(body.get("max_tokens"), prompt_tokens)
        except _Reject as r:
            return r.resp
        fault = faults.injected(self.args, self.engine, n)
        if fault is not None:
            return fault
        plan = self._plan(digest(prompt), prompt_tokens, max_tokens, body.get("seed"),
                          bool(body.get("ignore_eos")))
        model = body.get("model") or self.args.model_name
        cid = self._id("cmpl-", plan)
        created = int(time.time())

        if body.get("stream"):
            opts = body.get("stream_options")
            include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))

            def chunk(text: str, finish: str | None = None) -> bytes:
                return _sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                             "choices": [{"index": 0, "text": text, "logprobs": None,
                                          "finish_reason": finish}]})

            def chunks(group: list[str], sent: int) -> bytes:
                text = " ".join(group)
                return chunk(text if sent == 0 else " " + text)

            last = chunk("", plan.finish)
            if include_usage:
                last += _sse({"id": cid, "object": "text_completion", "created": created,
                              "model": model, "choices": [], "usage": self._usage(plan)})
            last += b"data: [DONE]\n\n"
            return self._stream(req, conn, plan, chunks, b"", last)

        def build() -> Resp:
            text = " ".join(words_for(plan.key, plan.completion_tokens))
            return json_resp(200, {
                "id": cid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": plan.finish, "matched_stop": None}],
                "usage": self._usage(plan),
            })

        return self._run(plan, build)

    # -- /generate (SGLang native) ------------------------------------------------------

    def generate(self, req: Request, conn: HttpConnection) -> Answer:
        if not self.engine.ready:
            return json_resp(503, {"error": {"message": "The server is not ready yet."}})
        n = self._arrive()
        try:
            try:
                body = json.loads(req.body)
            except (ValueError, UnicodeDecodeError) as exc:
                raise _Reject(json_resp(400, {"error": {"message": f"Invalid JSON body: {exc}"}})) from None
            if not isinstance(body, dict):
                raise _Reject(json_resp(400, {"error": {"message": "The request body must be a JSON object."}}))
            text, ids = body.get("text"), body.get("input_ids")
            key_src: str | list[int]
            if isinstance(text, str):
                prompt_tokens, key_src = _prompt_tokens_of_text(text), text
            elif isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
                prompt_tokens, key_src = len(ids), ids
            else:
                raise _Reject(json_resp(400, {"error": {"message":
                    "Either text (a string) or input_ids (a list of ints) is required; "
                    "batched /generate is not simulated."}}))
            sp = body.get("sampling_params") or {}
            if not isinstance(sp, dict):
                raise _Reject(json_resp(400, {"error": {"message": "sampling_params must be an object."}}))
            max_tokens = self._max_tokens(sp.get("max_new_tokens"), prompt_tokens, generate=True)
        except _Reject as r:
            return r.resp
        fault = faults.injected(self.args, self.engine, n)
        if fault is not None:
            if isinstance(fault, Resp):
                return json_resp(500, {"error": {"message": "Internal server error (simulated by --error-rate)."}})
            return fault
        plan = self._plan(digest(key_src), prompt_tokens, max_tokens, sp.get("sampling_seed"),
                          bool(sp.get("ignore_eos")))
        rid = self._id("", plan)

        def meta(completion_tokens: int, finished: bool) -> dict[str, Any]:
            if not finished:
                reason = None
            elif plan.finish == "length":
                reason = {"type": "length", "length": plan.max_tokens}
            else:
                reason = {"type": "stop", "matched": 151645}
            return {"id": rid, "finish_reason": reason, "prompt_tokens": plan.prompt_tokens,
                    "completion_tokens": completion_tokens, "cached_tokens": 0,
                    "e2e_latency": round(time.monotonic() - plan.t_arrive, 6)}

        if body.get("stream"):
            acc: list[str] = []

            def chunks(group: list[str], sent: int) -> bytes:
                acc.extend(group)
                return _sse({"text": " ".join(acc), "meta_info": meta(len(acc), False)})

            def last() -> bytes:  # the final event repeats the full text, with the finish reason
                return (_sse({"text": " ".join(acc), "meta_info": meta(len(acc), True)})
                        + b"data: [DONE]\n\n")

            return self._stream(req, conn, plan, chunks, b"", last)

        def build() -> Resp:
            text = " ".join(words_for(plan.key, plan.completion_tokens))
            return json_resp(200, {"text": text, "meta_info": meta(plan.completion_tokens, True)})

        return self._run(plan, build)
