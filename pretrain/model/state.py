"""Layout-independent model and optimizer state: full (unsharded) tensors keyed by name.

Checkpoints store what a single-process model would hold, so a run saved at one TP size loads
at any other: saving all-gathers each tensor-parallel shard, loading takes this rank's slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from pretrain.model.init import local_shard


def _gather_full(param: torch.Tensor, tensor: torch.Tensor, group) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False) or group is None or group.size() == 1:
        return tensor.detach().cpu().clone()
    parts = [torch.empty_like(tensor) for _ in range(group.size())]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim).cpu()


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """{parameter name: full tensor} (collective over the TP group; every rank gets it)."""
    group = getattr(model, "tp_group", None)
    return {name: _gather_full(p, p, group) for name, p in model.named_parameters()}


@torch.no_grad()
def load_full_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy this rank's slice of each full tensor into the model; names must match exactly."""
    params = dict(model.named_parameters())
    missing, unexpected = params.keys() - state.keys(), state.keys() - params.keys()
    if missing or unexpected:
        raise KeyError(f"model state mismatch: missing {sorted(missing)[:5]}, "
                       f"unexpected {sorted(unexpected)[:5]}")
    for name, param in params.items():
        shard = local_shard(state[name], param, model.tp_rank, model.tp_size)
        if shard.shape != param.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(state[name].shape)} does not fit "
                             f"this model's {tuple(param.shape)} (x TP {model.tp_size})")
        param.copy_(shard)


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """AdamW state keyed by parameter name, tensors unsharded: {name: {key: tensor}}."""
    group = getattr(model, "tp_group", None)
    out = {}
    for name, param in model.named_parameters():
        state = optimizer.state.get(param)
        if not state:
            continue
        out[name] = {key: _gather_full(param, value, group) if value.ndim > 0
                     else value.detach().cpu().clone() for key, value in state.items()}
    return out


@torch.no_grad()
def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                              state: dict) -> None:
    """Inverse of `full_optimizer_state` for this rank's parameters."""
    for name, param in model.named_parameters():
        if name not in state:
            continue
        # 0-dim entries (AdamW's `step`) stay on the CPU, as torch keeps them.
        optimizer.state[param] = {
            key: local_shard(value, param, model.tp_rank, model.tp_size).to(param.device).clone()
            if value.ndim > 0 else value.clone()
            for key, value in state[name].items()}
