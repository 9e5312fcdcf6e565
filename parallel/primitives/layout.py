"""Where a process sits in the TP x DP x PP grid, and the gradient reductions that depend
on it (data-parallel mean, global gradient norm). Used by the training loop."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from parallel.primitives import groups


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


def setup_layout(tp: int = 1, pp: int = 1, timeout_s: int = 600,
                 device: torch.device | None = None) -> Layout:
    """Initialise process groups for a TP x PP layout (the world size from the launcher;
    data parallelism takes the rest) and say where this process sits. `timeout_s` bounds
    every collective; `device` defaults to `groups.default_device()`."""
    groups.ensure_initialized(tp=tp, pp=pp, timeout_s=timeout_s)
    return Layout(world=dist.get_world_size(), rank=dist.get_rank(), tp=tp,
                  tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                  tp_src=parallel_state.get_tensor_model_parallel_src_rank(),
                  tp_group=parallel_state.get_tensor_model_parallel_group(),
                  dp=parallel_state.get_data_parallel_world_size(),
                  dp_rank=parallel_state.get_data_parallel_rank(),
                  dp_group=parallel_state.get_data_parallel_group(),
                  device=groups.default_device() if device is None else device, pp=pp)


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
