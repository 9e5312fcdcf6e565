"""`parallel.microbatches: auto`: the fewest micro-batches whose size fits the device.

Fewer, larger micro-batches keep a GPU's matmuls large (well-tuned stacks run 32K-65K tokens
per micro-batch); too large a one runs out of memory. At start-up, before the model is
built, every rank reads its free device memory (`torch.cuda.mem_get_info`); the least over
all ranks is the budget, of which `FILL` is used (the rest absorbs the allocator's rounding
and fragmentation, and what the estimate leaves out). The choice is the smallest count M
that splits each data-parallel rank's share of `train.batch_size` evenly, suits the pipeline
schedule, and whose estimate (parallel/strategies/memory.py: parameters, gradients, optimizer state,
activations, autocast's weight copies, the chunked loss's working set; the largest rank) fits
the budget. Gradient accumulation over the M micro-batches keeps `train.batch_size` the
global batch, so the optimisation is the same whatever M is chosen.

There is no memory figure on a CPU: `auto` there is a config error naming the key.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from parallel.primitives.layout import Layout
from parallel.strategies.config import ParallelSection
from parallel.strategies.memory import estimate
from parallel.strategies.schedule import schedule_problem
from pretrain.model.config import ConfigError, DenseFormerConfig

AUTO = "auto"
FILL = 0.85  # of the least free device memory over the ranks


@dataclasses.dataclass(frozen=True)
class Batch:
    """What the estimate needs of the training run beyond the parallel section: the global
    batch in sequences (train.batch_size), train.dtype and optim.decay_alphas."""

    size: int
    dtype: str = "auto"
    decay_alphas: bool = False


def candidates(parallel: ParallelSection, batch_size: int, dp: int) -> list[int]:
    """Micro-batch counts in increasing order that split a DP rank's share of `batch_size`
    evenly and suit the pipeline schedule."""
    p = parallel
    local = batch_size // dp
    return [m for m in range(1, local + 1) if local % m == 0
            and schedule_problem(p.pp, p.virtual_stages, m) is None]


def with_microbatches(parallel: ParallelSection, microbatches: int) -> ParallelSection:
    """A copy of `parallel` with microbatches set."""
    return dataclasses.replace(parallel, microbatches=microbatches)


def estimated_peak(parallel: ParallelSection, model: DenseFormerConfig, batch: Batch,
                   world_size: int) -> int:
    """The estimator's largest per-rank total (bytes) on CUDA."""
    return max(r.total_bytes for r in estimate(parallel, model, batch.size, batch.dtype,
                                               world_size, "cuda", batch.decay_alphas))


def fit_microbatches(parallel: ParallelSection, model: DenseFormerConfig, batch: Batch,
                     world_size: int, free_bytes: int) -> tuple[int, int]:
    """(M, its estimated peak bytes): the fewest micro-batches that fit FILL x `free_bytes`;
    ConfigError naming parallel.microbatches when even one sequence per micro-batch does
    not."""
    p = parallel
    dp = world_size // (p.tp * p.pp)
    budget = int(FILL * free_bytes)
    counts = candidates(p, batch.size, dp)
    peak = None
    for m in counts:
        peak = estimated_peak(with_microbatches(p, m), model, batch, world_size)
        if peak <= budget:
            return m, peak
    raise ConfigError("parallel.microbatches", (
        f"auto: no micro-batch count fits {FILL:.0%} of the {free_bytes / 2**30:.1f} GiB "
        f"free on the fullest device; with {counts[-1] if counts else 1} micro-batches of "
        f"{batch.size // dp // max(1, counts[-1] if counts else 1)} sequence(s) "
        f"the estimate is {(peak or 0) / 2**30:.1f} GiB: use more ranks, activation "
        "checkpointing or ZeRO"))


def least_free_bytes(device: torch.device) -> int:
    """Free memory of this rank's CUDA device, the least over all ranks (a collective)."""
    free = torch.tensor(torch.cuda.mem_get_info(device)[0], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(free, op=dist.ReduceOp.MIN)
    return int(free.item())


def resolve_microbatches(parallel: ParallelSection, model: DenseFormerConfig, batch: Batch,
                         layout: Layout) -> tuple[ParallelSection, str | None]:
    """`parallel` with microbatches: auto replaced by the fitted count (other values:
    `parallel` itself); (section, a line for the log or None)."""
    if parallel.microbatches != AUTO:
        return parallel, None
    if layout.device.type != "cuda":
        raise ConfigError("parallel.microbatches", f"auto needs a CUDA device to read its free "
                          f"memory; this run is on {layout.device.type}: give a number")
    free = least_free_bytes(layout.device)
    m, peak = fit_microbatches(parallel, model, batch, layout.world, free)
    local = batch.size // layout.dp
    line = (f"parallel.microbatches: auto -> {m} micro-batches of {local // m} sequences "
            f"(estimated peak {peak / 2**30:.1f} GiB of {FILL:.0%} x "
            f"{free / 2**30:.1f} GiB free on the fullest device)")
    return with_microbatches(parallel, m), line
