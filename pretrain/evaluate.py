"""Validation: mean next-token loss and perplexity over the validation split."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from data_pipeline import DataError


def autocast_for(device: torch.device, dtype: torch.dtype):
    """bf16 autocast context (fp32 runs get a no-op context)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


@torch.no_grad()
def evaluate(model, data_dir, local_batch: int, *, dp_rank: int, dp_size: int, dp_group,
             max_batches: int, device: torch.device, dtype: torch.dtype,
             seq_len: int | None = None) -> dict[str, float]:
    """{"val_loss", "val_ppl"}: token-mean loss over up to `max_batches` per rank.

    Samples are cut to `seq_len` + 1 tokens, as training cuts them (data may be prepared
    longer than the model). A data error on any rank is raised on every rank (DataError), so
    no rank waits for a peer that gave up."""
    # deferred: pulls in sentencepiece, wids (slow to start, or optional)
    from data_pipeline.loader import validation_batches

    was_training = model.training
    model.eval()
    total = torch.zeros(3, dtype=torch.float64, device=device)  # (loss sum, batches, failed)
    failure = None
    try:
        for batch in validation_batches(data_dir, local_batch, dp_rank=dp_rank,
                                        dp_size=dp_size, max_batches=max_batches):
            batch = batch[:, : None if seq_len is None else seq_len + 1].to(device)
            with autocast_for(device, dtype):
                total[0] += model.loss(batch[:, :-1], batch[:, 1:]).double()
            total[1] += 1
    except DataError as err:
        failure, total[2] = err, 1
    finally:
        model.train(was_training)
    if dp_size > 1:
        dist.all_reduce(total, group=dp_group)
    if failure is not None:
        raise failure
    if total[2]:
        raise DataError(f"reading the validation split of {data_dir} failed on another "
                        "data-parallel rank (its log names the shard)")
    if total[1] == 0:
        raise DataError(f"the validation split of {data_dir} has fewer than "
                        f"{local_batch * dp_size} samples: no validation batch")
    loss = (total[0] / total[1]).item()
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}
