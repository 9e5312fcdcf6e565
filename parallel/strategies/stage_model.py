"""The part of a DenseFormer that one pipeline rank holds, and one module per stage.

`StageModel` builds only the pieces of its rank's stages (blocks, and the embedding on the
ranks of the first and last stage, tied as in the single-process model), under the
single-process parameter names (`blocks.{i-1}.…`, `embedding.weight`, `final_norm.weight`,
`dwa_alpha`), so the layout-independent init (pretrain/model/init.py) and the checkpoint
state (pretrain/model/state.py) see the same tensors as in `DenseFormer`. Every rank keeps
the full (d, d + 1) alpha matrix; a stage applies only its entries
(parallel/strategies/stage_state.py) and the pipeline sums the alpha gradients over the
pipeline group, so all copies stay equal.

`StageModule` runs one (virtual) stage: it takes the tokens (first stage) or the tensors
that cross its incoming boundary, and returns the outgoing tensors, or on the last stage this
head's inputs: the final norm's output and the head weight, from which the pipeline's loss
function computes the loss in chunks of tokens (pretrain/model/loss.py). The weight is an
output so that a DDP stage module sees it used.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import VocabParallelEmbedding
from torch import nn
from torch.utils.checkpoint import checkpoint

from parallel.primitives import groups
from parallel.primitives.tensor import mark_sequence_parallel
from parallel.strategies.stage_state import StageProgram, run_program
from pretrain.model.config import DenseFormerConfig
from pretrain.model.denseformer import (
    DenseFormer,
    _mark_tensor_parallel,
    dwa_alpha_parameter,
    dwa_mask_tensor,
    lm_head,
    megatron_config,
)
from pretrain.model.dwa import storage_dtype
from pretrain.model.dwa_layout import buffer_layout
from pretrain.model.init import init_parameters
from pretrain.model.layers import Block, norm
from pretrain.model.linear import no_init
from pretrain.model.rotary import RotaryEmbedding


class StageModel(nn.Module):
    """The parameters of the stages in `programs` (one pipeline rank), single-process names."""

    def __init__(self, config: DenseFormerConfig, programs: list[StageProgram], *,
                 seed: int = 0, sequence_parallel: bool = False):
        super().__init__()
        config.validate()
        self.config = cfg = config
        self.programs = list(programs)
        self.tp_group = groups.tp_group()
        self.tp_size, self.tp_rank = self.tp_group.size(), self.tp_group.rank()
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        mp = megatron_config(self.tp_size, self.sequence_parallel)
        self.embedding = None
        last = any(p.is_last for p in programs)
        if any(p.is_first for p in programs) or (last and cfg.tie_embeddings):
            self.embedding = VocabParallelEmbedding(  # the tied LM head reads it too
                cfg.padded_vocab_size, cfg.d_model, init_method=no_init, config=mp,
                reduce_scatter_embeddings=self.sequence_parallel, tp_group=self.tp_group)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.seq_len, cfg.rope_base)
        self.blocks = nn.ModuleDict({
            str(i - 1): Block(cfg, mp, self.tp_group, self.rope)
            for p in programs for i in range(p.first, p.last + 1)})
        self.final_norm = self.lm_head = None
        if last:
            self.final_norm = norm(cfg)
            self.lm_head = lm_head(cfg, mp, self.tp_group)
        self.dwa_pattern = cfg.dwa_pattern  # the object the plan's programs were made from
        self.register_buffer("dwa_mask", dwa_mask_tensor(self.dwa_pattern), persistent=False)
        self.dwa_alpha = dwa_alpha_parameter(self.dwa_pattern)
        _mark_tensor_parallel(self)
        if self.sequence_parallel:
            mark_sequence_parallel(self)
        init_parameters(self.named_parameters(), cfg, seed, self.tp_rank, self.tp_size)

    # The single-process model's methods that read only the attributes above.
    embed = DenseFormer.embed
    head_weight = DenseFormer.head_weight
    head_loss = DenseFormer.head_loss
    dwa_matrix = DenseFormer.dwa_matrix
    load_dwa_matrix = DenseFormer.load_dwa_matrix

    def block(self, i: int) -> Block:
        """Block i (numbered from 1, as in docs/design.md)."""
        return self.blocks[str(i - 1)]

    def num_params(self, non_embedding: bool = False) -> int:
        """Learned parameters on this rank (alphas outside the DWA pattern not counted)."""
        n = sum(p.numel() for p in self.parameters())
        if self.dwa_alpha is not None:
            n -= self.dwa_alpha.numel() - self.dwa_pattern.n_connections
        if non_embedding:
            for module in (self.embedding, self.lm_head):
                n -= 0 if module is None else module.weight.numel()
        return n


class StageModule(nn.Module):
    """One (virtual) pipeline stage over a StageModel's parameters."""

    def __init__(self, model: StageModel, program: StageProgram,
                 activation_checkpointing: bool = False,
                 boundary_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.model = model
        self.program = program
        self.activation_checkpointing = activation_checkpointing
        self.boundary_dtype = boundary_dtype  # what this stage sends (parallel.pipeline_dtype)
        # The buffered DWA's plan for this stage's partial DWAs (as in the whole model).
        self.dwa_layout = buffer_layout(program.dwa_reads(), model.dwa_pattern.dilation)

    def _block_fn(self, i: int):
        block = self.model.block(i)
        if not self.activation_checkpointing:
            return block
        return lambda y: checkpoint(block, y, use_reentrant=False)

    def forward(self, *received: torch.Tensor):
        program, model = self.program, self.model
        x: dict[int, torch.Tensor] = {}
        sums: dict[int, torch.Tensor] = {}
        if program.is_first:
            x[0] = model.embed(received[0])
        else:
            # Back to the residual stream's dtype (the parameters': fp32 under autocast, bf16
            # in DeepSpeed's bf16 module) on receipt, so that only the boundary rounds.
            stream = next(model.parameters()).dtype
            received = tuple(t.to(stream) for t in received)
            for item, tensor in zip(program.incoming, received, strict=True):
                (x if item.kind == "x" else sums)[item.index] = tensor
        blocks = {i: self._block_fn(i) for i in range(program.first, program.last + 1)}
        layout = None if torch.compiler.is_compiling() else self.dwa_layout
        out = run_program(program, model.dwa_alpha, x, sums, blocks, layout,
                          storage_dtype(model.config.dwa_dtype), model.config.dwa_impl)
        if program.is_last:  # (B, S, H), or (S / TP, B, H) under sequence parallelism
            # The weight as a view: the schedule detaches the last stage's outputs in place
            # after their backward, which would take the parameter itself out of autograd.
            weight = model.head_weight
            return model.final_norm(out), weight.view_as(weight)
        # A tensor passed on unchanged gets its own autograd node, so that the schedule's
        # backward sees an output distinct from its input.
        return tuple(t.to(self.boundary_dtype) if t.dtype != self.boundary_dtype
                     else t.view_as(t) if any(t is r for r in received) else t for t in out)
