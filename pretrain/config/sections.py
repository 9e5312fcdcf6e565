"""The sections of the run config, one dataclass each, and the Config that holds them.

Each component owns its section's type: the model section is `DenseFormerConfig` itself
(pretrain/model/config.py), so a field added to the model is a config key at once (its
vocab_size may be null, taken from the data), and the parallel section is the strategies'
`ParallelSection` (parallel/strategies/config.py). The rest are the run's own.
"""

from __future__ import annotations

import dataclasses
import keyword
import typing
from dataclasses import dataclass, field
from typing import Literal

from parallel.strategies.config import ParallelSection
from pretrain.model.config import DenseFormerConfig, ranged


@dataclass
class RunSection:
    dir: str | None = None  # None: runs/<name>-<timestamp>, decided by the trainer
    name: str = "denseformer"


@dataclass
class DataSection:
    path: str | None = None  # a tokenised dataset directory (data_pipeline output)
    num_workers: int = ranged(0, ge=0)
    val_batches: int = ranged(20, ge=0)  # batches per validation; 0 switches validation off


@dataclass
class OptimSection:
    lr: float = ranged(1e-3, gt=0)
    min_lr: float = ranged(1e-4, ge=0, also="<= optim.lr")  # floor of the cosine decay
    # None: 5% of train.steps
    warmup_steps: int | None = ranged(None, ge=0, also="< train.steps")
    beta1: float = ranged(0.9, ge=0, lt=1)
    beta2: float = ranged(0.95, ge=0, lt=1)
    eps: float = ranged(1e-8, gt=0)
    weight_decay: float = ranged(0.1, ge=0)
    decay_alphas: bool = False  # weight decay on DWA alphas (the paper's code does not)
    grad_clip: float = ranged(1.0, ge=0)  # max global grad norm; 0 disables clipping
    # torch's fused AdamW (one kernel per step; skips a non-finite step on the device):
    # auto uses it wherever this torch has it for the parameters' device, else foreach.
    fused: bool | Literal["auto"] = "auto"


@dataclass
class TrainSection:
    steps: int = ranged(100, ge=1)
    seed: int = ranged(0, ge=0)  # the data order's numpy SeedSequence needs >= 0
    # The global batch in sequences, whatever the layout.
    batch_size: int = ranged(8, ge=1, also="a multiple of dp x parallel.microbatches")
    resume: str | None = None  # None, "auto" (latest checkpoint of run.dir) or a checkpoint path
    # A checkpoint or run directory whose model weights start a new run (fresh optimizer,
    # step 0; pretrain/init_from.py); ignored by a run that resumes from its own checkpoint.
    init_from: str | None = None
    # Stop (checkpoint and exit) after this step; the schedule uses steps.
    stop_at: int | None = ranged(None, ge=1, also="<= train.steps")
    eval_every: int = ranged(0, ge=0)  # 0: validate only at the end (when data.val_batches > 0)
    log_every: int = ranged(10, ge=1)
    dtype: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    on_nan: Literal["stop", "skip"] = "stop"
    # on_nan=skip: more skipped steps in a row than this stops the run (exit 3)
    max_consecutive_skips: int = ranged(10, ge=0)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # torch.compile (parallel/strategies/compile.py): none, each block (DWAs eager), or the model's
    # whole loss (blocks, DWAs and head in one graph per micro-batch); the backend, e.g. aot_eager
    # to check a model traces without generating code. auto (parallel/strategies/compile_choice.py):
    # model or blocks on CUDA, none on CPU and with ZeRO-3.
    compile: Literal["auto", "none", "blocks", "model"] = "auto"
    compile_backend: str = "inductor"


@dataclass
class CheckpointSection:
    every: int = ranged(0, ge=0)  # 0: only at the end (or at stop_at / on a stop signal)
    keep: int = ranged(3, ge=0)  # newest complete checkpoints kept; 0 keeps all
    # The key `checkpoint.async` (a Python keyword: `field_name`): write checkpoints in the
    # background while training goes on; auto: on with CUDA, off on CPU.
    async_: bool | Literal["auto"] = "auto"


@dataclass
class TrackingSection:
    uri: str | None = None  # None: sqlite:///<run.dir>/mlflow.db
    experiment: str = "denseformer"
    enabled: bool = True
    # false: an unreachable tracking server costs one warning (metrics.jsonl is still written)
    required: bool = True


@dataclass
class Config:
    run: RunSection = field(default_factory=RunSection)
    model: DenseFormerConfig = field(default_factory=DenseFormerConfig)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)

    def effective_warmup_steps(self) -> int:
        """optim.warmup_steps, or round(5% of train.steps) when it is null."""
        if self.optim.warmup_steps is not None:
            return self.optim.warmup_steps
        return round(0.05 * self.train.steps)

    def layout_tag(self, world_size: int) -> str:
        """The layout as a short string, e.g. "tp2-pp2-dp2"."""
        dp = world_size // (self.parallel.tp * self.parallel.pp)
        return f"tp{self.parallel.tp}-pp{self.parallel.pp}-dp{dp}"


def field_name(key_name: str) -> str:
    """The dataclass field behind a key's name: a Python keyword gets a trailing underscore
    (`checkpoint.async` is `CheckpointSection.async_`)."""
    return f"{key_name}_" if keyword.iskeyword(key_name) else key_name


def key_name(field: str) -> str:
    """The name a dataclass field has as a config key (`field_name` undone)."""
    return field[:-1] if field.endswith("_") and keyword.iskeyword(field[:-1]) else field


SECTIONS: dict[str, type] = {
    f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}

# Keys that may legitimately change when a run is resumed; left out of the MLflow params.
RUN_CONTROL_KEYS = ("run.dir", "train.resume", "train.init_from", "train.stop_at",
                    "data.num_workers", "tracking.*", "checkpoint.*")
