"""Where a process sits in the TP x DP x PP grid, and the gradient reductions that depend
on it (data-parallel mean, global gradient norm). Used by the training loop."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.primitives import groups
from pretrain.config import Config, ConfigError


@dataclass
class Layout:
    """Where this process sits in the rank grid."""

    world: int
    rank: int
    tp: int
    tp_rank: int
    tp_src: int  # global rank of TP rank 0 in this rank's TP group (it reads the data)
    tp_group: object
    dp: int
    dp_rank: int
    dp_group: object
    device: torch.device
    pp: int = 1

    @property
    def name(self) -> str:
        return f"tp{self.tp}-pp{self.pp}-dp{self.dp}"  # as Config.layout_tag

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_layout(cfg: Config) -> Layout:
    """Initialise process groups for the configured layout (world size from the launcher)."""
    from megatron.core import parallel_state

    device = groups.default_device()
    if cfg.train.device == "cpu":
        device = torch.device("cpu")
    elif cfg.train.device == "cuda" and device.type != "cuda":
        raise ConfigError("train.device", "cuda requested but no CUDA device is available")
    groups.ensure_initialized(tp=cfg.parallel.tp, pp=cfg.parallel.pp,
                              timeout_s=cfg.parallel.timeout_s)
    return Layout(world=dist.get_world_size(), rank=dist.get_rank(), tp=cfg.parallel.tp,
                  tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                  tp_src=parallel_state.get_tensor_model_parallel_src_rank(),
                  tp_group=parallel_state.get_tensor_model_parallel_group(),
                  dp=parallel_state.get_data_parallel_world_size(),
                  dp_rank=parallel_state.get_data_parallel_rank(),
                  dp_group=parallel_state.get_data_parallel_group(), device=device,
                  pp=cfg.parallel.pp)


def gradient_norm(model, layout: Layout) -> torch.Tensor:
    """Global L2 norm of the gradients: TP-sharded tensors summed over the TP group,
    replicated ones counted once; under PP, summed over the stages (copies that the pipeline
    marks as duplicates, such as the tied embedding on the last stage, counted once)."""
    sharded = torch.zeros((), dtype=torch.float64, device=layout.device)
    replicated = torch.zeros((), dtype=torch.float64, device=layout.device)
    for p in model.parameters():
        if p.grad is None or getattr(p, "pipeline_duplicate", False):
            continue
        sq = p.grad.detach().double().square().sum()
        if getattr(p, "tensor_model_parallel", False):
            sharded += sq
        else:
            replicated += sq
    if layout.tp > 1:
        dist.all_reduce(sharded, group=layout.tp_group)
    total = sharded + replicated
    if layout.pp > 1:
        dist.all_reduce(total, group=model.pp_group)
    return total.sqrt()


def average_gradients(model, layout: Layout) -> None:
    """Mean of the gradients over the data-parallel group (one flat bucket)."""
    if layout.dp == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    groups.allreduce_in_one_bucket(grads, layout.dp_group, divide_by=layout.dp)
