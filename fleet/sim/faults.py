"""Faults on demand, each the way the real failure looks from outside.

At start: ``--oom-at-start`` (SGLang's OOM lines, exit 1), ``--hang-at-start`` (in
``fleet.sim.startup``). Per generation request: ``--crash-after N`` (the scheduler dies,
taking the server with it), ``--hang-requests`` / ``--hang-after N`` (a wedged scheduler:
/health still answers), ``--error-rate`` and the SIGUSR1 burst of HTTP 500s, ``--garbled-after N``
(200 answers with wrong types). In the answers:
``--empty-rate``, ``--think-leak-rate``, ``--loop-rate``. Every decision is deterministic
(``fleet.sim.determinism``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any, NoReturn

from fleet.sim.determinism import SALT_EMPTY, SALT_ERR, SALT_LEAK, SALT_LOOP, unit
from fleet.sim.engine import Engine
from fleet.sim.http_front import Answer, Resp, error_resp, json_resp
from fleet.sim.log import Log

_SGL = "/usr/local/lib/python3.12/dist-packages/sglang/srt"


def summary(args: argparse.Namespace) -> dict[str, Any]:
    """The faults asked for (/server_info's ``sim.faults``, the first log line)."""
    a = args
    return {
        "oom_at_start": a.oom_at_start,
        "hang_at_start": a.hang_at_start,
        "crash_after": a.crash_after,
        "hang_requests": a.hang_requests,
        "hang_after": a.hang_after,
        "error_rate": a.error_rate,
        "garbled_after": a.garbled_after,
    }


def hung(args: argparse.Namespace, engine: Engine) -> bool:
    a = args
    return bool(a.hang_requests or (a.hang_after is not None and engine.gen_counter >= a.hang_after))


async def hang() -> Resp:
    never: asyncio.Future[Resp] = asyncio.get_running_loop().create_future()
    return await never  # never resolves; cancelled on disconnect


def injected(args: argparse.Namespace, engine: Engine, n: int) -> Answer | None:
    """After validation: --hang-requests, the SIGUSR1 burst, --garbled-after and --error-rate for request ``n``.

    Returns the answer instead of the generation, or None.
    """
    if args.hang_requests or (args.hang_after is not None and n > args.hang_after):
        return hang()
    if engine.burst_left > 0:
        engine.burst_left -= 1
        return error_resp(500, "Internal server error (simulated burst, SIGUSR1).", "InternalServerError")
    if args.garbled_after is not None and n > args.garbled_after:
        return json_resp(200, {"object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "garbled"}, "finish_reason": "stop"}],
            "usage": "lots"})
    rate = args.error_rate
    if rate > 0 and unit(args.seed, SALT_ERR, n) < rate:
        return error_resp(500, "Internal server error (simulated by --error-rate).",
                          "InternalServerError")
    return None


def start_burst(args: argparse.Namespace, engine: Engine, log: Log) -> None:
    """SIGUSR1: the next --burst-5xx generation requests answer HTTP 500 (a fault soak's burst)."""
    engine.burst_left = int(args.burst_5xx)
    log.info(f"sim: SIGUSR1: the next {engine.burst_left} generation requests answer HTTP 500")


def spoil(args: argparse.Namespace, key: int, words: list[str], n_reason: int, content: str,
          reasoning: str | None) -> tuple[str, str | None]:
    """Answer-quality faults (non-streamed chat answers): decided by the prompt and the
    request's seed (``key``), so asking again with another seed can come out clean."""
    a = args
    if a.loop_rate > 0 and words and unit(key, SALT_LOOP) < a.loop_rate:
        content = " ".join(words[n_reason:n_reason + 3] + [words[-1]] * 12)
    if a.think_leak_rate > 0 and unit(key, SALT_LEAK) < a.think_leak_rate:
        content, reasoning = f"<think>{reasoning or ''}</think>{content}", None
    if a.empty_rate > 0 and unit(key, SALT_EMPTY) < a.empty_rate:
        content = ""
    return content, reasoning


def crash(log: Log, n: int) -> NoReturn:
    """--crash-after: SGLang's scheduler dies mid-run; the whole server goes with it."""
    log.info(f"sim: --crash-after reached on generation request #{n}; dying now")
    log.info(
        "Scheduler hit an exception: Traceback (most recent call last):\n"
        f'  File "{_SGL}/managers/scheduler.py", line 2741, in run_scheduler_process\n'
        "    scheduler.event_loop_overlap()\n"
        f'  File "{_SGL}/managers/scheduler.py", line 1012, in event_loop_overlap\n'
        "    batch_result = self.run_batch(batch)\n"
        f'  File "{_SGL}/managers/scheduler.py", line 1826, in run_batch\n'
        "    batch_result = self.model_worker.forward_batch_generation(model_worker_batch)\n"
        "RuntimeError: CUDA error: an illegal memory access was encountered\n"
        "CUDA kernel errors might be asynchronously reported at any other API call, "
        "so the stacktrace below might be incorrect.\n"
        "For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n",
        tp=True,
    )
    log.info("Received sigquit from a child process. It usually means the child failed.")
    os._exit(1)


# the traceback's first frames, the same for both out-of-memory kinds (SGLang's scheduler start)
_SCHEDULER_INIT = (
    "Scheduler hit an exception: Traceback (most recent call last):\n"
    f'  File "{_SGL}/managers/scheduler.py", line 2729, in run_scheduler_process\n'
    "    scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, dp_rank)\n"
    f'  File "{_SGL}/model_executor/model_runner.py", line 306, in __init__\n'
    "    self.initialize(min_per_gpu_memory)\n"
)


def oom_lines(log: Log, kind: str) -> None:
    if kind == "weights":
        log.info(
            _SCHEDULER_INIT
            + f'  File "{_SGL}/model_executor/model_runner.py", line 389, in initialize\n'
            "    self.load_model()\n"
            f'  File "{_SGL}/model_loader/loader.py", line 585, in load_model\n'
            "    model = _initialize_model(model_config, self.load_config)\n"
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.45 GiB. GPU 0 has a "
            "total capacity of 139.81 GiB of which 1.12 GiB is free. Including non-PyTorch memory, "
            "this process has 138.68 GiB memory in use. Of the allocated memory 137.20 GiB is "
            "allocated by PyTorch, and 0.61 GiB is reserved by PyTorch but unallocated. If reserved "
            "but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
            "to avoid fragmentation.  See documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)\n",
            tp=True,
        )
    else:
        log.info(
            _SCHEDULER_INIT
            + f'  File "{_SGL}/model_executor/model_runner.py", line 421, in initialize\n'
            "    self.init_memory_pool(min_per_gpu_memory, server_args.max_running_requests, "
            "server_args.max_total_tokens)\n"
            f'  File "{_SGL}/model_executor/model_runner.py", line 1577, in init_memory_pool\n'
            "    raise RuntimeError(\n"
            "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. "
            "Current value: mem_fraction_static=0.88\n",
            tp=True,
        )
    log.info("Received sigquit from a child process. It usually means the child failed.")

