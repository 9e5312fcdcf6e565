"""Workarounds for megatron-core (0.16) behaviours that fight us, all in one place.

One function per patch, each with the reason. `apply()` is called by
`parallel.groups.ensure_initialized` before any layer is built. tests/test_megatron_compat.py
checks that each patched behaviour is still what we patch around, so a megatron-core upgrade
that changes it fails a test instead of silently changing results.
"""

from __future__ import annotations

import torch

_applied = False


def _quiet_default_tp_group() -> None:
    """RowParallelLinear.forward passes tp_group=None to its matmul on every call, and
    megatron's `get_tensor_model_parallel_group_if_none` then issues a DeprecationWarning on
    rank 0. torch.compile cannot trace `warnings.warn`, so every RowParallelLinear would break
    the graph. We rebind the name in `tensor_parallel.layers` to the same lookup without the
    warning (we pass tp groups explicitly everywhere else)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import layers

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


def apply() -> None:
    """Apply every patch once."""
    global _applied
    if _applied:
        return
    _quiet_default_tp_group()
    _applied = True
