"""Data-parallel gradient averaging through torch's DistributedDataParallel (ZeRO off).

DDP registers a hook per parameter and all-reduces gradients in buckets (`bucket_cap_mb`)
as soon as a bucket's gradients are ready, so the reduction overlaps the rest of the
backward; with `gradient_as_bucket_view` the `.grad` tensors are views into the buckets, so
no second copy of the gradients exists (the earlier path, `parallel.dp_reduction: flat`,
flattens every gradient into one more buffer and reduces it after the backward). It averages
over the data-parallel group only: tensor-parallel shards stay shards, and the sums over the
TP group (sequence-parallel norms), the pipeline group (alphas) and the embedding group (the
tied embedding) happen after it, on the averaged values, as before.

Two ways in:
- the whole model on this rank: `ddp_loss(model, layout)` wraps a module whose forward is
  the model's loss, and the micro-batches but the last run under `no_sync()`;
- a pipeline stage: DDP around the `StageModule`; torch.distributed.pipelining recognises it
  and itself skips the reduction for all but a stage's last backward. With interleaved
  stages (`parallel.virtual_stages > 1`) every stage module of a rank reads the same
  `StageModel` (its alphas and, on the first and last rank, the embedding), which two DDP
  instances cannot share: those layouts keep the flat reduction (the trainer logs it).

DDP's gradient average divides before it sums (`grad / dp`, then all-reduce), where the flat
path sums then divides: results differ in the last bits (tests/test_ddp.py: 1e-6 relative).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

BUCKET_CAP_MB = 25  # DDP's default; Megatron's DDP uses 40 M elements at scale


def wrap(module: nn.Module, dp_group, find_unused_parameters: bool) -> DistributedDataParallel:
    """`module` under DDP over `dp_group`: gradients as bucket views, buffers not broadcast
    before each forward (the RoPE tables and DWA mask are constants, equal on every rank)."""
    return DistributedDataParallel(
        module, process_group=dp_group, forward_sync_buffers=False, gradient_as_bucket_view=True,
        bucket_cap_mb=BUCKET_CAP_MB, find_unused_parameters=find_unused_parameters)


class _Loss(nn.Module):
    """The model with its loss as forward: DDP's hooks run only through `forward`."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model.loss(tokens, targets)


class DDPLoss:
    """`loss(tokens, targets)` through DDP, and the context of each micro-batch: the gradient
    reduction waits for the last one."""

    def __init__(self, model: nn.Module, dp_group):
        self.ddp = wrap(_Loss(model), dp_group, find_unused_parameters=False)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.ddp(tokens, targets)

    def micro_batch(self, last: bool):
        return contextlib.nullcontext() if last else self.ddp.no_sync()
