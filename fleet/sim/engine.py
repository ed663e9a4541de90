"""The engine model, the simulated GPU: slots, token timing, counters, the scheduler's log.

A generation is decided in full on arrival (a ``Plan``); it holds one of
``--max-running-requests`` slots for ``completion_tokens / --tokens-per-s`` seconds, the rest
queue first come first served. Token counts at any moment are computed from the clock, so
nothing ticks per token. With ``--speculative-algorithm`` the engine reports an accept length.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import random
import time
from collections import deque

from fleet.sim.determinism import SALT_SPEC, unit
from fleet.sim.lockstep import Lockstep
from fleet.sim.log import Log

# Numbers printed in the startup log and /server_info, shaped like one H200 running an 8B model.
GPU_TOTAL_GB = 139.81
WEIGHTS_GB = 15.26
KV_BYTES_PER_TOKEN_HALF = 65536  # K (or V) bytes per token: 32 layers x 8 heads x 128 x bf16
GRAPH_GB = 0.93
DRAFT_WEIGHTS_GB = 0.92
GB = 1 << 30
CHUNKED_PREFILL = 8192
MAX_PREFILL = 16384
SPEC_NUM_STEPS = 3


class Plan:
    """One generation, decided in full when the request arrives."""

    __slots__ = ("rid", "prompt_tokens", "completion_tokens", "max_tokens", "key", "finish",
                 "duration", "t_decode", "t_arrive")

    def __init__(self, rid: int, prompt_tokens: int, completion_tokens: int, max_tokens: int,
                 key: int, tokens_per_s: float) -> None:
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.max_tokens = max_tokens
        self.key = key
        self.finish = "length" if completion_tokens >= max_tokens else "stop"
        self.duration = completion_tokens / tokens_per_s
        self.t_decode = 0.0
        self.t_arrive = time.monotonic()


class Engine:
    """Slots, counters and the periodic scheduler log: the simulated GPU."""

    def __init__(self, args: argparse.Namespace, log: Log) -> None:
        self.args = args
        self.log = log
        self.tps = float(args.tokens_per_s)
        self.ready = False
        self.free = int(args.max_running_requests)
        self.waiters: deque[asyncio.Future[None]] = deque()
        self.running: dict[int, Plan] = {}
        self.warm = False
        self.gen_counter = 0  # generation requests arrived (fault decisions key on it)
        self.burst_left = 0   # generation requests still to answer 500 (SIGUSR1 starts a burst)
        self.rid_counter = 0
        # metrics
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_total = 0
        self.finished_decode_tokens = 0  # decoded by finished or aborted requests
        # streamed answers (GET /sim/streams): how many, and how many were open at once
        self.streams_total = 0
        self.streams_now = 0
        self.streams_max = 0
        # generation requests received, by the max_tokens they asked for (GET /sim/requests): tells
        # one kind of request from another, e.g. a bring-up's smoke from a job's rows
        self.by_max_tokens: dict[int, int] = {}
        self.latency_buckets = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
        self.latency_counts = [0] * (len(self.latency_buckets) + 1)
        self.latency_sum = 0.0
        # interval stats for the scheduler log
        self.new_seqs = 0
        self.new_tokens = 0
        self.last_gen_throughput = 0.0
        self.spec_accept = 2.5 + unit(args.seed, SALT_SPEC) if args.speculative_algorithm else 0.0
        self.lockstep = Lockstep(int(args.max_running_requests), args.lockstep_rows) if args.lockstep_rows else None

    # -- slots ------------------------------------------------------------------------

    def try_admit(self) -> bool:
        if self.free > 0 and not self.waiters:
            self.free -= 1
            return True
        return False

    async def admit(self) -> None:
        if self.try_admit():
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was handed over just as the client went away
            else:
                try:
                    self.waiters.remove(fut)
                except ValueError:
                    pass
            raise

    def release(self) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.free += 1

    # -- requests ---------------------------------------------------------------------

    def next_rid(self) -> int:
        self.rid_counter += 1
        return self.rid_counter

    def start(self, plan: Plan) -> float:
        """A slot is held: the plan starts decoding. Returns the extra warm-up delay."""
        delay = 0.0
        if not self.warm:
            self.warm = True
            delay = float(self.args.first_request_delay_s)
        plan.t_decode = time.monotonic() + delay
        self.running[plan.rid] = plan
        self.new_seqs += 1
        self.new_tokens += plan.prompt_tokens
        self.prompt_tokens_total += plan.prompt_tokens
        return delay

    def progress(self, plan: Plan, now: float) -> int:
        done = (now - plan.t_decode) * self.tps
        if done <= 0:
            return 0
        return min(plan.completion_tokens, int(done))

    def finish(self, plan: Plan, completed: bool = True) -> None:
        if self.running.pop(plan.rid, None) is None:
            return
        now = time.monotonic()
        tokens = plan.completion_tokens if completed else self.progress(plan, now)
        self.finished_decode_tokens += tokens
        if completed:
            self.generation_tokens_total += tokens
            self.requests_total += 1
            latency = now - plan.t_arrive
            self.latency_sum += latency
            self.latency_counts[bisect.bisect_left(self.latency_buckets, latency)] += 1
        self.release()

    def used_tokens(self, now: float) -> int:
        return sum(p.prompt_tokens + self.progress(p, now) for p in self.running.values())

    def decoded_tokens(self, now: float) -> int:
        return self.finished_decode_tokens + sum(self.progress(p, now) for p in self.running.values())

    def accept_len(self) -> float:
        # a little wobble per log line, centred on the server's own accept length
        return self.spec_accept + (random.random() - 0.5) * 0.1

    async def scheduler_log(self) -> None:
        """``Prefill batch`` / ``Decode batch`` lines while there is work, like SGLang's scheduler."""
        interval = float(self.args.log_interval_s)
        last_t = time.monotonic()
        last_decoded = self.decoded_tokens(last_t)
        kv = self.args.kv_cache_tokens
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            decoded = self.decoded_tokens(now)
            self.last_gen_throughput = (decoded - last_decoded) / max(now - last_t, 1e-9)
            last_t, last_decoded = now, decoded
            queued = len(self.waiters)
            used = self.used_tokens(now)
            usage = min(used / kv, 1.0)
            if self.new_seqs:
                self.log.info(
                    f"Prefill batch. #new-seq: {self.new_seqs}, #new-token: {self.new_tokens}, "
                    f"#cached-token: 0, token usage: {usage:.2f}, "
                    f"#running-req: {len(self.running)}, #queue-req: {queued}, ",
                    tp=True,
                )
                self.new_seqs = self.new_tokens = 0
            if self.running or self.last_gen_throughput > 0:
                spec = f"accept len: {self.accept_len():.2f}, " if self.spec_accept else ""
                self.log.info(
                    f"Decode batch. #running-req: {len(self.running)}, #token: {used}, "
                    f"token usage: {usage:.2f}, {spec}cuda graph: True, "
                    f"gen throughput (token/s): {self.last_gen_throughput:.2f}, "
                    f"#queue-req: {queued}, ",
                    tp=True,
                )
