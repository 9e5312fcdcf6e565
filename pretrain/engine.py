"""How this rank computes a step's loss and holds its state, whatever the strategies.

An `Engine` is two independent choices, made once by `build_engine`:

- the **forward** runs the micro-batches of a step: the whole model on this rank
  (`LocalForward`, tensor-parallel shards inside it) or this rank's pipeline stages under
  their schedule (`PipelineForward`, parallel/strategies/pipeline.py);
- the **update** turns the accumulated gradients into new weights: our AdamW with the
  data-parallel mean taken by torch's DDP during the backward (parallel/strategies/ddp.py) or, with
  `parallel.dp_reduction: flat`, in one all-reduce after it (`AdamWUpdate`), or DeepSpeed's
  ZeRO engine, which reduces, clips and steps itself (`ZeroUpdate`, parallel/strategies/zero.py).

The trainer calls `forward_backward`, `update`, `eval_model`, `sharded_state` and
`load_sharded_state` and never asks which combination it holds. State goes in and out under
the global keys of `pretrain.sharded_checkpoint` (parameter names, full shapes; a rank's
tensor-parallel shards as DTensors), so a checkpoint written by any engine loads into any
other; this is the one place checkpoints meet the strategies.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallel.primitives.layout import Layout, average_gradients, gradient_norm
from parallel.primitives.tensor import allreduce_sequence_parallel_grads
from parallel.strategies.checkpointing import apply_activation_checkpointing
from parallel.strategies.compile import apply_compile
from parallel.strategies.compile_choice import compile_mode
from parallel.strategies.ddp import BUCKET_CAP_MB, DDPLoss
from parallel.strategies.pipeline import PipelineRunner
from parallel.strategies.zero import ZeroEngine
from pretrain import sharded_checkpoint, zero_checkpoint
from pretrain.model import DenseFormer
from pretrain.optim import build_optimizer, is_fused, step_if_finite


class AdamWUpdate:
    """Our AdamW: DP mean of the gradients, global norm, clipping, a step unless non-finite.

    The DP mean is taken during the backward by torch DDP when `ddp` (a
    `parallel.strategies.ddp.DDPLoss` the micro-batches run through) is given or
    `reduced_in_backward` says the pipeline's stages are DDP modules; otherwise here, in one
    flat all-reduce after the backward."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, layout: Layout,
                 grad_clip: float, ddp=None, reduced_in_backward: bool = False):
        self.model, self.optimizer = model, optimizer
        self.layout, self.grad_clip = layout, grad_clip
        self.ddp = ddp
        self.reduced_in_backward = reduced_in_backward or ddp is not None

    @property
    def loss_module(self):
        return self.ddp or self.model

    @property
    def eval_module(self):
        return self.model

    def micro_batch(self, last: bool):
        """The context of one micro-batch's forward and backward."""
        return self.ddp.micro_batch(last) if self.ddp else contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, microbatches: int) -> None:
        (loss / microbatches).backward()

    def update(self) -> torch.Tensor:
        if not self.reduced_in_backward:
            average_gradients(self.model, self.layout)
        norm = gradient_norm(self.model, self.layout)
        if is_fused(self.optimizer):  # the skip decided on the device: no host sync
            self._clip(norm)  # a non-finite norm spoils the gradients: they are not used
            step_if_finite(self.optimizer, norm)
        elif math.isfinite(norm.item()):  # foreach AdamW cannot skip by itself: one sync
            self._clip(norm)
            self.optimizer.step()
        # DDP's gradients are views into its buckets: zeroed in place, they stay there (set
        # to None, the next backward would allocate new ones and copy them in).
        self.optimizer.zero_grad(set_to_none=not self.reduced_in_backward)
        return norm

    def _clip(self, norm: torch.Tensor) -> None:
        if self.grad_clip > 0:  # the norm in fp32, as clipping always took it
            torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), self.grad_clip,
                                                 norm.float())

    def sharded_state(self) -> dict:
        """What this rank holds, no more: its TP shards and its stages' parameters."""
        return sharded_checkpoint.local_state(self.model, self.optimizer)

    def load_sharded(self, path: Path, manifest: dict, weights_only: bool = False,
                     fill: dict | None = None) -> None:
        sharded_checkpoint.load_local(path, manifest, self.model,
                                      None if weights_only else self.optimizer, fill)


class ZeroUpdate:
    """DeepSpeed's ZeRO engine: it scales, reduces over DP, clips and steps itself."""

    def __init__(self, zero):  # parallel.strategies.zero.ZeroEngine
        self.zero = zero

    @property
    def loss_module(self):
        return self.zero  # forward through the engine: ZeRO-3 gathers weights in its hooks

    @property
    def eval_module(self):
        return self.zero.module  # through DeepSpeed's hooks too

    def micro_batch(self, last: bool):
        return contextlib.nullcontext()  # DeepSpeed reduces when its step says

    def backward(self, loss: torch.Tensor, microbatches: int) -> None:
        self.zero.backward(loss)  # scales by 1 / microbatches itself

    def update(self) -> float:
        return self.zero.step()  # a non-finite norm: DeepSpeed skipped the update

    def sharded_state(self) -> dict:
        """This rank's ZeRO partition: flat ranges of its parameters' master weights and
        AdamW moments, as row-blocks of the global tensors (no gather)."""
        return zero_checkpoint.local_state(self.zero)

    def load_sharded(self, path: Path, manifest: dict, weights_only: bool = False,
                     fill: dict | None = None) -> None:
        zero_checkpoint.load_local(path, manifest, self.zero, weights_only, fill)


class LocalForward:
    """The whole model on this rank: micro-batches one after another (gradient accumulation)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def forward_backward(self, tokens, targets, microbatches: int, update) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64, device=tokens.device)
        parts = zip(tokens.chunk(microbatches), targets.chunk(microbatches), strict=True)
        for k, (t, y) in enumerate(parts):
            with update.micro_batch(last=k == microbatches - 1):
                loss = update.loss_module.loss(t, y)
                update.backward(loss, microbatches)
            total += loss.detach().double()
        return total

    def eval_model(self, update):
        return update.eval_module

    def describe(self) -> list[str]:
        return []


class PipelineForward:
    """This rank's stages: the schedule runs the micro-batches and the backward."""

    def __init__(self, runner):  # parallel.strategies.pipeline.PipelineRunner
        self.runner = runner

    def forward_backward(self, tokens, targets, microbatches: int, update) -> torch.Tensor:
        return self.runner.train_step(tokens, targets)

    def eval_model(self, update):
        return self.runner  # forward only, the whole batch through the stages in turn

    def describe(self) -> list[str]:
        return self.runner.describe()


class Engine:
    """One rank's model, optimizer and step, behind one interface (see the module doc)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, forward, update,
                 layout: Layout, reduction: str = "none", compiled: tuple[str, str] = ("none",
                                                                                      "")):
        self.model, self.optimizer, self.layout = model, optimizer, layout
        self.forward, self.update_rule = forward, update
        self.reduction = reduction  # dp_reduction's answer
        # (train.compile's mode, why: parallel/strategies/compile_choice.py)
        self.compiled = compiled

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor,
                         microbatches: int) -> torch.Tensor:
        """Sum of the micro-batch mean losses of this rank's batch (float64); gradients
        accumulate in the parameters."""
        return self.forward.forward_backward(tokens, targets, microbatches, self.update_rule)

    def update(self) -> torch.Tensor | float:
        """Reduce the gradients, clip, step; the global gradient norm before clipping (not
        finite: the update was skipped), a device tensor unless DeepSpeed's ZeRO engine
        steps (it returns a float). Gradients are cleared."""
        allreduce_sequence_parallel_grads(self.model, self.layout.tp_group)
        return self.update_rule.update()

    @property
    def eval_model(self):
        """What `pretrain.evaluate` runs a forward-only loss through."""
        return self.forward.eval_model(self.update_rule)

    def sharded_state(self) -> dict[str, Any]:
        """This rank's tensors for `pretrain.sharded_checkpoint.save`: {global key: tensor,
        DTensor for a tensor-parallel shard, FlatShard for a ZeRO partition}; views of the
        live state, no collective."""
        return self.update_rule.sharded_state()

    def load_sharded_state(self, path: Path, manifest: dict) -> None:
        """Read this rank's part of the checkpoint at `path`, written by any engine at any
        layout (collective: every rank calls it)."""
        self.update_rule.load_sharded(path, manifest)

    def load_weights(self, path: Path, manifest: dict, fill: dict | None = None) -> None:
        """Read only the model weights of the checkpoint at `path` (any engine, any layout;
        collective); the optimizer stays fresh. `fill`: full values of the parameters the
        checkpoint lacks, by name."""
        self.update_rule.load_sharded(path, manifest, weights_only=True, fill=fill)

    def describe(self) -> list[str]:
        """Log lines: the optimizer, the data-parallel reduction, then the pipeline's (if
        any)."""
        kind = "fused" if is_fused(self.optimizer) else "foreach"
        optimizer = [f"optimizer: torch's {kind} AdamW (optim.fused)"
                     + (", stepped by DeepSpeed's ZeRO optimizer" if self.reduction == "zero"
                        else "")]
        lines = {"ddp": f"data-parallel gradients: torch DDP, buckets of {BUCKET_CAP_MB} MB "
                        "reduced during the backward",
                 "flat": "data-parallel gradients: one flat all-reduce after the backward "
                         "(parallel.dp_reduction=flat, or interleaved pipeline stages, which "
                         "share parameters)",
                 "zero": "data-parallel gradients: DeepSpeed ZeRO"}
        head = [lines[self.reduction]] if self.reduction in lines else []
        mode, why = self.compiled
        compiled = [f"torch.compile: {mode} ({why})"] if mode != "none" or why != \
            "train.compile" else []
        return optimizer + compiled + head + self.forward.describe()


def build_engine(model_cfg, cfg, layout: Layout, dtype: torch.dtype) -> Engine:
    """The model (whole, or this rank's pipeline stages), its AdamW and, with
    parallel.zero_stage, DeepSpeed around them."""
    p = cfg.parallel
    reduction = dp_reduction(cfg, layout)
    compiled = compile_mode(cfg.train.compile, p, model_cfg, layout.device.type)
    ddp = None
    if layout.pp > 1:
        local_batch = cfg.train.batch_size // layout.dp
        runner = PipelineRunner(
            model_cfg, microbatches=p.microbatches, micro_batch=local_batch // p.microbatches,
            virtual_stages=p.virtual_stages, pp_split=p.pp_split, transfer=p.pp_transfer,
            seed=cfg.train.seed, device=layout.device, sequence_parallel=p.sequence_parallel,
            activation_checkpointing=p.activation_checkpointing == "block",
            ddp_group=layout.dp_group if reduction == "ddp" else None,
            boundary_dtype=dtype if p.pipeline_dtype == "compute" else torch.float32)
        model, forward = runner.model, PipelineForward(runner)
        apply_compile(model, compiled[0], cfg.train.compile_backend)
    else:
        model = DenseFormer(model_cfg, seed=cfg.train.seed,
                            sequence_parallel=p.sequence_parallel).to(layout.device)
        apply_activation_checkpointing(model, p.activation_checkpointing, p.checkpoint_every)
        apply_compile(model, compiled[0], cfg.train.compile_backend)
        forward = LocalForward(model)
        if reduction == "ddp":
            ddp = DDPLoss(model, layout.dp_group)
    optimizer = build_optimizer(model, cfg.optim)
    if p.zero_stage:
        update = ZeroUpdate(ZeroEngine(model, optimizer, p, cfg.train.batch_size,
                                       cfg.optim.grad_clip, dtype=dtype))
    else:
        update = AdamWUpdate(model, optimizer, layout, cfg.optim.grad_clip, ddp,
                             reduced_in_backward=reduction == "ddp")
    return Engine(model, optimizer, forward, update, layout, reduction, compiled)


def dp_reduction(cfg, layout: Layout) -> str:
    """How this run averages gradients over data parallelism: "ddp" (torch DDP, during the
    backward), "flat" (one all-reduce after it), "zero" (DeepSpeed) or "none" (DP = 1).
    `parallel.dp_reduction: ddp` falls back to flat for interleaved pipeline stages, whose
    stage modules share parameters (parallel/strategies/ddp.py)."""
    p = cfg.parallel
    if p.zero_stage:
        return "zero"
    if layout.dp == 1:
        return "none"
    if p.dp_reduction == "ddp" and layout.pp > 1 and p.virtual_stages > 1:
        return "flat"
    return p.dp_reduction
