"""Pipeline-parallel training of a DenseFormer with torch.distributed.pipelining.

`PipelineRunner` is what the trainer calls instead of its micro-batch loop when
`parallel.pp > 1`. On each pipeline rank it builds the rank's `StageModel` (its blocks; the
tied embedding on the ranks of the first and last stage; the full alpha matrix), one
`PipelineStage` per (virtual) stage with every boundary's tensors declared up front, and a
schedule: 1F1B (`Schedule1F1B`; with fewer micro-batches than stages, `ScheduleGPipe`, which
is what 1F1B then reduces to), or interleaved 1F1B (`ScheduleInterleaved1F1B`) with
`parallel.virtual_stages` > 1. What crosses each boundary is parallel/strategies/stage_state.py's
(pretrain/model/attnres_program.py's, pretrain/model/mudd_program.py's,
pretrain/model/hc_program.py's for those connections: for Hyper-Connections one n-stream
state (..., n, H) per boundary).

One step (`train_step`): only the first stage reads the tokens and only the last the
targets; the loss is the mean of the micro-batch means, as in the single-process run (each
micro-batch's loss is divided by their number, and the schedule's own gradient scaling is
off). Then the alpha gradients are summed over the pipeline group (each entry is applied on
exactly one stage; likewise the AttnRes queries and key norms, whose rows each stage uses
for the consumer states it forms, and the static MUDD weights, whose columns each stage
applies to its X_j, and the Hyper-Connections' weights, whose rows each stage reads for its
sub-layers) and the tied embedding's gradients over the embedding
group (first and last stage, as in Megatron). Data-parallel averaging happens in the stage's
last backward when the stage modules are DDP modules (`ddp_group`,
parallel/strategies/ddp.py), else in the trainer; clipping and the optimizer step stay with
the trainer.

Pitfalls of torch.distributed.pipelining (2.13) handled here: declared shapes must be
`requires_grad=True` meta tensors for activations (plain ones fail in backward) and are not
checked against the real ones; metadata inference from a real micro-batch would run a
forward and backward that leave gradients behind, so every shape is declared (static mode).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from torch.distributed import pipelining

from parallel.strategies import ddp
from parallel.strategies.plan import build_plan
from parallel.strategies.schedule import schedule_name, schedule_problem
from parallel.strategies.stage_model import StageModel, StageModule, boundary_dtypes
from pretrain.model.config import DenseFormerConfig
from pretrain.model.state import full_model_state, load_full_model_state

# Parameters replicated over the pipeline group carry this attribute on every rank but one,
# so that a global gradient norm counts them once (the tied embedding on the last stage,
# the alpha matrix off pipeline rank 0).
PIPELINE_DUPLICATE_ATTR = "pipeline_duplicate"


def _meta(shape, dtype: torch.dtype) -> torch.Tensor:
    grad = dtype.is_floating_point
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


class PipelineRunner:
    """This rank's stages, their schedule, and the gradient and state plumbing of PP."""

    def __init__(self, config: DenseFormerConfig, *, microbatches: int, micro_batch: int,
                 virtual_stages: int = 1, pp_split: list[int] | None = None,
                 transfer: str = "optimal", seed: int = 0, device: torch.device | None = None,
                 sequence_parallel: bool = False, activation_checkpointing: bool = False,
                 ddp_group=None, boundary_dtype: torch.dtype = torch.float32):
        self.device = device or torch.device("cpu")
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.pp, self.pp_rank = self.pp_group.size(), self.pp_group.rank()
        if self.pp < 2:
            raise ValueError("PipelineRunner needs a pipeline group of >= 2 ranks")
        problem = schedule_problem(self.pp, virtual_stages, microbatches)
        if problem:
            raise ValueError(problem)
        self.microbatches, self.micro_batch = microbatches, micro_batch
        self.plan = build_plan(config, self.pp, virtual_stages, pp_split, transfer)
        self.local_stages = self.plan.stages_of_rank(self.pp_rank)
        programs = [self.plan.programs[s] for s in self.local_stages]
        self.model = StageModel(config, programs, seed=seed,
                                sequence_parallel=sequence_parallel).to(self.device)
        self.boundary_dtype = boundary_dtype  # of what crosses the stage boundaries
        self.modules = [StageModule(self.model, p, activation_checkpointing, boundary_dtype)
                        for p in programs]
        self.has_first = 0 in self.local_stages
        self.has_last = self.plan.n_stages - 1 in self.local_stages
        tp = self.model.tp_size
        self.seq_shards = tp if self.model.sequence_parallel else 1

        # The tied embedding lives on the first and the last stage's ranks; their gradients
        # are summed over the embedding group. An untied head is the last stage's alone.
        self.embedding_group = None
        if self.model.embedding is not None and config.tie_embeddings:
            self.embedding_group = ps.get_embedding_group()
            if not self.has_first:
                setattr(self.model.embedding.weight, PIPELINE_DUPLICATE_ATTR, True)
        if self.pp_rank != 0:
            for param in self.model.replicated_connection_parameters():
                setattr(param, PIPELINE_DUPLICATE_ATTR, True)
        self.model.pp_group = self.pp_group  # the trainer's gradient norm sums over it

        # `ddp_group`: the stage module under DDP, which averages the gradients over data
        # parallelism during the stage's last backward (parallel/strategies/ddp.py); one stage per
        # rank only, as interleaved stages share the rank's parameters. A stage need not read
        # every parameter of its StageModel (the alphas of a stage without a DWA).
        submodules = self.modules
        if ddp_group is not None:
            if virtual_stages > 1:
                raise ValueError("DDP stage modules need virtual_stages = 1 (interleaved "
                                 "stages share parameters)")
            submodules = [ddp.wrap(m, ddp_group, find_unused_parameters=True)
                          for m in self.modules]
        stages = [pipelining.PipelineStage(
            module, s, self.plan.n_stages, self.device, input_args=self._inputs_meta(s),
            output_args=self._outputs_meta(s), group=self.pp_group)
            for s, module in zip(self.local_stages, submodules, strict=True)]
        self.schedule_name = schedule_name(self.pp, virtual_stages, microbatches)
        schedule_class = getattr(pipelining, self.schedule_name)
        self._micro_losses: list[torch.Tensor] = []
        self.schedule = schedule_class(stages if virtual_stages > 1 else stages[0],
                                       microbatches, loss_fn=self._loss, scale_grads=False)

    # -- shapes --------------------------------------------------------------------------

    def _hidden_shape(self, batch: int) -> tuple[int, ...]:
        cfg = self.model.config
        if self.model.sequence_parallel:  # (S / TP, B, H)
            return (cfg.seq_len // self.seq_shards, batch, cfg.d_model)
        return (batch, cfg.seq_len, cfg.d_model)

    def _boundary_meta(self, items, batch: int) -> tuple[torch.Tensor, ...]:
        """Hidden-size tensors, the AttnRes lse of n consumer states, (n, tokens), and the
        Hyper-Connections' n-stream state, (..., n, H)."""
        hidden = self._hidden_shape(batch)
        layout = self.model.config.hc_layout
        if layout is not None:
            hidden = (*hidden[:-1], layout.streams, hidden[-1])
        return tuple(_meta((item.index, *hidden[:-1]) if item.kind == "lse" else hidden, dtype)
                     for item, dtype in zip(items, boundary_dtypes(items, self.boundary_dtype),
                                            strict=True))

    def _inputs_meta(self, stage: int) -> tuple[torch.Tensor, ...]:
        cfg = self.model.config
        if stage == 0:
            return (_meta((self.micro_batch, cfg.seq_len), torch.long),)
        return self._boundary_meta(self.plan.programs[stage].incoming, self.micro_batch)

    def _outputs_meta(self, stage: int) -> tuple[torch.Tensor, ...]:
        cfg = self.model.config
        if stage == self.plan.n_stages - 1:  # the final norm's output and the head weight
            vocab = cfg.padded_vocab_size // self.model.tp_size
            return (_meta(self._hidden_shape(self.micro_batch), torch.float32),
                    _meta((vocab, cfg.d_model), torch.float32))
        return self._boundary_meta(self.plan.programs[stage].outgoing, self.micro_batch)

    def describe(self) -> list[str]:
        """Log lines: schedule, stages, and the tensors and bytes crossing each boundary."""
        lines = self.plan.describe(self.micro_batch, seq_shards=self.seq_shards,
                                   dtype_bytes=self.boundary_dtype.itemsize)
        lines[0] += f"; {self.schedule_name}, {self.microbatches} micro-batches of " \
                    f"{self.micro_batch}"
        return lines

    # -- training ------------------------------------------------------------------------

    def _loss(self, head_input: tuple[torch.Tensor, torch.Tensor],
              targets: torch.Tensor) -> torch.Tensor:
        loss = self.model.head_loss(*head_input, targets)
        self._micro_losses.append(loss.detach())
        return loss / self.microbatches

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one local batch (all micro-batches); returns the sum of
        the micro-batch mean losses (float64, on every pipeline rank). Gradients accumulate
        into the StageModel's parameters, reduced over the pipeline (not the DP) group."""
        self._micro_losses = []
        args = (tokens,) if self.has_first else ()
        target = targets if self.has_last else None
        self.schedule.step(*args, target=target, return_outputs=False)
        self.reduce_pipeline_grads()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for loss in self._micro_losses:
            total += loss.double()
        self._micro_losses = []
        dist.all_reduce(total, group=self.pp_group)
        return total

    def reduce_pipeline_grads(self) -> None:
        """Sum the depth-connection gradients (alphas, AttnRes queries and key norms) over
        the pipeline group and the tied embedding's over the first and last stage."""
        for param in self.model.replicated_connection_parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, group=self.pp_group)
        group = self.embedding_group
        if group is not None and group.size() > 1:
            weight = self.model.embedding.weight
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            dist.all_reduce(weight.grad, group=group)

    # -- evaluation (duck-types the model for pretrain.evaluate) -------------------------

    @property
    def training(self) -> bool:
        return self.model.training

    def train(self, mode: bool = True) -> "PipelineRunner":
        self.model.train(mode)
        return self

    def eval(self) -> "PipelineRunner":
        return self.train(False)

    @torch.no_grad()
    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss of one batch, forward only, the whole batch through the stages in turn
        (no micro-batches); the same value on every pipeline rank."""
        n_stages = self.plan.n_stages
        result = torch.zeros((), dtype=torch.float64, device=self.device)
        for s in range(n_stages):
            if self.plan.rank_of_stage(s) != self.pp_rank:
                continue
            module = self.modules[self.local_stages.index(s)]
            if s == 0:
                out = module(tokens)
            else:
                state = [torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
                         for meta in self._boundary_meta(self.plan.programs[s].incoming,
                                                         tokens.shape[0])]
                for tensor in state:
                    dist.recv(tensor, group=self.pp_group,
                              group_src=self.plan.rank_of_stage(s - 1))
                out = module(*state)
            if s == n_stages - 1:
                result = self._loss_value(out, targets)
            else:
                for tensor in out:
                    dist.send(tensor.contiguous(), group=self.pp_group,
                              group_dst=self.plan.rank_of_stage(s + 1))
        dist.all_reduce(result, group=self.pp_group)
        return result

    def _loss_value(self, head_input, targets) -> torch.Tensor:
        return self.model.head_loss(*head_input, targets).double()

    # -- layout-independent state --------------------------------------------------------

    def gather_to_main(self, local: dict) -> dict:
        """Merge each pipeline rank's {name: ...} on pipeline rank 0 of TP rank 0 / DP rank 0
        (global rank 0); elsewhere the local dict comes back."""
        if ps.get_tensor_model_parallel_rank() != 0 or ps.get_data_parallel_rank() != 0:
            return local
        parts = [None] * self.pp if self.pp_rank == 0 else None
        dist.gather_object(local, parts, group=self.pp_group, group_dst=0)
        if self.pp_rank != 0:
            return local
        merged = {}
        for part in parts:
            for name, value in part.items():
                merged.setdefault(name, value)  # replicated copies are equal
        return merged

    def full_model_state(self) -> dict:
        """{name: full tensor} of the whole model on global rank 0 (collective)."""
        return self.gather_to_main(full_model_state(self.model))

    def local_model_state(self, state: dict) -> dict:
        """This rank's entries of a full (single-process) model state."""
        names = dict(self.model.named_parameters())
        missing = sorted(names.keys() - state.keys())
        if missing:
            raise KeyError(f"model state lacks {missing[:5]}")
        return {name: state[name] for name in names}

    def load_model_state(self, state: dict) -> None:
        """Load this rank's parameters from a full (single-process) model state."""
        load_full_model_state(self.model, self.local_model_state(state))
