"""The rank grid: torch.distributed + megatron-core's parallel_state, and device selection.

Every process (a torchrun rank, a Slurm task, or a plain Python session) goes through
`ensure_initialized`; a plain session gets a 1-rank gloo group on the fly, so that
megatron-core's tensor-parallel layers work without a launcher.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from parallel.primitives import megatron_compat


def default_device() -> torch.device:
    """The device this process computes on: its local CUDA device if any, else the CPU."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_initialized(tp: int | None = None, pp: int | None = None,
                       timeout_s: float = 600.0) -> None:
    """Initialise torch.distributed and megatron-core's parallel_state unless already done.

    Under torchrun/Slurm the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) drives
    the process group; without it this process becomes a 1-rank world on a local port.
    tp/pp None accept an existing layout (or make a TP=PP=1 one); given, they must match.
    `timeout_s` bounds every collective of the groups created here (world and megatron-core's):
    a rank waiting longer on a stopped or dead peer raises instead of hanging.
    """
    # Megatron's advice for overlapping TP communication with compute on GPUs; it must be
    # set before the CUDA context exists.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    megatron_compat.apply()
    if not dist.is_initialized():
        device = default_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend_for(device), timeout=timedelta(seconds=timeout_s))
        else:
            dist.init_process_group(
                backend_for(device), init_method=f"tcp://127.0.0.1:{free_port()}",
                rank=0, world_size=1, timeout=timedelta(seconds=timeout_s))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp or 1, pipeline_model_parallel_size=pp or 1,
            distributed_timeout_minutes=megatron_compat.timeout_minutes(timeout_s),
            create_gloo_process_groups=False)
    else:
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size())
        if (tp or have[0], pp or have[1]) != have:
            raise RuntimeError(f"parallel state already initialised as (tp, pp)={have}, "
                               f"asked for {(tp, pp)}")


def allreduce_in_one_bucket(tensors: list[torch.Tensor], group, divide_by: int = 1) -> None:
    """Sum `tensors` over `group` in place (then divide) with one collective on a flat copy."""
    if not tensors:
        return
    flat = _flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=group)
    if divide_by != 1:
        flat /= divide_by
    for tensor, reduced in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
        tensor.copy_(reduced)


def tp_group():
    return parallel_state.get_tensor_model_parallel_group()


def tp_rank() -> int:
    return parallel_state.get_tensor_model_parallel_rank()


def tp_size() -> int:
    return parallel_state.get_tensor_model_parallel_world_size()


# How gloo ends a collective whose peer stopped answering: the wait timing out after the
# group's timeout, then (for later operations, or on the peers of the rank that gave up) the
# connection that timeout or that rank's exit closed. NCCL's watchdog aborts the process
# itself instead (TORCH_NCCL_ASYNC_ERROR_HANDLING), so no Python error reaches us there.
PEER_LOST_MESSAGES = ("Timed out waiting", "Application timeout caused pair closure",
                      "Connection closed by peer", "Connection reset by peer")


def peer_lost(err: BaseException, timeout_s: float) -> str | None:
    """One line saying that a collective lost its peer, if that is what `err` is; else None."""
    text = str(err)
    if not isinstance(err, RuntimeError) or not any(m in text for m in PEER_LOST_MESSAGES):
        return None
    detail = text.splitlines()[0] if text else type(err).__name__
    return (f"a collective got no answer from another rank within parallel.timeout_s="
            f"{timeout_s:g} s, or lost its connection: that rank is stopped, hung or dead (its "
            f"own log says which); {detail}")


def destroy() -> None:
    """Tear down parallel_state and the process group (idempotent)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
