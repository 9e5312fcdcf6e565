"""The pipeline schedule a layout runs, and whether its micro-batch count fits it.

Torch-free and import-free, so config validation (pretrain/config/validation.py) can check a
layout without loading the pipeline planner.
"""

from __future__ import annotations


def schedule_name(pp: int, virtual_stages: int, microbatches: int) -> str:
    """The torch.distributed.pipelining schedule used for this layout."""
    if virtual_stages > 1:
        return "ScheduleInterleaved1F1B"
    return "Schedule1F1B" if microbatches >= pp else "ScheduleGPipe"


def schedule_problem(pp: int, virtual_stages: int, microbatches: int) -> str | None:
    """Why `microbatches` does not fit the schedule (None if it does)."""
    if virtual_stages > 1 and pp > 1:
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            return (f"interleaved 1F1B runs micro-batches in rounds of pp={pp}: "
                    f"{microbatches} is not a multiple of its {rounds} rounds; use a "
                    f"multiple of {pp} or fewer than {2 * pp}")
    return None
