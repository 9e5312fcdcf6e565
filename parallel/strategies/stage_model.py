"""The part of a DenseFormer that one pipeline rank holds, and one module per stage.

`StageModel` builds only the pieces of its rank's stages (blocks, and the embedding on the
ranks of the first and last stage, tied as in the single-process model), under the
single-process parameter names (`blocks.{i-1}.…`, `embedding.weight`, `final_norm.weight`,
`dwa_alpha`), so the layout-independent init (pretrain/model/init.py) and the checkpoint
state (pretrain/model/state.py) see the same tensors as in `DenseFormer`. Every rank keeps
the full (d, d + 1) alpha matrix; a stage applies only its entries
(parallel/strategies/stage_state.py) and the pipeline sums the alpha gradients over the
pipeline group, so all copies stay equal (likewise the AttnRes queries and key norms and
the static MUDD weights and the Hyper-Connections' (L, ...) weights, of which a stage reads
its sub-layers' rows; a dynamic MUDD mix's weights are on the rank that forms it).

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
from pretrain.model import lm_parts
from pretrain.model.attnres import AttnResConnections, AttnResWeights
from pretrain.model.config import DenseFormerConfig
from pretrain.model.dwa import storage_dtype, training_connections
from pretrain.model.dwa_layout import buffer_layout
from pretrain.model.dwa_weights import DWAWeights
from pretrain.model.hc import HCConnections
from pretrain.model.hc import new_parameters as new_hc_parameters
from pretrain.model.init import init_parameters
from pretrain.model.layers import Block, norm
from pretrain.model.linear import no_init
from pretrain.model.lm_parts import lm_head, mark_tensor_parallel, megatron_config
from pretrain.model.mudd import MuddConnections, MuddWeights
from pretrain.model.program import StageProgram, run_program
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
        self.dwa_weights = DWAWeights(self.dwa_pattern)
        self.register_buffer("dwa_mask", self.dwa_weights.new_mask(), persistent=False)
        self.dwa_alpha = self.dwa_weights.new_parameter()
        # Attention Residuals: every consumer's query and key norm on every rank (a stage
        # reads its consumers' rows; the pipeline sums the gradients, as for the alphas).
        self.attnres_query = self.attnres_key_norm = None
        if cfg.attnres_layout is not None:
            self.attnres_query, self.attnres_key_norm = AttnResWeights(
                cfg.attnres_layout, cfg.d_model).new_parameters()
        # MUDD: dynamic, the weights of the mixes this rank's stages form (each mix is
        # formed on one stage); static, every a_i on every rank (several stages apply
        # columns of a_i when partial sums cross; the pipeline sums the gradients).
        self.mudd_static = self.mudd_w1 = self.mudd_w2 = None
        if cfg.mudd_layout is not None:
            mixes = None
            if cfg.mudd_layout.dynamic:
                mixes = sorted({src.index for p in programs for src in p.sources
                                if src.kind == "mudd"})
            self.mudd_static, self.mudd_w1, self.mudd_w2 = MuddWeights.new_parameters(
                cfg.mudd_layout, cfg.d_model, mixes)
        # Hyper-Connections: every sub-layer's row of each (L, ...) weight on every rank, as
        # the single-process model holds them (a stage reads its sub-layers' rows; the
        # pipeline sums the gradients, as for the alphas), so the state is the same at any
        # pipeline size.
        self.hc_names: tuple[str, ...] = ()
        if cfg.hc_layout is not None:
            for name, param in new_hc_parameters(cfg.hc_layout, cfg.d_model).items():
                setattr(self, name, param)
            self.hc_names = tuple(new_hc_parameters(cfg.hc_layout, 1))
        mark_tensor_parallel(self)
        if self.sequence_parallel:
            mark_sequence_parallel(self)
        init_parameters(self.named_parameters(), cfg, seed, self.tp_rank, self.tp_size)

    # The pieces around the blocks, shared with the single-process model (lm_parts.py).

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """X_0: token embeddings (B, S, H)."""
        return lm_parts.embed(self, tokens)

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's (V / TP, H) shard: the embedding's, or the untied `lm_head`'s."""
        return lm_parts.head_weight(self)

    def head_loss(self, h: torch.Tensor, head_weight: torch.Tensor,
                  targets: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy of the LM head on the final norm's output (lm_parts.py)."""
        return lm_parts.head_loss(self, h, head_weight, targets)

    def num_params(self, non_embedding: bool = False) -> int:
        """Learned parameters on this rank (alphas outside the DWA pattern not counted)."""
        return lm_parts.num_params(self, non_embedding)

    def dwa_matrix(self) -> torch.Tensor:
        """alpha as a dense (d, d + 1) float tensor; identity rows for blocks without DWA."""
        return self.dwa_weights.matrix(self.dwa_alpha)

    def load_dwa_matrix(self, matrix: torch.Tensor) -> None:
        """Set alpha from a dense (d, d + 1) matrix; raise if it leaves the pattern."""
        self.dwa_weights.load(self.dwa_alpha, self.dwa_mask, matrix)

    def block(self, i: int) -> Block:
        """Block i (numbered from 1, as in docs/design.md)."""
        return self.blocks[str(i - 1)]

    def replicated_connection_parameters(self) -> list[nn.Parameter]:
        """The depth-connection weights every rank holds whole and each stage uses in part
        (the alpha matrix, the AttnRes queries and key norms, the static MUDD weights, the
        Hyper-Connections' weights): the pipeline sums their gradients over its group."""
        mudd = []
        if self.mudd_static is not None and not self.config.mudd_layout.dynamic:
            mudd = list(self.mudd_static.values())
        return [p for p in (self.dwa_alpha, self.attnres_query, self.attnres_key_norm)
                if p is not None] + mudd + list(self.hc_parameters().values())

    def hc_parameters(self) -> dict[str, torch.Tensor]:
        """{name: parameter} of the Hyper-Connections (empty under another connection)."""
        return {name: getattr(self, name) for name in self.hc_names}


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
        # (layer, (input,)) of each checkpointed call when set: the memory probe measures
        # their recomputation (parallel/strategies/memory_probe.py `measure_stage`).
        self.recorder: list | None = None
        # The buffered DWA's plan for this stage's partial DWAs (as in the whole model).
        self.dwa_layout = buffer_layout(program.dwa_reads(), model.dwa_pattern.dilation)

    def forward(self, *received: torch.Tensor):
        program, model = self.program, self.model
        x: dict[int, torch.Tensor] = {}
        sums: dict[int, torch.Tensor] = {}
        incoming = {}  # Item -> the tensor received
        if program.is_first:
            x[0] = model.embed(received[0])
        else:
            # Back to the residual stream's dtype (the parameters': fp32 under autocast, bf16
            # in DeepSpeed's bf16 module) on receipt, so that only the boundary rounds; the
            # AttnRes lse stays as it came (fp32).
            stream = next(model.parameters()).dtype
            received = tuple(t if item.kind == "lse" else t.to(stream)
                             for item, t in zip(program.incoming, received, strict=True))
            incoming = dict(zip(program.incoming, received, strict=True))
            for item, tensor in incoming.items():
                if item.kind in ("x", "sum"):
                    (x if item.kind == "x" else sums)[item.index] = tensor
        if model.attnres_query is not None:
            connections = self._attnres_connections(incoming)
        elif model.mudd_static is not None:
            connections = self._mudd_connections(incoming, next(iter(x.values()), None))
        elif model.hc_names:  # the received X_j is the n-stream state itself
            connections = HCConnections(model.config.hc_layout, model.hc_parameters(),
                                        model.config.norm_eps)
        else:
            connections = training_connections(
                self.dwa_layout, model.dwa_alpha, next(iter((*x.values(), *sums.values()))),
                torch.compiler.is_compiling(), storage_dtype(model.config.dwa_dtype),
                model.config.dwa_impl)
        out = run_program(program, model.block, connections, x,
                          None if model.attnres_query is not None else sums,
                          call=self._checkpointed if self.activation_checkpointing else None)
        if program.is_last:  # (B, S, H), or (S / TP, B, H) under sequence parallelism
            # The weight as a view: the schedule detaches the last stage's outputs in place
            # after their backward, which would take the parameter itself out of autograd.
            weight = model.head_weight
            return model.final_norm(out), weight.view_as(weight)
        # A tensor passed on unchanged gets its own autograd node, so that the schedule's
        # backward sees an output distinct from its input.
        return tuple(t.view_as(t) if any(t is r for r in received) else t
                     for t in (t.to(dtype) for t, dtype in zip(
                         out, boundary_dtypes(program.outgoing, self.boundary_dtype),
                         strict=True)))

    def _checkpointed(self, layer, y: torch.Tensor) -> torch.Tensor:
        """A layer recomputed in backward (`parallel.activation_checkpointing: block`)."""
        if self.recorder is not None:
            self.recorder.append((layer, (y,)))
        return checkpoint(layer, y, use_reentrant=False)

    def _attnres_connections(self, received: dict) -> AttnResConnections:
        """The AttnRes state of this stage: its consumers, the consumer states it receives
        (`("state", c)` items with one `("lse", n)`) and the consumers whose states it sends."""
        program, model = self.program, self.model
        states = {item.index: tensor for item, tensor in received.items()
                  if item.kind == "state"}
        lse = next((tensor for item, tensor in received.items() if item.kind == "lse"), None)
        if lse is not None:
            states = {c: (o, part) for (c, o), part in zip(states.items(), lse.unbind(0),
                                                            strict=True)}
        return AttnResConnections(
            model.attnres_query, model.attnres_key_norm, model.config.norm_eps,
            model.config.attnres_layout, last=2 * program.last + int(program.is_last),
            received=states,
            sends=tuple(item.index for item in program.outgoing if item.kind == "state"))

    def _mudd_connections(self, received: dict, like: torch.Tensor | None) -> MuddConnections:
        """The MUDD state of this stage: buffer slots for X_0..X_last (the received X_j are
        stored into theirs) and the received partial sums, {(i, s): tensor}."""
        program, model = self.program, self.model
        sums = {(item.index, item.kind[len("mudd_"):]): tensor
                for item, tensor in received.items() if item.kind.startswith("mudd_")}
        if like is None:
            like = next(iter(sums.values()))
        return MuddConnections(
            (model.mudd_static, model.mudd_w1, model.mudd_w2), model.config.mudd_layout,
            model.config.norm_eps, like, torch.compiler.is_compiling(),
            n_slots=program.last + 1, received=sums)


def boundary_dtypes(items, dtype: torch.dtype) -> list[torch.dtype]:
    """The dtype each item crosses a boundary in: `dtype` (parallel.pipeline_dtype), fp32
    for the per-token AttnRes lse (it enters an exponential; it is small)."""
    return [torch.float32 if item.kind == "lse" else dtype for item in items]
