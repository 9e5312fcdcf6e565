"""Validation: mean next-token loss and perplexity over the validation split."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist


def autocast_for(device: torch.device, dtype: torch.dtype):
    """bf16 autocast context (fp32 runs get a no-op context)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


@torch.no_grad()
def evaluate(model, data_dir, local_batch: int, *, dp_rank: int, dp_size: int, dp_group,
             max_batches: int, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """{"val_loss", "val_ppl"}: token-mean loss over up to `max_batches` per rank."""
    from data_pipeline.loader import validation_batches

    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of losses, batches)
    for batch in validation_batches(data_dir, local_batch, dp_rank=dp_rank, dp_size=dp_size,
                                    max_batches=max_batches):
        batch = batch.to(device)
        with autocast_for(device, dtype):
            total[0] += model.loss(batch[:, :-1], batch[:, 1:]).double()
        total[1] += 1
    model.train(was_training)
    if dp_size > 1:
        dist.all_reduce(total, group=dp_group)
    if total[1] == 0:
        raise ValueError(f"the validation split of {data_dir} has fewer than "
                         f"{local_batch * dp_size} samples: no validation batch")
    loss = (total[0] / total[1]).item()
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}
