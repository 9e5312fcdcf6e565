"""AdamW with weight-decay groups, and the warmup + cosine learning-rate schedule.

`optim.fused` picks torch's implementation: fused (one kernel per parameter group and step,
and it can skip a step on the device: `step_if_finite`) or foreach. `auto` takes fused
wherever this torch has the kernel for the parameters' device and dtype (CUDA, and the CPU
since torch 2.4); under ZeRO it is the AdamW that DeepSpeed's ZeRO optimizer steps.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pretrain.config import ConfigError
from pretrain.model import hc


def param_groups(model: nn.Module, weight_decay: float, decay_alphas: bool) -> list[dict]:
    """Decay matrices (linear weights, embedding); never norms, biases or gains; the depth
    connections' weights (DWA alphas, AttnRes queries and key norms, MUDD's static weights
    and dynamic-weight MLPs, Hyper-Connections' weights) only if `decay_alphas` (the
    DenseFormer paper's code does not decay them)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if name.endswith(("dwa_alpha", "attnres_query", "attnres_key_norm", *hc.PARAMETERS)) \
                or name.startswith(("mudd_static.", "mudd_w1.", "mudd_w2.")):
            (decay if decay_alphas else no_decay).append(param)
        elif param.ndim >= 2:
            decay.append(param)
        else:
            no_decay.append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, optim_cfg) -> torch.optim.AdamW:
    """AdamW over `param_groups`, hyper-parameters from the `optim` config section; fused
    as `optim.fused` says (auto: where torch supports it, else foreach)."""
    groups = param_groups(model, optim_cfg.weight_decay, optim_cfg.decay_alphas)
    options = dict(lr=optim_cfg.lr, betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps)
    if optim_cfg.fused is False:
        return torch.optim.AdamW(groups, **options)
    try:  # torch checks the parameters' devices and dtypes against its fused kernels
        return torch.optim.AdamW(groups, fused=True, **options)
    except RuntimeError as err:
        if optim_cfg.fused is True:
            raise ConfigError("optim.fused", f"true, but torch {torch.__version__} has no "
                              f"fused AdamW for these parameters ({err}); use auto or "
                              "false") from None
        return torch.optim.AdamW(groups, **options)


def is_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is a torch optimizer running its fused kernels."""
    return bool(optimizer.defaults.get("fused"))


def step_if_finite(optimizer: torch.optim.Optimizer, norm: torch.Tensor) -> None:
    """Step the fused `optimizer` unless the gradient norm `norm` is not finite, decided on
    the device (no host sync): skipped, the step leaves parameters and AdamW state as they
    were, bitwise. torch's fused kernels read `found_inf`, the flag GradScaler sets."""
    optimizer.found_inf = (~torch.isfinite(norm)).to(torch.float32)
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """LR for optimizer step `step` (1-based): linear warmup, then cosine down to min_lr."""
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
