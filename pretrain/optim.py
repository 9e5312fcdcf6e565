"""AdamW with weight-decay groups, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float, decay_alphas: bool) -> list[dict]:
    """Decay matrices (linear weights, embedding); never norms, biases or gains; the DWA
    alphas only if `decay_alphas` (the paper's code does not decay them)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if name.endswith("dwa_alpha"):
            (decay if decay_alphas else no_decay).append(param)
        elif param.ndim >= 2:
            decay.append(param)
        else:
            no_decay.append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, optim_cfg) -> torch.optim.AdamW:
    """AdamW over `param_groups`, hyper-parameters from the `optim` config section."""
    groups = param_groups(model, optim_cfg.weight_decay, optim_cfg.decay_alphas)
    return torch.optim.AdamW(groups, lr=optim_cfg.lr, betas=(optim_cfg.beta1, optim_cfg.beta2),
                             eps=optim_cfg.eps)


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """LR for optimizer step `step` (1-based): linear warmup, then cosine down to min_lr."""
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
