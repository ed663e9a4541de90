"""What the dispatcher knows of one server: where it is (`Endpoint`), its state and counters
(`ServerState`), and its recent speed (`Rate`, `Timeline`, the row-time estimate).

`fleet.generation.hotpath.health` changes a server's state; the dispatcher's workers count its rows.
`ServerState.snapshot` is the server's line in progress.json and the manifest.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from fleet.generation.hotpath.rowqueue import Job

__all__ = ["Endpoint", "Rate", "ServerState", "Timeline", "median", "quantile"]


@dataclass
class Endpoint:
    """One server as the dispatcher sees it."""

    name: str                              # "node/index", shown in tables and stored per row
    url: str                               # base URL, e.g. http://127.0.0.1:30000
    model: str                             # the "model" field requests carry
    api_key: str | None = None
    max_running_requests: int | None = None  # fallback when /server_info does not say
    max_in_flight: int | None = None       # the concurrency, whatever the server says (an endpoint's own setting)
    gpus: int = 1                          # GPUs the server uses (for GPU-hour cost)
    stream: bool = False                   # stream answers: each chunk is progress (engines without token counters)
    # ... but only this many of its rows in flight at a time, the rest answered whole, and none
    # once its rows finish quickly (ServerHealth.rows_show_progress): on `transformers serve` streaming
    # all 64 rows cost the engine 25-30 % of its tok/s (bench/RESULTS.md, issue 27); while any row
    # decodes, these do too, so their chunks say as much as all of them would
    streamed_rows: int = 2
    extra: dict[str, Any] = field(default_factory=dict)  # the caller's own data (launch spec, ...)


def quantile(values: Iterable[float], q: float) -> float:
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def median(values: Iterable[float]) -> float:
    return quantile(values, 0.5)


class Rate:
    """Tokens per second over a sliding window, sampled when asked."""

    __slots__ = ("window_s", "samples")

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self.samples: collections.deque[tuple[float, int]] = collections.deque()

    def update(self, now: float, total: int) -> float:
        self.samples.append((now, total))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()
        t0, v0 = self.samples[0]
        return (total - v0) / (now - t0) if now - t0 > 0.5 else 0.0


class Timeline:
    """Per server, over the whole job, in bounded memory: (elapsed s, rows in flight, rows
    completed, completion tokens) every `every_s`; when `cap` samples are kept, every other one
    is dropped and the interval doubles, so a two-day job keeps ~cap evenly spaced points."""

    __slots__ = ("every_s", "cap", "points", "_next")

    def __init__(self, every_s: float = 2.0, cap: int = 240) -> None:
        self.every_s, self.cap = every_s, cap
        self.points: list[tuple[float, int, int, int]] = []
        self._next = 0.0

    def sample(self, t: float, in_flight: int, completed: int, tokens: int, force: bool = False) -> None:
        if t < self._next and not force:
            return
        self.points.append((round(t, 1), in_flight, completed, tokens))
        if len(self.points) >= self.cap:
            self.points = self.points[::2]
            self.every_s *= 2
        self._next = t + self.every_s

    def rows(self) -> list[list[float | int]]:
        return [list(p) for p in self.points]


class ServerState:
    """Runtime state of one server."""

    def __init__(self, ep: Endpoint) -> None:
        self.ep = ep
        self.name = ep.name
        self.state = "starting"          # starting | up | down | recovering
        self.down_reason: str | None = None
        self.down_since: float | None = None
        self.session: aiohttp.ClientSession | None = None
        self.workers: list[asyncio.Task[None]] = []
        self.concurrency = 0
        self.in_flight = 0
        self.conn_streak = 0             # consecutive connection failures / timeouts
        self.err_streak = 0              # consecutive 5xx answers
        self.bad_streak = 0              # consecutive invalid answers (not a chat completion, over the size cap)
        self.invalid = 0                 # invalid answers in all
        self.answer_probing = False      # an answer probe (after an invalid answer) is running
        self.garbled = False             # taken out for invalid answers: re-admitted only after a valid one
        self.refusing = False            # taken out for 4xx answers others did not give: back once it answers one
        self.suspects: list[Job] = []   # rows that failed to connect; charged only if the server is fine
        self.probe: asyncio.Task[None] | None = None
        self.recovery: asyncio.Task[None] | None = None
        self.restarts = 0                # relaunched by the runner (health.READMITTED is not one)
        self.readmissions = 0            # taken back without a restart (one fleet did not start, or recovered)
        self.downs = 0
        self.info: dict[str, Any] = {}
        self.accept_len: float | None = None
        self.stats_missing: set[str] = set()   # stats paths it answered 404: not asked again (probes.accept_len)
        # counters
        self.requests = 0                # completed rows
        self.failures = 0                # failed attempts of any kind
        self.permanent = 0               # rows sent to errors from this server
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.latency_sum = 0.0
        self.lat: float | None = None    # recent typical row time: median of `lats`
        self.lats: collections.deque[float] = collections.deque(maxlen=64)  # recent completed row times
        self.lat_at = 0.0                # monotonic time `lat` was last refreshed
        self.rate = Rate()
        self.tok_s = 0.0
        # the watchdog: a server with rows in flight and no progress for stall_s is probed
        self.epoch = 0                   # bumped at every admission: a worker of an older epoch stops
        self.last_done = 0.0             # monotonic: last row completed (or the moment it became busy)
        # monotonic: it last generated, since it was (re)admitted: an answer, a streamed chunk, or its
        # token total moving from a first reading (a first reading is a baseline, not progress; a
        # relaunched engine on the same port has generated nothing yet) — served_s, a bring-up's proof
        self.generated_at = 0.0
        self.probing = False             # a stall probe is running
        self.stalls = 0                  # stall probes sent
        # token progress (health.ServerHealth.read_progress): where it comes from, "metrics"
        # (the engine's counters), "stream" (streamed answers' chunks) or "rows" (none: finished
        # rows are the only sign); None: not known yet
        self.progress: str | None = None
        self.tokens: float | None = None    # the engine's token total at the last reading
        self.tokens_at = 0.0             # monotonic: when that total last moved
        self.read_at = 0.0               # monotonic: last reading of it
        # generated tokens (fleet.generation.hotpath.tokens): the engine's own counter, where it has one
        self.gen_live = False            # its /metrics count generated tokens as it decodes
        self.gen_read: float | None = None  # that counter at the last reading (None: a baseline is next)
        self.gen_counted = 0.0           # what it rose by over this run's readings
        self.generated = 0.0             # tokens it generated in this run, rows in flight included
        self.suspect_since: float | None = None  # monotonic: no progress for stall_s, until the probe decides
        self.sent = 0                    # requests sent (tests compare it with what reached the server)
        self.held_s = 0.0                # worker-seconds held back by the tail rule
        self.refreshes = 0               # rows given to a held server to refresh a stale estimate
        self.timeline = Timeline()
        self.streaming = 0               # rows in flight sent streamed (at most ep.streamed_rows)
        # 4xx refusals, judged against the other servers (dispatch._refused): rows it refused that no
        # other server has judged yet, and rows it refused that another server then answered
        self.pending: set[str] = set()
        self.overruled = 0               # in a row (its own ok answer resets it): at down_after_4xx it is out
        self.refusals = 0                # 4xx answers in all
        self.refused_sample: Any = None  # a request it refused: its re-admission probe (health.recover)
        # rate limits (429, 503 + Retry-After): nothing new before paused_until; at most `limit` in flight,
        # halved at each limit and grown back by one per `limit` answers (AIMD)
        self.paused_until = 0.0          # monotonic
        self.limit = 0                   # 0: not limited (the concurrency)
        self.grow = 0                    # answers since the limit last grew
        self.limited_since: float | None = None   # monotonic: first rate limit with no answer since
        self.limited_streak = 0          # rate limits in a row (no Retry-After: 1 s, doubling)
        self.rate_limits = 0             # rate limits in all
        self.reserved = 0                # workers past the gate, not yet sending (dispatch._gate)
        self.gate = asyncio.Event()      # set when a slot frees or a pause ends

    def chunk(self) -> None:
        """A streamed answer's event arrived: token progress (`Endpoint.stream`)."""
        self.tokens_at = self.generated_at = time.monotonic()
        self.suspect_since = None

    @property
    def under_suspicion(self) -> bool:
        """Rows in flight and no progress for stall_s: its generation probe is deciding now.
        (Rows held here may be sent elsewhere meanwhile; cleared by progress, a passed probe,
        or the server going down.)"""
        return self.suspect_since is not None and self.state == "up"

    def quiet_s(self, now: float) -> float:
        """Seconds since the last sign of progress: a token counted, a row finished, or the
        server became busy (`last_done` is set then)."""
        return now - max(self.tokens_at, self.last_done)

    def alive_in(self, epoch: int) -> bool:
        """May a worker of `epoch` still send rows here? (Checked before and after every request:
        a cancellation can be lost when it races aiohttp's own timeout, this cannot.)"""
        return self.state == "up" and self.epoch == epoch

    def snapshot(self, now: float) -> dict[str, Any]:
        # generated, not only answered: a server decoding rows of minutes shows its rate at once
        self.tok_s = self.rate.update(now, round(self.generated))
        return {
            "name": self.name, "url": self.ep.url, "state": self.state, "down_reason": self.down_reason,
            "concurrency": self.concurrency, "in_flight": self.in_flight, "requests": self.requests,
            "failures": self.failures, "errors": self.permanent, "invalid": self.invalid,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "generated_tokens": round(self.generated), "tok_s": round(self.tok_s, 1),
            "avg_latency_s": round(self.latency_sum / self.requests, 3) if self.requests else None,
            "accept_len": self.accept_len, "downs": self.downs, "restarts": self.restarts,
            "readmissions": self.readmissions,
            "stalls": self.stalls, "sent": self.sent, "refusals": self.refusals, "rate_limits": self.rate_limits,
            "limit": self.limit or None, "held_s": round(self.held_s, 1),
            "refreshes": self.refreshes, "lat_s": round(self.lat, 3) if self.lat is not None else None,
            "idle_s": round(now - self.last_done, 1) if self.in_flight and self.last_done else None,
            "progress": self.progress, "quiet_s": round(self.quiet_s(now), 1) if self.in_flight else None,
            "suspect": self.under_suspicion,
            # seconds since it last generated: a token counted or an answer given (not the moment it
            # became busy, which `quiet_s` counts too): a bring-up's proof that it serves (fleet.jobs)
            "served_s": round(now - self.generated_at, 1) if self.generated_at > 0 else None,
            "timeline": self.timeline.rows(),
        }
