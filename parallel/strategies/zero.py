"""DeepSpeed ZeRO for the training loop: an engine configured from our config.

    zero = ZeroEngine(model, optimizer, cfg.parallel, cfg.train.batch_size, cfg.optim.grad_clip,
                      dtype=torch.float32)   # after groups are up
    for tokens, targets in micro_batches:
        zero.backward(zero.loss(tokens, targets))    # scaled by 1 / parallel.microbatches
    grad_norm = zero.step()                          # DP reduction, clipping, AdamW update

Ours stays the single source of truth: the AdamW parameter groups (`pretrain.optim`:
DeepSpeed wraps the client optimizer we build), the learning rate (the trainer writes it into
the param groups every step; DeepSpeed gets no scheduler), gradient clipping (`optim.grad_clip`
becomes DeepSpeed's `gradient_clipping`, whose default would be 1.0), and the checkpoint
format: each rank saves and loads its own partition under the layout-free keys of every
other engine (pretrain/zero_checkpoint.py, reading DeepSpeed's internals through
parallel/primitives/deepspeed_compat.py), so a ZeRO-2 run at DP=2 resumes at DP=1 without ZeRO and
back. `full_model_state`, `full_optimizer_state` and `load_full_state` move whole tensors
(gathered over DP and TP) for comparisons with a single-process run. The DeepSpeed config
is built here (`deepspeed_config`), never written by hand.

Stages: 1 (optimizer state sharded over the DP group), 2 (+ gradients), 3 (+ parameters).
With TP or PP only stage 1 (config validation refuses 2 and 3, as GPT-NeoX does).
parallel.zero_stage=0 means no DeepSpeed at all: the trainer then averages gradients over
DP and steps our AdamW itself (`AdamWUpdate`, pretrain/engine.py) and never builds a
ZeroEngine. The model-parallel groups reach DeepSpeed through `mpu`
(`MegatronMPU`: megatron-core's parallel_state lacks the `get_model_parallel_*` names).

Gradient accumulation is DeepSpeed's "unmanaged" mode: `backward` accumulates locally and
`step` is the accumulation boundary. Stage 1 keeps plain `.grad` tensors until `step`,
so the sequence-parallel reduction (`parallel.primitives.tensor`) and an external pipeline schedule
(docs/pipeline.md: backward outside the engine, gradients already the mean over
micro-batches, then `step`) need nothing else.

Precision: fp32, or DeepSpeed's bf16 mode (bf16 parameters and gradients, fp32 master
weights and AdamW moments inside the ZeRO optimizer; non-finite gradients skip the update).

On CPU DeepSpeed JIT-compiles a small communication op the first time (about 40-50 s) into
TORCH_EXTENSIONS_DIR, which defaults here to `<repo>/.torch_extensions`; build it ahead with
`python -m parallel.zero --build-ops`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import nn

from parallel.primitives.deepspeed_compat import (
    create_optimizer_state,
    relink_optimizer_state,
    update_count,
)
from parallel.strategies.config import ParallelSection
from pretrain.model.init import local_shard
from pretrain.model.state import _gather_full

_REPO = Path(__file__).resolve().parents[2]  # parallel/strategies/zero.py -> the checkout
if (_REPO / "pyproject.toml").exists():  # a checkout: keep the JIT-built op next to it
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(_REPO / ".torch_extensions"))


class MegatronMPU:
    """megatron-core's parallel_state under the names DeepSpeed calls as its `mpu`.

    Data parallel is the DP group; "model parallel" is the TP x PP group (DeepSpeed sums
    gradient norms over it and counts replicated parameters on tensor-parallel rank 0).
    Given these, DeepSpeed 0.19.8 creates no process group of its own (its `new_group` calls
    pass no timeout, so they would get torch's 30 minutes): every collective it issues runs
    on megatron-core's groups or torch's default group, both built with parallel.timeout_s
    (tests/test_timeouts.py reads the timeout of every group after a ZeRO step)."""

    def __init__(self):
        self.state = parallel_state

    def get_data_parallel_group(self):
        return self.state.get_data_parallel_group()

    def get_data_parallel_world_size(self) -> int:
        return self.state.get_data_parallel_world_size()

    def get_data_parallel_rank(self) -> int:
        return self.state.get_data_parallel_rank()

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(dist.get_process_group_ranks(self.get_data_parallel_group()))

    def get_model_parallel_group(self):
        return self.state.get_model_parallel_group()

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self.get_model_parallel_group())

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(self.get_model_parallel_group())

    def get_tensor_model_parallel_group(self):
        return self.state.get_tensor_model_parallel_group()

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.state.get_tensor_model_parallel_world_size()

    def get_tensor_model_parallel_rank(self) -> int:
        return self.state.get_tensor_model_parallel_rank()

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.state.get_tensor_model_parallel_src_rank()

    def get_pipeline_model_parallel_group(self):
        return self.state.get_pipeline_model_parallel_group()

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.state.get_pipeline_model_parallel_world_size()

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.state.get_pipeline_model_parallel_rank()

    get_pipe_parallel_group = get_pipeline_model_parallel_group
    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size
    get_pipe_parallel_rank = get_pipeline_model_parallel_rank


def deepspeed_config(parallel: ParallelSection, batch_size: int, grad_clip: float, dp: int,
                     dtype: torch.dtype = torch.float32) -> dict:
    """The DeepSpeed config of a run: batch split, clipping, ZeRO stage, precision.

    `batch_size` is train.batch_size, `grad_clip` optim.grad_clip; `dp` the data-parallel
    size."""
    p, stage = parallel, parallel.zero_stage
    per_rank = batch_size // dp
    zero = {"stage": stage}
    if stage == 3:
        # Every parameter is partitioned, the small norm weights and alphas too (DeepSpeed's
        # default keeps tensors under 1e5 elements whole on every rank): what each rank holds
        # is then exactly 1/DP of each tensor, as parallel/strategies/memory.py counts it.
        zero["stage3_param_persistence_threshold"] = STAGE3_PERSISTENCE_THRESHOLD
    return {
        "train_batch_size": batch_size,
        "train_micro_batch_size_per_gpu": per_rank // p.microbatches,
        "gradient_accumulation_steps": p.microbatches,
        "managed_gradient_accumulation": False,
        "gradient_clipping": grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == torch.bfloat16, "check_grad_overflow": True},
        "zero_allow_untested_optimizer": True,  # our torch AdamW with its decay groups
        "steps_per_print": 2**31 - 1,  # our trainer logs
        "wall_clock_breakdown": False,
    }


STAGE3_PERSISTENCE_THRESHOLD = 0


class LossModule(nn.Module):
    """The module DeepSpeed wraps: forward(tokens, targets) is the model's mean loss.

    Under ZeRO-3 DeepSpeed gathers a module's parameters around that module's forward; the
    tied LM head reads the embedding weight outside the embedding module and the alphas
    belong to the root, so those are registered as external parameters of this module."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model.loss(tokens, targets)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """As `DenseFormer.loss`, through DeepSpeed's module hooks (for evaluation)."""
        return self(tokens, targets)


def _external_parameters(model: nn.Module) -> list[nn.Parameter]:
    params = list(model.parameters(recurse=False))
    # The tied head reads the embedding weight, an untied one its own, outside their modules.
    for name in ("embedding", "lm_head"):
        module = getattr(model, name, None)
        if module is not None:
            params.append(module.weight)
    return params


def _quiet_deepspeed() -> None:
    # deferred: pulls in DeepSpeed (slow to start, or optional)
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)


class ZeroEngine:
    """A DeepSpeed engine around `model` and our AdamW `optimizer` (see the module doc)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 parallel: ParallelSection, batch_size: int, grad_clip: float,
                 dtype: torch.dtype = torch.float32):
        # deferred: pulls in DeepSpeed (slow to start, or optional)
        import deepspeed

        if parallel.zero_stage not in (1, 2, 3):
            raise ValueError(f"ZeroEngine needs parallel.zero_stage 1, 2 or 3, got "
                             f"{parallel.zero_stage} (0 trains without DeepSpeed)")
        _quiet_deepspeed()
        if "LOCAL_RANK" not in os.environ:
            if dist.get_world_size() > 1:
                raise RuntimeError("DeepSpeed needs LOCAL_RANK for a multi-rank world: launch "
                                   "with torchrun or set it per process")
            os.environ["LOCAL_RANK"] = "0"  # a 1-process world (plain `python`)
        self.mpu = MegatronMPU()
        for param in model.parameters():
            # Copies a pipeline keeps on several stages (alpha, the tied embedding) count once
            # in DeepSpeed's gradient norm, as in parallel.primitives.layout.gradient_norm.
            if getattr(param, "pipeline_duplicate", False):
                param.ds_pipe_replicated = True
        self.stage = parallel.zero_stage
        self.dtype = dtype
        self.model = model
        self.module = LossModule(model)
        self.config = deepspeed_config(parallel, batch_size, grad_clip,
                                       self.mpu.get_data_parallel_world_size(), dtype)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=self.module, optimizer=optimizer, config=self.config, mpu=self.mpu,
            dist_init_required=False)
        self.client_optimizer = optimizer  # its param groups now hold DeepSpeed's flat copies
        if self.stage == 3:
            # deferred: pulls in DeepSpeed (slow to start, or optional)
            from deepspeed.runtime.zero import register_external_parameter

            for param in _external_parameters(model):
                register_external_parameter(self.module, param)

    # -- one training step ---------------------------------------------------------------

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss of one micro-batch (forward through the engine)."""
        return self.engine(tokens, targets)

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate this micro-batch's gradients, scaled by 1 / parallel.microbatches."""
        self.engine.backward(loss)

    def set_lr(self, lr: float) -> None:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> float:
        """Reduce gradients over DP, clip, update; the global gradient norm before clipping.

        A non-finite norm means DeepSpeed skipped the update (weights and AdamW state
        unchanged); the gradients are cleared either way."""
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        self.engine.zero_grad()
        return float(norm) if norm is not None else float("nan")

    # -- layout-independent state --------------------------------------------------------

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """{name: full fp32 tensor}, as `pretrain.model.state.full_model_state` (collective:
        gathered over DP where ZeRO partitions, and over TP)."""
        # deferred: pulls in DeepSpeed (slow to start, or optional)
        from deepspeed.utils import safe_get_full_fp32_param

        tp_group = self.mpu.get_tensor_model_parallel_group()
        state = {}
        for name, param in self.model.named_parameters():
            value = safe_get_full_fp32_param(param)
            state[name] = _gather_full(param, value.float(), tp_group)
        return state

    def full_optimizer_state(self) -> dict:
        """AdamW state {name: {"step", "exp_avg", "exp_avg_sq"}} with full tensors, as
        `pretrain.model.state.full_optimizer_state`; empty before the first update."""
        # deferred: pulls in DeepSpeed (slow to start, or optional)
        from deepspeed.utils import safe_get_full_optimizer_state

        step = update_count(self.engine.optimizer)
        if step is None:
            return {}
        relink_optimizer_state(self.engine.optimizer)
        tp_group = self.mpu.get_tensor_model_parallel_group()
        state = {}
        for name, param in self.model.named_parameters():
            state[name] = {"step": step.clone()}
            for key in ("exp_avg", "exp_avg_sq"):
                value = safe_get_full_optimizer_state(param, key)
                state[name][key] = _gather_full(param, value.float(), tp_group)
        return state

    def load_full_state(self, model_state: dict, optimizer_state: dict) -> None:
        """Set parameters (model copy and fp32 master) and AdamW state from full tensors."""
        # deferred: pulls in DeepSpeed (slow to start, or optional)
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        model = self.model
        params = dict(model.named_parameters())
        missing = sorted(params.keys() - model_state.keys())
        if missing:  # a pipeline stage holds a subset of the names: the rest is not ours
            raise KeyError(f"model state lacks {missing[:5]}")
        device = next(iter(params.values())).device
        for name, param in params.items():
            shard = local_shard(model_state[name], param, model.tp_rank, model.tp_size)
            shard = shard.to(device=device, dtype=torch.float32)
            with self._whole(param):
                param.data.copy_(shard.view(param.shape).to(param.dtype))
            safe_set_full_fp32_param(param, shard)
        if not optimizer_state:
            return
        steps = {float(s["step"]) for s in optimizer_state.values()}
        if len(steps) != 1:
            raise ValueError(f"optimizer state has different step counts {sorted(steps)}")
        create_optimizer_state(self.engine.optimizer, steps.pop())
        for name, param in params.items():
            for key in ("exp_avg", "exp_avg_sq"):
                shard = local_shard(optimizer_state[name][key], param, model.tp_rank,
                                    model.tp_size)
                safe_set_full_optimizer_state(param, shard.to(device=device,
                                                              dtype=torch.float32), key)

    @contextlib.contextmanager
    def gathered_parameters(self):
        """Every parameter whole on every rank (ZeRO-3 all-gathers; other stages: no-op)."""
        if self.stage != 3:
            yield
            return
        # deferred: pulls in DeepSpeed (slow to start, or optional)
        from deepspeed.runtime.zero import GatheredParameters

        with GatheredParameters(list(self.model.parameters())):
            yield

    def _whole(self, param: nn.Parameter):
        """Context in which a ZeRO-3 parameter is whole; writes by rank 0 are partitioned."""
        if self.stage != 3:
            return contextlib.nullcontext()
        # deferred: pulls in DeepSpeed (slow to start, or optional)
        from deepspeed.runtime.zero import GatheredParameters

        return GatheredParameters([param], modifier_rank=0)


def build_ops() -> None:
    """JIT-build DeepSpeed's CPU communication op into TORCH_EXTENSIONS_DIR (once)."""
    # deferred: pulls in DeepSpeed (slow to start, or optional)
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        print("no DeepSpeed op to build on this accelerator")
        return
    builder.load()
    print(f"DeepSpeed {builder.NAME} op ready in {os.environ.get('TORCH_EXTENSIONS_DIR')}")
