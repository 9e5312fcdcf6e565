"""Layout-independent weight initialisation.

Every parameter is drawn as the FULL tensor from a generator seeded by (seed, global name),
then this rank's tensor-parallel shard is taken, so every layout (TP, PP, DP) starts from the
single-process weights. GPT-2 init: N(0, std) for matmul weights and the embedding,
N(0, std / sqrt(2 d)) for the residual output projections, ones for norms and gains, and the
DWA alphas from the config's `DWAPattern.initial_alpha` (identity: alpha[i, i] = 1);
zeros for the Attention Residuals queries (their key norms: ones, as every norm); for MUDD
(pretrain/model/mudd.py) the static weights a_i 1 on X_i and 0 elsewhere, W1_i N(0, std),
W2_i zeros (so the model equals the Transformer at init); the Hyper-Connections' weights as
pretrain/model/hc.py says (`initial_value`).
"""

from __future__ import annotations

import hashlib
import math
from typing import Iterable

import torch

from pretrain.model import hc
from pretrain.model.config import DenseFormerConfig
from pretrain.model.mudd import initial_static

_RESIDUAL_PROJECTIONS = ("attn.proj.weight", "mlp.fc_out.weight")
_NORMAL = ("attn.qkv.weight", "mlp.fc_in.weight", "mlp.gate.weight", "mlp.up.weight",
           "embedding.weight", "lm_head.weight") + _RESIDUAL_PROJECTIONS


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def full_shape(param: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    """Shape of the unsharded tensor behind this rank's parameter."""
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_size
    return tuple(shape)


def local_shard(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int):
    """This rank's slice of a full tensor (the full tensor itself if not TP-sharded)."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    return full.chunk(tp_size, dim=param.partition_dim)[tp_rank]


def full_init_value(name: str, shape: tuple[int, ...], cfg: DenseFormerConfig, seed: int):
    """The initial value of the full parameter called `name` (a global, layout-free name)."""
    if name == "dwa_alpha":
        return torch.tensor(cfg.dwa_pattern.initial_alpha(), device="cpu")
    if name == "attnres_query":  # uniform depth attention at init (pretrain/model/attnres.py)
        return torch.zeros(shape)
    if name.startswith("mudd_static."):
        return initial_static(shape)
    if name.startswith("mudd_w2."):
        return torch.zeros(shape)
    if name in hc.PARAMETERS:
        return hc.initial_value(name, cfg.hc_layout, shape)
    if name.endswith(_NORMAL) or name.startswith("mudd_w1."):
        std = cfg.init_std
        if name.endswith(_RESIDUAL_PROJECTIONS):
            std /= math.sqrt(2 * cfg.n_layers)
        return torch.empty(shape).normal_(0.0, std, generator=_generator(seed, name))
    if "norm" in name or "skip_gain" in name:
        return torch.ones(shape)
    raise KeyError(f"no initialisation rule for parameter {name!r}")


@torch.no_grad()
def init_parameters(named_params: Iterable[tuple[str, torch.Tensor]], cfg: DenseFormerConfig,
                    seed: int, tp_rank: int, tp_size: int) -> None:
    """Fill each (global name, parameter) with its layout-independent initial value."""
    for name, param in named_params:
        if param.is_meta:
            continue
        full = full_init_value(name, full_shape(param, tp_size), cfg, seed)
        param.copy_(local_shard(full, param, tp_rank, tp_size))
