"""Workarounds for megatron-core (0.16) behaviours that fight us, all in one place.

One function per patch, each with the reason. `apply()` is called by
`parallel.primitives.groups.ensure_initialized` before any layer is built.
tests/test_megatron_compat.py checks that each patched behaviour is still what we patch
around, so a megatron-core upgrade that changes it fails a test instead of silently changing
results.
"""

from __future__ import annotations

import importlib

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import layers

_applied = False


def _quiet_default_tp_group() -> None:
    """RowParallelLinear.forward passes tp_group=None to its matmul on every call, and
    megatron's `get_tensor_model_parallel_group_if_none` then issues a DeprecationWarning on
    rank 0. torch.compile cannot trace `warnings.warn`, so every RowParallelLinear would break
    the graph. We rebind the name in `tensor_parallel.layers` to the same lookup without the
    warning (we pass tp groups explicitly everywhere else)."""
    def default_tp_group(tp_group, is_expert=False, check_initialized=True):
        if tp_group is not None or not torch.distributed.is_initialized():
            return tp_group
        if not parallel_state.is_initialized():
            return tp_group
        if is_expert:
            return parallel_state.get_expert_tensor_parallel_group(
                check_initialized=check_initialized)
        return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)

    layers.get_tensor_model_parallel_group_if_none = default_tp_group


class _CudaNamingTheCpu:
    """torch.cuda, except that current_device() names the CPU."""

    @staticmethod
    def current_device() -> str:
        return "cpu"

    def __getattr__(self, name: str):
        return getattr(torch.cuda, name)


class _TorchOnCpu:
    """The torch module as seen by a patched megatron module: only `torch.cuda` differs."""

    cuda = _CudaNamingTheCpu()

    def __getattr__(self, name: str):
        return getattr(torch, name)


# Modules that allocate with `device=torch.cuda.current_device()` on paths we use.
CUDA_DEVICE_MODULES = (
    "megatron.core.tensor_parallel.mappings",  # sequence-parallel gather / reduce-scatter
    "megatron.core.tensor_parallel.layers",  # reduce-scatter of the input grad under SP
    "megatron.core.utils",  # GlobalMemoryBuffer: the all-gather buffer of SP linears
)


def _cpu_device_for_megatron_buffers() -> None:
    """On a CPU-only torch, `torch.cuda.current_device()` raises ("Torch not compiled with
    CUDA enabled"); megatron-core calls it to place the output buffers of its
    sequence-parallel collectives and of the SP all-gather in its linear layers. We give
    exactly those modules a view of torch in which the current device is the CPU (torch
    itself is untouched). Applied only when CUDA is unavailable."""
    for name in CUDA_DEVICE_MODULES:
        importlib.import_module(name).torch = _TorchOnCpu()


def _cpu_autocast_in_linear_backward() -> None:
    """megatron-core decorates its TP matmul Function with torch.amp.custom_fwd/custom_bwd
    for device_type="cuda" only, so under CPU autocast the forward runs in bf16 but the
    backward runs without autocast and multiplies a bf16 gradient by the fp32 weight
    ("expected m1 and m2 to have the same dtype"). We re-decorate the undecorated
    forward/backward for the CPU, which replays the forward's autocast state in backward."""
    fn = layers.LinearWithGradAccumulationAndAsyncCommunication
    fn.forward = staticmethod(torch.amp.custom_fwd(fn.forward.__wrapped__, device_type="cpu"))
    fn.backward = staticmethod(torch.amp.custom_bwd(fn.backward.__wrapped__, device_type="cpu"))


def timeout_minutes(timeout_s: float) -> float:
    """`initialize_model_parallel`'s `distributed_timeout_minutes` for a timeout in seconds.

    megatron-core types the argument as whole minutes (default 30) but uses it only as
    `timedelta(minutes=distributed_timeout_minutes)`, which takes a float: seconds / 60 gives
    every TP/DP/PP/embedding group the same second-level timeout as the world group. The
    alternative, megatron's `update_pg_timeout` after initialisation, calls
    `torch.cuda.synchronize()` (which a CPU-only torch refuses) and torch's private
    `_set_pg_timeout`. tests/test_megatron_compat.py reads the timeouts off the groups."""
    return timeout_s / 60


def apply() -> None:
    """Apply every patch once (the CPU ones only without CUDA)."""
    global _applied
    if _applied:
        return
    _quiet_default_tp_group()
    if not torch.cuda.is_available():
        _cpu_device_for_megatron_buffers()
        _cpu_autocast_in_linear_backward()
    _applied = True
