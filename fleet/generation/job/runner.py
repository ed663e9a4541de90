"""The generation runner: the data-plane process that pushes one job through the servers.

    python -m fleet.generation.job.runner --job JOB.json

It runs next to the servers (on the GPU node), started detached like them, so it keeps
going when the controlling flow or the SSH connection dies. It owns the output directory
(the store's lock), skips ids already done, streams the rest of the input through the
`Dispatcher`, commits shards every `generation.commit_every_s` (10 s), and rewrites `<out>/progress.json`
every `progress_interval_s` for whoever watches (the flow's task, `fleet status`, a human
with `cat`). SIGTERM/SIGINT: stop taking rows, let the in-flight ones finish (bounded by
`stop_grace_s`), commit, write the manifest, exit 0. SIGKILL is the crash case: whatever
was committed stays, resume sends the rest again.

JOB.json (`JobSpec`):

    {
      "config": {...},                 # FleetConfig as a dict (servers.api_key left out)
      "input": "/data/prompts.jsonl",
      "output": "/data/out",
      "servers": [                     # one per server, see `ServerEntry`
        {"node": "gpu1", "index": 0, "url": "http://127.0.0.1:30000", "model": "qwen",
         "api_key_env": "FLEET_API_KEY", "gpus": [0], "max_running_requests": 64,
         "spec": {...ServerSpec fields but api_key...}},     # spec: only to relaunch it
        {"node": "endpoint", "index": 0, "label": "endpoint/router",   # an [[endpoints]] entry:
         "url": "http://10.0.0.5:30000", "model": "",                   # no spec, never relaunched;
         "api_key_env": "ENDPOINT_API_KEY_0", "max_in_flight": 512,     # model "": /v1/models' first
         "engine": "openai"}                                            # engine: its progress signal
      ],
      "retry_errors": false,
      "relaunch": true,                # relaunch a dead server with its spec (else: wait for it)
      "progress_interval_s": 2, "console_interval_s": 5,
      "flush_interval_s": null,        # seconds between commits; null: config generation.commit_every_s
      "stop_grace_s": 60,
      "dispatch": {"down_after": 3, "backoff_s": 1.0},  # optional Dispatcher options
      "store": "s3://bucket/job/_parts/gpu1/chunk-00003",  # optional: committed output put here too
      "seed": ["s3://bucket/job/_parts/gpu2/chunk-00003"],  # optional: shards a fresh run starts from
      "input_span": [0, 81920]          # optional: the bytes of the input URL that are this job's
      "input_rows": [0, 5000]           # optional: the rows of the Parquet input URL that are this job's
      "input_pin": {"etag": "…", …}     # optional: the input URL's version the job was planned on (data/pin.py)
    }

The input may be an fsspec URL: it is downloaded beside the output first. With `store`, the
runner puts every committed shard there, and at the end of a finished run its record files and
manifest (fleet.generation.job.publish).

The API key is never in the file: it comes from the environment variable each server
entry names (default FLEET_API_KEY; an endpoint's ENDPOINT_API_KEY_<i>).

Exit codes: 0 every row fed ended in results/errors/rejects, or a clean stop on a
signal; 1 the job failed (a store that cannot write, an unreadable input, every row
refused alike); 2 it could not start (bad job file, output locked by another runner).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleet.config import FleetConfig
from fleet.generation.hotpath.dispatch import Dispatcher
from fleet.generation.job.failures import (
    Failure,
    GuardedStore,
    OutputRemoved,
    classify,
    reserve_space,
    write_exit,
)
from fleet.jobs import EXIT_FILE
from fleet.generation.job.jobspec import JobSpec, ServerEntry, fleet_config
from fleet.generation.data.manifest import Summary
from fleet.generation.job.progress import Progress
from fleet.generation.job.relaunch import JobServers
from fleet.generation.hotpath.serverstate import Endpoint

if TYPE_CHECKING:
    from fleet.generation.data.manifest import RunFacts
    from fleet.generation.job.publish import Publisher
    from fleet.generation.data.store import ResultStore


log = logging.getLogger("fleet.generation")

__all__ = ["JobSpec", "ServerEntry", "main", "run_job", "run_local"]


# ---------------------------------------------------------------------------- the job

_SIGNALS = ("SIGTERM", "SIGINT")


def _streams(engine: str) -> bool:
    """Are answers streamed for token progress? The engine profile says; a plain OpenAI server
    (an endpoint's engine "openai": a router, a deployment fleet knows nothing of) streams: its
    chunks are the one progress signal every such server gives."""
    from fleet.engines import PROFILES

    profile = PROFILES.get(engine)
    return True if profile is None else profile.stream_progress


def _endpoints(entries: list[ServerEntry], engine: str) -> list[Endpoint]:
    """The dispatcher's endpoints, each with the API key its entry names (from the environment)
    and its progress signal (its own engine, else the config's `engine`)."""
    endpoints = []
    for e in entries:
        key = os.environ.get(e.api_key_env) if e.api_key_env else None
        endpoints.append(Endpoint(name=e.name, url=e.url.rstrip("/"), model=e.model, api_key=key,
                                  max_running_requests=e.max_running_requests, max_in_flight=e.max_in_flight,
                                  gpus=max(1, len(e.gpus)), stream=_streams(e.engine or engine), extra={"entry": e}))
    return endpoints


class _Run:
    """One run of a job, step by step (see `run_job`): its store, dispatcher and progress, and
    its first failure. Any part (the progress ticker, the input feeder's thread, the store, the
    dispatcher) records a failure with `fail`; the first one wins and stops the dispatcher."""

    def __init__(self, job: JobSpec, cfg: FleetConfig, out: Path, out_ino: int, fingerprint: str,
                 store: ResultStore, started_at: float, t0: float) -> None:
        self.job = job
        self.cfg = cfg
        self.gen = cfg.generation
        self.out = out
        self.out_ino = out_ino
        self.fingerprint = fingerprint
        self.store = store
        self.started_at = started_at
        self.t0 = t0
        self.loop = asyncio.get_running_loop()
        self.failure: Failure | None = None
        self._failure_exc: BaseException | None = None   # what `failure` was classified from
        self.reserve: Path | None = None
        self._disp: Dispatcher | None = None
        self._signals = 0
        self.rows_in_input: int | None = None   # every row of the input, whatever the limit (`_count_rows`)
        self.publisher: Publisher | None = None   # the output's copy on object storage (job.store)
        self._publishing: asyncio.Future[None] | None = None
        self.input_pin: dict[str, Any] | None = None   # the input file's size, mtime, inode (`_items` checks them)

    @classmethod
    async def open(cls, job: JobSpec) -> _Run:
        """The config, the output directory (created) and its store (locked, checked against the input)."""
        from fleet.generation.data.sources import input_fingerprint
        from fleet.generation.data.store import ResultStore
        from fleet.generation.job.validate import job_params

        cfg = fleet_config(job.config)
        out = Path(job.output)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            from fleet.errors import InputError

            raise InputError(f"cannot create output directory {out}: {exc.strerror}",
                             remedy="pass an --output directory you can write to") from exc
        out_ino = out.stat().st_ino
        started_at = time.time()
        t0 = time.monotonic()
        await asyncio.to_thread(_from_store, job, out)
        pin = await asyncio.to_thread(_pin_local, job.input)
        fingerprint = await asyncio.to_thread(input_fingerprint, job.input)
        if pin is not None:   # the SHA-256 is of the version pinned: not one rewritten while it was hashed
            from fleet.generation.data.pin import check_local

            await asyncio.to_thread(check_local, job.input, pin)
        store = ResultStore(out, shard_rows=cfg.generation.shard_rows, input_fingerprint=fingerprint,
                            job_params=job_params(cfg))
        run = cls(job, cfg, out, out_ino, fingerprint, store, started_at, t0)
        run.input_pin = pin
        if job.store:
            from fleet.generation.job.publish import Publisher

            run.publisher = Publisher(out, job.store)
        return run

    @property
    def disp(self) -> Dispatcher:
        assert self._disp is not None, "prepare() builds the dispatcher"
        return self._disp

    def fail(self, exc: BaseException, *, stop: bool = True) -> None:
        """Record the job's first failure and stop the dispatcher at once (from any thread)."""
        if self.failure is None:
            self._failure_exc = exc
            self.failure = classify(exc, self.out, committed=self.store.counts().get("committed"))
            if self.failure.kind == "internal":
                log.error("job failing: %s", self.failure.cause, exc_info=exc)
            else:
                log.error("job failing: %s", self.failure.cause)
        disp = self._disp
        if stop and disp is not None:
            try:
                in_loop = asyncio.get_running_loop() is self.loop
            except RuntimeError:
                in_loop = False
            if in_loop:
                disp.request_stop(0.0, reason=self.failure.cause)
            else:   # a store flush in a worker thread: the dispatcher is the loop's
                self.loop.call_soon_threadsafe(disp.request_stop, 0.0, self.failure.cause)

    # -- before the first row

    def prepare(self) -> None:
        """Set the disk reserve aside, load the ids done, build the dispatcher and the progress."""
        from fleet.generation.data.rows import InputStats

        try:
            self.reserve = reserve_space(self.out)
        except OSError as exc:
            self.fail(exc)
        if self.job.retry_errors and self.failure is None:
            # errors.jsonl is set aside (kept for the audit) and its ids are no longer done
            retried = self.store.retry_errors()
            log.info("retrying %d rows from the errors file", len(retried))
        self.done = self.store.done_ids()   # live: grows as rows end, read by the input thread
        if len(self.done):
            log.info("resuming: %d ids already done are skipped", len(self.done))
        self.endpoints = _endpoints(self.job.servers, self.cfg.engine.kind)
        servers = JobServers(self.cfg, self.job.servers, self.job.relaunch)
        self.guarded = GuardedStore(self.store, self.fail)
        self._disp = Dispatcher(self.endpoints, self.guarded, self.gen, on_server_down=servers.on_down,
                                is_alive=servers.is_alive, **self.job.dispatch)
        if self.failure is not None:
            self._disp.request_stop(0.0, reason=self.failure.cause)
        self.progress = Progress(self.job, self.store, self.started_at)
        self.stats = InputStats()

    # -- the rows

    async def dispatch(self, *, install_signals: bool, console: bool) -> Summary:
        """Stream the input through the dispatcher until it ends, a stop or a failure."""
        disp = self.disp
        counter = asyncio.ensure_future(self._count_rows())
        if install_signals:
            for signame in _SIGNALS:
                self.loop.add_signal_handler(getattr(signal, signame), self._on_signal, signame)
        try:
            self.progress.write(disp, "starting")   # at once: never leave a previous run's state for the watcher
        except Exception as exc:
            self.fail(exc)
        ticker = asyncio.ensure_future(self._tick(console))
        try:
            if self.failure is not None:   # failed before the first row (a full disk at start): nothing to run
                summary: Summary = disp.summary()
            else:
                summary = await disp.run(self._items())
        except Exception as exc:   # the dispatcher itself: still a manifest, a cause, a remedy
            self.fail(exc)
            summary = disp.summary()
        finally:
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)
            if install_signals:
                for signame in _SIGNALS:
                    self.loop.remove_signal_handler(getattr(signal, signame))
        await counter
        if disp.task_error is not None:
            self.fail(disp.task_error, stop=False)
        return summary

    async def _count_rows(self) -> None:
        from fleet.generation.data.sources import count_rows

        try:
            n = await asyncio.to_thread(count_rows, self.job.input)
            self.rows_in_input = n
            self.progress.rows_total = n if self.gen.limit is None else min(n, self.gen.limit)
        except Exception as exc:   # the feeder meets the same corruption, after the rows before it
            log.warning("counting the input's rows failed: %s", exc)

    def _on_signal(self, signame: str) -> None:
        self._signals += 1
        grace = self.job.stop_grace_s if self._signals == 1 else 0.0
        log.warning("%s: stopping (grace %.0f s; in flight %d)", signame, grace, self.disp.in_flight)
        self.disp.request_stop(grace, reason=f"stopped by {signame}")   # a second one: no more grace

    def _check_output(self) -> None:
        try:
            same = self.out.stat().st_ino == self.out_ino
        except FileNotFoundError:
            same = False
        if not same:
            raise OutputRemoved(errno.ENOENT, "output directory removed", str(self.out))

    @property
    def commit_every_s(self) -> float:
        """Seconds between commits: the job's own value (tests), else the config's generation.commit_every_s."""
        return self.job.flush_interval_s or self.gen.commit_every_s

    async def _tick(self, console: bool) -> None:
        """Every progress_interval_s: the output still there, a timed commit, progress.json, the console line."""
        job = self.job
        every = self.commit_every_s
        last_flush = last_console = time.monotonic()
        while True:
            await asyncio.sleep(job.progress_interval_s)
            try:
                now = time.monotonic()
                self._check_output()
                # progress first: a commit slowed by a busy disk (fsync) must not leave progress.json
                # still, which a controller takes for a lost node after node_lost_s
                p = self.progress.write(self.disp)
                if now - last_flush >= every:
                    await asyncio.to_thread(self.guarded.flush)   # thread-safe store; the loop keeps serving
                    last_flush = now
                    self._publish_shards()
                if console and now - last_console >= job.console_interval_s:
                    print(Progress.line(p), flush=True)
                    last_console = now
            except Exception as exc:   # a ticker that dies must not leave the job running blind
                self.fail(exc)
                return

    def _publish_shards(self) -> None:
        """Put the new committed shards in the store, in a thread of their own: a slow store must not
        hold up progress.json (the controller would take a still progress file for a lost node)."""
        if self.publisher is None or (self._publishing is not None and not self._publishing.done()):
            return
        publisher = self.publisher

        def sync() -> None:
            from fleet.errors import Fenced

            try:
                publisher.sync_shards()
            except Fenced as exc:   # the job ended without this attempt: stop generating for nothing
                self.fail(exc)
            except Exception as exc:   # the store unreachable for a while: the next commit tries again
                log.warning("could not put shards in %s: %s", publisher.store.root, exc)

        self._publishing = asyncio.ensure_future(asyncio.to_thread(sync))

    async def publish(self, state: str) -> None:
        """The end of a run with a store: every shard there, and for a finished run the record files
        and the manifest (last). A failure here fails the run: the chunk is not done until it is there."""
        if self.publisher is None:
            return
        if self._publishing is not None:
            await self._publishing
        await asyncio.to_thread(self.publisher.finish if state == "done" else self.publisher.sync_shards)

    def _items(self) -> Iterator[Any]:
        """The input, stopping cleanly at a corrupt/unreadable point: the rows before it still run."""
        from fleet.generation.data.inputs import iter_input

        from fleet.generation.data.pin import check_local

        pin, path = self.input_pin, self.job.input
        try:
            for item in iter_input(path, self.gen, skip_ids=self.done.__contains__, stats=self.stats):
                if pin is not None:   # a row read after the file was rewritten is never sent (~2 us a row)
                    check_local(path, pin)
                yield item
        except Exception as exc:
            self.fail(exc, stop=False)   # this runs in the feeder's thread: no dispatcher call from here

    # -- after the last row

    async def finish(self, summary: Summary, *, console: bool) -> tuple[str, str | None, dict[str, int]]:
        """Commit, then write the manifest and the final progress.json; the job's state, reason and counts."""
        from fleet.generation.data.manifest import MANIFEST_FILE, build_manifest

        state, reason = self._settle(summary)
        counts = dict(self.store.counts())
        if self._failure_exc is not None:   # its remedy names the rows kept: the final count, not the first
            self.failure = classify(self._failure_exc, self.out, committed=counts.get("committed"))
            reason = self.failure.cause
        wall = time.monotonic() - self.t0
        final = self.progress.build(self.disp, state)
        final["state"] = state
        final["reason"] = reason
        if state == "failed":
            final["detail"] = f"failed: {reason}"
        if self.failure is not None:
            final["error"] = self.failure.as_dict()
        manifest = build_manifest(self._facts(summary, state, reason, counts, wall))
        await self._add_checks(manifest, summary)
        final["manifest"] = str(self.out / MANIFEST_FILE)
        final["tok_s_avg"] = manifest["throughput"]["completion_tok_s"] or 0.0   # one number, two places
        state = self._write_final(manifest, final, state)
        if console:
            print(Progress.line(final), flush=True)
        return state, reason, counts

    def _settle(self, summary: Summary) -> tuple[str, str | None]:
        """Note a broken input, commit the buffer, refuse an input without one valid row; the state and reason."""
        if self.failure is not None and self.failure.kind == "input":
            try:   # a repaired copy of the input may continue this job (the store accepts it)
                self.store.note_input_broken(self.failure.cause)
            except OSError as exc:
                log.warning("cannot note the broken input in %s: %s", self.out, exc)
        if self.failure is None or self.failure.kind not in ("disk_full", "output_removed"):
            try:
                self.store.flush()
            except Exception as exc:
                self.fail(exc, stop=False)
        else:   # what is committed now is what every record counts (store.discard_buffer)
            dropped = self.store.discard_buffer()
            if dropped:
                log.warning("%d rows not committed (the output filesystem failed): generated again on resume",
                            dropped)
        stats = self.stats
        # a byte range of a larger input cut from its size may own no line at all (it falls inside one
        # long line, or holds only blank ones): an empty part, not an input without rows
        empty_part = (self.job.input_span is not None or self.job.input_rows is not None) and stats.rows == 0
        if self.failure is None and summary.state == "done" and stats.requests + stats.skipped == 0 and not empty_part:
            from fleet.errors import InputError

            self.fail(InputError(f"input {self.job.input} holds no valid row ({stats.rows:,} rows read, "
                                 f"{stats.rejects:,} rejects; see rejects.jsonl)",
                                 remedy="fix the rows, then run the same command again"), stop=False)
        if self.failure is None and summary.state == "failed":
            # a failed job always says why and what to do, whatever part of it failed
            remedy = self._disp.remedy if self._disp is not None else None
            if remedy is not None:   # no server usable: the servers' fault, and the dispatcher says what to do
                self.failure = Failure("servers", (summary.reason or "no server usable")[:1500], remedy)
            else:
                self.failure = Failure("internal", (summary.reason or "the dispatcher failed")[:500],
                                       "a bug: the traceback is in the runner's log; then run the same command again "
                                       "to resume: committed rows are kept")
        state = "failed" if self.failure is not None or summary.state == "failed" else summary.state
        reason = self.failure.cause if self.failure is not None else summary.reason
        return state, reason

    def _facts(self, summary: Summary, state: str, reason: str | None, counts: dict[str, int],
               wall: float) -> RunFacts:
        """What the manifest says of this run, and the runs before it (from the manifest there)."""
        from fleet.generation.data.manifest import RunFacts, ServerFacts
        from fleet.generation.data.manifest import read_manifest

        try:
            runs = list((read_manifest(self.out) or {}).get("runs") or [])
        except (OSError, ValueError):
            runs = []
        return RunFacts(
            state=state, reason=reason, failure=self.failure.as_dict() if self.failure is not None else None,
            summary=summary, input_path=str(self.job.input), input_fingerprint=self.fingerprint,
            rows_total=self.progress.rows_total, rows_in_input=self.rows_in_input, limit=self.gen.limit,
            output=str(self.out), counts=counts,
            config=self.cfg.model_dump(mode="json", exclude={"servers": {"api_key"}}),
            config_fingerprint=self.cfg.fingerprint(), price_per_gpu_hour=self.gen.price_per_gpu_hour,
            servers=[ServerFacts(ep.name, ep.url, ep.model, ep.gpus, srv.info)
                     for ep, srv in zip(self.endpoints, self.disp.servers)],
            started_at=self.started_at, finished_at=time.time(), wall_s=wall, previous_runs=runs,
            runner={"pid": os.getpid(), "retry_errors": self.job.retry_errors, "python": sys.version.split()[0]},
        )

    async def _add_checks(self, manifest: dict[str, Any], summary: Summary) -> None:
        from fleet.generation.data.checks import data_checks, quality_summary

        if self.failure is not None and self.failure.kind in ("disk_full", "output_removed"):
            return
        try:
            manifest["checks"] = await asyncio.to_thread(data_checks, self.out)
        except Exception as exc:  # checks must never cost the job its manifest
            manifest["checks"] = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            manifest["quality"] = await asyncio.to_thread(quality_summary, self.out, summary.gates)
        except Exception as exc:
            manifest["quality"] = {"error": f"{type(exc).__name__}: {exc}"}

    def _write_final(self, manifest: dict[str, Any], final: dict[str, Any], state: str) -> str:
        """manifest.json, then progress.json (on a full disk the reserve makes room); the state."""
        from fleet.generation.data.manifest import write_manifest

        if self.failure is not None and self.failure.kind == "output_removed":
            return state
        for attempt in range(2):
            try:
                write_manifest(self.out, manifest)
                # last: a watcher that sees the final state finds the manifest already there
                self.progress.put(final)
                break
            except OSError as exc:
                if attempt == 0 and self.reserve is not None:
                    self.reserve.unlink(missing_ok=True)
                    self.reserve = None
                    continue
                log.error("cannot write the final manifest/progress in %s: %s", self.out, exc)
                if self.failure is None:
                    self.fail(exc, stop=False)
                    state = "failed"
        return state

    def close(self) -> None:
        if self.reserve is not None:
            self.reserve.unlink(missing_ok=True)
        try:
            self.store.close()
        except Exception as exc:   # a full disk again: the rows not committed are generated on resume
            log.error("closing the store: %s", exc)

    def exit_code(self, state: str, reason: str | None, counts: dict[str, int], exit_file: Path | None,
                  *, console: bool) -> int:
        """The process exit code, logged and written to exit.json."""
        rc = 1 if state == "failed" else 0
        failure = self.failure
        if failure is not None:
            log.error("job failed: %s — %s", failure.cause, failure.remedy)
            if console:
                print(f"fleet runner: FAILED: {failure.cause} — {failure.remedy}", file=sys.stderr, flush=True)
        elif state == "failed":
            log.error("job failed: %s", reason)
        write_exit(exit_file, os.getpid(), rc, state, failure, {"counts": counts})
        return rc


async def run_job(job: JobSpec, *, install_signals: bool = True, console: bool = True,
                  exit_file: Path | None = None) -> int:
    """Run one job to its end (or a stop); return the process exit code.

    Any exception of any part (the progress ticker, the input feeder, the store, the
    dispatcher) stops the job as `failed` with a `Failure` — cause and remedy — written to
    progress.json, the manifest and `exit_file`; see `classify`."""
    run = await _Run.open(job)
    try:
        run.prepare()
        summary = await run.dispatch(install_signals=install_signals, console=console)
        with run.progress.beating(job.progress_interval_s):   # the end can outlast a watcher's patience
            state, reason, counts = await run.finish(summary, console=console)
            await run.publish(state)
    finally:
        run.close()
    return run.exit_code(state, reason, counts, exit_file, console=console)


def _pin_local(path: str) -> dict[str, Any] | None:
    """The input file's version (fleet.generation.data.pin) as the runner starts: rewritten in place while the
    job runs, its later rows would be another input's."""
    from fleet.generation.data.pin import pin_of

    try:
        return pin_of(path)
    except OSError:   # missing: the fingerprint says so, with its remedy
        return None


def _from_store(job: JobSpec, out: Path) -> None:
    """An input on object storage read from a local copy; a fresh attempt seeded with earlier attempts'
    shards (see fleet.generation.job.publish)."""
    from fleet.generation.job.publish import seed, stage_input

    job.input = stage_input(job.input, out, job.input_span, job.input_rows, job.input_pin)
    if job.store and job.seed:
        n = seed(out, job.seed)
        if n:
            log.info("started from %d shard(s) that earlier attempts put in the store", n)


def run_local(cfg: FleetConfig, input: str | Path, output: str | Path, servers: list[ServerEntry | dict[str, Any]],
              *, retry_errors: bool = False, relaunch: bool = True, flush_interval_s: float | None = None,
              progress_interval_s: float = 2.0, console_interval_s: float = 5.0, stop_grace_s: float = 60.0,
              install_signals: bool = False, console: bool = False, dispatch: dict[str, Any] | None = None,
              endpoint_keys: dict[str, str] | None = None) -> int:
    """Run a job in this process (tests, `fleet generate` on a local node without detaching);
    `endpoint_keys`: the [[endpoints]]' keys (`fleet.generation.job.endpoints.endpoint_keys`)."""
    job = JobSpec(
        config=cfg.model_dump(mode="json", exclude={"servers": {"api_key"}}), input=str(input), output=str(output),
        servers=[s if isinstance(s, ServerEntry) else ServerEntry.from_dict(s) for s in servers],
        retry_errors=retry_errors, relaunch=relaunch, flush_interval_s=flush_interval_s,
        progress_interval_s=progress_interval_s, console_interval_s=console_interval_s, stop_grace_s=stop_grace_s,
        dispatch=dict(dispatch or {}),
    )
    from fleet.generation.job.remote import runner_secret_env

    env = runner_secret_env(cfg, endpoint_keys)
    saved = {k: os.environ.get(k) for k in ("FLEET_API_KEY", "FLEET_ENGINE_ENV", *env)}
    os.environ.update(env)
    try:
        return asyncio.run(run_job(job, install_signals=install_signals, console=console))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv: list[str] | None = None) -> int:
    if argv is None:   # the runner's own process (python -m …): pyarrow's needless pandas import refused
        from fleet.generation.job.nopandas import refuse_pandas

        refuse_pandas()
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["--check-store"]:   # a node proving its store access before a job (storecheck.py)
        from fleet.generation.job.storecheck import check_main

        return check_main(args_in[1:])
    p = argparse.ArgumentParser(prog="python -m fleet.generation.job.runner",
                                description="Run one fleet generation job (the data-plane process).")
    p.add_argument("--job", required=True, help="JOB.json: config, input, output, servers")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(args_in)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from fleet.errors import FleetError

    exit_file = Path(args.job).resolve().parent / EXIT_FILE
    try:
        job = JobSpec.load(args.job)
        if not job.servers:
            raise ValueError("the job lists no servers")
    except (OSError, ValueError, TypeError, KeyError) as exc:
        print(f"fleet runner: cannot read the job file {args.job}: {exc}", file=sys.stderr)
        write_exit(exit_file, os.getpid(), 2, "failed",
                   Failure("internal", f"cannot read the job file {args.job}: {exc}", "run `fleet generate` again"))
        return 2
    try:
        return asyncio.run(run_job(job, exit_file=exit_file))
    except FleetError as exc:   # a locked output, an unreadable input, another job's directory
        print(f"fleet runner: {exc}", file=sys.stderr)
        write_exit(exit_file, os.getpid(), 2, "failed", classify(exc, Path(job.output)))
        return 2
    except Exception as exc:
        from pydantic import ValidationError

        if isinstance(exc, ValidationError):
            print(f"fleet runner: the job's config is invalid: {exc}", file=sys.stderr)
            write_exit(exit_file, os.getpid(), 2, "failed",
                       Failure("internal", f"the job's config is invalid: {str(exc).splitlines()[0]}",
                               "fix the config, then run the same command again"))
            return 2
        failure = classify(exc, Path(job.output))
        write_exit(exit_file, os.getpid(), 1, "failed", failure)
        if failure.kind in ("disk_full", "output_removed", "output_unwritable"):   # not a bug: no traceback
            print(f"fleet runner: FAILED: {failure.cause} — {failure.remedy}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
