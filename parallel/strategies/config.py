"""The `parallel` section of the run config: the strategies' own settings (tensor, pipeline
and data parallelism, ZeRO, activation checkpointing, collective timeouts).

The run config (pretrain/config/sections.py) composes it as `Config.parallel`; the
strategies take this section, or plain values, never the whole run config. Each numeric
key states its valid range next to its default (`ranged`); checks across sections live in
pretrain/config/validation.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pretrain.model.config import ranged


@dataclass
class ParallelSection:
    tp: int = ranged(1, ge=1, also="divides model.n_heads and the padded vocabulary")
    pp: int = ranged(1, ge=1, also="<= model.n_layers")
    # Per data-parallel rank per step (= gradient accumulation). auto: the fewest whose
    # size fits the GPU, from its free memory and the estimator
    # (parallel/strategies/microbatch_fit.py).
    microbatches: int | Literal["auto"] = ranged(
        1, ge=1, also="divides train.batch_size; with virtual_stages > 1, a multiple of pp "
                      "or < 2 x pp")
    zero_stage: int = ranged(0, ge=0, le=3, also="2 and 3 only with tp = pp = 1")
    # Without ZeRO, how gradients are averaged over data parallelism: torch DDP, in buckets
    # during the backward (interleaved pipelines fall back to flat), or one flat all-reduce
    # after the backward (parallel/strategies/ddp.py).
    dp_reduction: Literal["ddp", "flat"] = "ddp"
    sequence_parallel: bool = False
    # Pipeline (docs/pipeline.md): stages per pipeline rank (> 1: interleaved 1F1B), blocks
    # per stage in order (null: balanced), and what crosses stage boundaries.
    virtual_stages: int = ranged(1, ge=1, also="> 1 needs pp > 1; pp x virtual_stages <= "
                                                    "model.n_layers")
    pp_split: list[int] | None = None
    pp_transfer: Literal["optimal", "raw"] = "optimal"
    # The dtype of the tensors crossing a stage boundary (both directions): the compute
    # dtype (bf16 under bf16 autocast: half the traffic; widened back on receipt) or fp32.
    pipeline_dtype: Literal["compute", "fp32"] = "compute"
    # Activation checkpointing (parallel/strategies/checkpointing.py): recompute units of
    # `checkpoint_every` blocks in backward; dwa_block also recomputes the DWA before a unit.
    activation_checkpointing: Literal["none", "block", "dwa_block"] = "none"
    checkpoint_every: int = ranged(1, ge=1, also="<= model.n_layers; 1 with pp > 1")
    # Timeout of every collective (world, megatron-core and DeepSpeed groups): a hung or
    # stopped peer ends the job after this long instead of holding every rank (a day at most:
    # longer is a hang, not a slow collective).
    timeout_s: int = ranged(600, ge=1, le=86400)
