"""One helper for multi-process tests (in the spirit of OLMo-core's `run_distributed_test`).

    results = run_distributed_test(fn, world_size=4, timeout_s=120, tp=2, pp=2, case=...)

spawns `world_size` fresh processes (the spawn start method: fork is known to deadlock with
torch threads), each with a process group on a free local port (gloo, or NCCL when there is
one GPU per rank), megatron-core's parallel state for (tp, pp) via
`parallel.primitives.groups.ensure_initialized` (unless `set_up_groups=False`: then `fn` sets them
up from the environment, as the trainer does), and one torch thread; calls `fn(**kwargs)` in each
(`fn` must be importable: a module-level function) and returns the list of their return
values by rank. A failing rank fails the test with its rank and traceback (the other ranks
are stopped); a run past `timeout_s` kills every rank and raises TimeoutError.
"""

from __future__ import annotations

import io
import os
import queue
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as mp

from parallel.primitives.groups import free_port


def _worker(rank: int, world_size: int, port: int, tp: int, pp: int, set_up_groups: bool,
            fn: Callable, kwargs: dict, results) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from parallel.primitives import groups

    try:
        if set_up_groups:
            groups.ensure_initialized(tp=tp, pp=pp, timeout_s=120.0)
        result = fn(**kwargs)
        # Plain bytes: tensors sent through a queue live in shared memory that disappears
        # when this process exits, possibly before the parent has read them.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            groups.destroy()


def run_distributed_test(fn: Callable, world_size: int, timeout_s: float = 300.0, *,
                         tp: int = 1, pp: int = 1, set_up_groups: bool = True,
                         **kwargs: Any) -> list[Any]:
    """Run `fn(**kwargs)` on `world_size` ranks (TP x PP x DP grid); results by rank.

    `set_up_groups=False` leaves the process groups to `fn` (the environment is set)."""
    if world_size % (tp * pp):
        raise ValueError(f"tp*pp = {tp * pp} does not divide world_size {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    context = mp.start_processes(
        _worker, args=(world_size, free_port(), tp, pp, set_up_groups, fn, kwargs, results),
        nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    by_rank: dict[int, Any] = {}
    try:
        while True:
            try:
                done = context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except mp.ProcessRaisedException as err:
                raise AssertionError(f"a rank failed:\n{err}") from None
            except mp.ProcessExitedException as err:
                raise AssertionError(f"rank {err.error_index} exited with code "
                                     f"{err.exit_code}") from None
            while True:
                try:
                    rank, status, value = results.get_nowait()
                except queue.Empty:
                    break
                if status == "error":
                    raise AssertionError(f"rank {rank} failed:\n{value}")
                by_rank[rank] = _load(value)
            if done:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"distributed test {getattr(fn, '__name__', fn)} on "
                                   f"{world_size} ranks timed out after {timeout_s:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
        for process in context.processes:
            process.join(5)
    while len(by_rank) < world_size:
        try:
            rank, status, value = results.get(timeout=5)
        except queue.Empty:
            break
        if status == "error":
            raise AssertionError(f"rank {rank} failed:\n{value}")
        by_rank[rank] = _load(value)
    return [by_rank.get(rank) for rank in range(world_size)]


def group_timeout(group) -> timedelta:
    """The collective timeout a process group was built with (its backend's options)."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return group._get_backend(device).options._timeout


def _load(payload: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(payload), weights_only=False)
