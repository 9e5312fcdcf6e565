"""DenseFormer language model (a plain Transformer when `dwa=False`; Attention Residuals
when `connection=attnres`; MUDD when `connection=mudd`; Hyper-Connections when
`connection=hc` or `mhc`).

    X_0 = embed(tokens);  X_i = block_i(Y_{i-1});  Y_i = DWA_i(X_0..X_i) or X_i;
    logits = LM_head(final_norm(Y_d))          (LM head: the embedding's transpose, or
                                                 `lm_head` when model.tie_embeddings is off)

The training loss never forms the logits of a whole micro-batch: `loss` hands the final
norm's output and the head weight to pretrain/model/loss.py, which works in chunks of tokens.

See dwa_pattern.py for the index conventions and the DWA pattern, program.py for the block
program that every forward runs (training, checkpointed, cached), dwa.py for the contraction.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce
from torch import nn

from parallel.primitives import groups
from parallel.primitives.tensor import mark_sequence_parallel
from pretrain.model import lm_parts
from pretrain.model.attnres import AttnResConnections, AttnResWeights
from pretrain.model.attnres_program import attnres_program
from pretrain.model.config import DenseFormerConfig
from pretrain.model.dwa import storage_dtype, training_connections
from pretrain.model.dwa_inference import DecodeDWAState, PrefillDWAState
from pretrain.model.dwa_weights import DWAWeights
from pretrain.model.hc import HCConnections, new_parameters
from pretrain.model.hc_program import hc_program
from pretrain.model.init import init_parameters
from pretrain.model.layers import Block, norm
from pretrain.model.linear import vocab_embedding
from pretrain.model.lm_parts import lm_head, mark_tensor_parallel, megatron_config
from pretrain.model.mudd import MuddConnections, MuddWeights
from pretrain.model.mudd_program import mudd_program
from pretrain.model.program import model_program, run_program
from pretrain.model.rotary import RotaryEmbedding


class DenseFormer(nn.Module):
    """DenseFormer LM; `model(tokens)` returns logits (B, S, vocab_size)."""

    def __init__(self, config: DenseFormerConfig, *, seed: int = 0,
                 sequence_parallel: bool = False):
        super().__init__()
        config.validate()
        groups.ensure_initialized()
        self.config = cfg = config
        self.tp_group = groups.tp_group()
        self.tp_size, self.tp_rank = self.tp_group.size(), self.tp_group.rank()
        # Sequence parallelism: between the TP-parallel matmuls the residual stream (and so
        # every DWA) holds this rank's slice of the sequence, laid out (S / TP, B, H).
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        if self.sequence_parallel and cfg.seq_len % self.tp_size:
            raise ValueError(f"sequence parallelism needs seq_len={cfg.seq_len} divisible by "
                             f"TP={self.tp_size}")
        mp = megatron_config(self.tp_size, self.sequence_parallel)
        self.embedding = vocab_embedding(cfg.padded_vocab_size, cfg.d_model, mp, self.tp_group)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.seq_len, cfg.rope_base)
        self.blocks = nn.ModuleList(
            Block(cfg, mp, self.tp_group, self.rope) for _ in range(cfg.n_layers))
        self.final_norm = norm(cfg)
        self.lm_head = lm_head(cfg, mp, self.tp_group)
        self.dwa_pattern = cfg.dwa_pattern
        # The blocks and their depth connections, sub-layer by sub-layer: what every forward
        # (training, checkpointed, cached) runs (pretrain/model/program.py).
        self.program = model_program(self.dwa_pattern)
        self.dwa_weights = DWAWeights(self.dwa_pattern)
        self.register_buffer("dwa_mask", self.dwa_weights.new_mask(), persistent=False)
        # One full (d, d + 1) matrix whatever the layout; None when no block has a DWA.
        self.dwa_alpha = self.dwa_weights.new_parameter()
        self.attnres_query = self.attnres_key_norm = None
        if cfg.attnres_layout is not None:  # Attention Residuals (pretrain/model/attnres.py)
            self.program = attnres_program(cfg.attnres_layout)
            self.attnres_query, self.attnres_key_norm = AttnResWeights(
                cfg.attnres_layout, cfg.d_model).new_parameters()
        self.mudd_static = self.mudd_w1 = self.mudd_w2 = None
        if cfg.mudd_layout is not None:  # MUDD (pretrain/model/mudd.py)
            self.program = mudd_program(cfg.mudd_layout)
            self.mudd_static, self.mudd_w1, self.mudd_w2 = MuddWeights.new_parameters(
                cfg.mudd_layout, cfg.d_model)
        self.hc_names: tuple[str, ...] = ()
        if cfg.hc_layout is not None:  # Hyper-Connections (pretrain/model/hc.py)
            self.program = hc_program(cfg.hc_layout)
            for name, param in new_parameters(cfg.hc_layout, cfg.d_model).items():
                setattr(self, name, param)
            self.hc_names = tuple(new_parameters(cfg.hc_layout, 1))
        # Set by parallel.strategies.checkpointing.apply_activation_checkpointing: run_blocks runs
        # the program in checkpointed units.
        self.activation_checkpointing = None
        mark_tensor_parallel(self)
        if self.sequence_parallel:
            mark_sequence_parallel(self)
        self.init_weights(seed)

    def init_weights(self, seed: int) -> None:
        """(Re-)draw every parameter from `seed`, identically for every layout."""
        init_parameters(self.named_parameters(), self.config, seed, self.tp_rank, self.tp_size)

    # -- the three stages of the forward pass --------------------------------------------

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """X_0: token embeddings (B, S, H)."""
        return lm_parts.embed(self, tokens)

    def block(self, i: int) -> Block:
        """Block i (numbered from 1, as in docs/design.md)."""
        return self.blocks[i - 1]

    def run_blocks(self, x0: torch.Tensor, functional: bool | None = None) -> torch.Tensor:
        """Y_d from X_0: the program (every block, each followed by its DWA, if any).

        `functional` picks the DWA as one custom op per DWA (default under torch.compile)
        instead of the buffered one (default in eager mode); both compute the same function."""
        if functional is None:
            functional = torch.compiler.is_compiling()
        if self.activation_checkpointing is not None:
            return self.activation_checkpointing.run_blocks(self, x0, functional)
        return run_program(self.program, self.block, self.training_connections(x0, functional),
                           {0: x0})

    def training_connections(self, like: torch.Tensor, functional: bool,
                             record: dict | None = None):
        """The connection state of one training forward pass: the DWAs'
        (pretrain/model/dwa.py), Attention Residuals' (pretrain/model/attnres.py) or
        MUDD's (pretrain/model/mudd.py) or Hyper-Connections' (pretrain/model/hc.py;
        `record`: see `HCConnections`)."""
        if self.mudd_static is not None:
            return MuddConnections((self.mudd_static, self.mudd_w1, self.mudd_w2),
                                   self.config.mudd_layout, self.config.norm_eps, like,
                                   functional)
        if self.hc_names:
            return HCConnections(self.config.hc_layout, self.hc_parameters(),
                                 self.config.norm_eps, record)
        if self.attnres_query is not None:
            return AttnResConnections(self.attnres_query, self.attnres_key_norm,
                                      self.config.norm_eps, self.config.attnres_layout)
        return training_connections(self.dwa_pattern.layout, self.dwa_alpha, like, functional,
                                    storage_dtype(self.config.dwa_dtype), self.config.dwa_impl)

    def hc_parameters(self) -> dict[str, torch.Tensor]:
        """{name: parameter} of the Hyper-Connections (empty under another connection)."""
        return {name: getattr(self, name) for name in self.hc_names}

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's (V / TP, H) shard: the embedding's, or the untied `lm_head`'s."""
        return lm_parts.head_weight(self)

    def local_logits(self, y: torch.Tensor) -> torch.Tensor:
        """This TP rank's vocabulary shard of the logits (B, S, V / TP), padding masked."""
        h = self.final_norm(y)
        if self.sequence_parallel:  # all-gather the sequence (reduce-scatter in backward)
            logits = linear_with_grad_accumulation_and_async_allreduce(
                h, self.head_weight, None, gradient_accumulation_fusion=False,
                allreduce_dgrad=False, sequence_parallel=True, tp_group=self.tp_group)
            logits = logits.transpose(0, 1)
        else:
            if self.tp_size > 1:  # at one rank an identity autograd Function
                h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
            logits = F.linear(h, self.head_weight)
        shard = logits.shape[-1]
        start = self.tp_rank * shard
        if start + shard > self.config.vocab_size:
            padding = torch.arange(start, start + shard, device=logits.device)
            padding = padding >= self.config.vocab_size
            logits = logits.masked_fill(padding, torch.finfo(logits.dtype).min)
        return logits

    def head(self, y: torch.Tensor) -> torch.Tensor:
        """Final norm and tied LM head: logits (B, S, vocab_size), padding removed."""
        logits = gather_from_tensor_model_parallel_region(self.local_logits(y), group=self.tp_group)
        return logits[..., : self.config.vocab_size]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.run_blocks(self.embed(tokens)))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy over all positions (vocab-parallel, chunked)."""
        h = self.final_norm(self.run_blocks(self.embed(tokens)))
        return self.head_loss(h, self.head_weight, targets)

    def head_loss(self, h: torch.Tensor, head_weight: torch.Tensor,
                  targets: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy of the LM head on the final norm's output `h` (B, S, H), or
        (S / TP, B, H) under sequence parallelism; the logits exist a chunk at a time."""
        return lm_parts.head_loss(self, h, head_weight, targets)

    # -- inference with a KV cache (pretrain/generation.py drives it) ----------------------

    @torch.no_grad()
    def forward_cached(self, tokens: torch.Tensor, cache, last_only: bool = True
                       ) -> torch.Tensor:
        """Logits (B, 1 or S, vocab_size) of `tokens` (B, S) that continue the sequences in
        `cache` (pretrain/generation.py `InferenceCache`; its KV cache is extended here).

        The DWAs read the new tokens' block outputs only: over several tokens (a prompt) each
        X_j is dropped after its last reader (`PrefillDWAState`); one token per sequence (a
        decoding step) uses the cache's fixed `DecodeDWAState`."""
        pattern, storage = self.dwa_pattern, storage_dtype(self.config.dwa_dtype)
        x0 = self.embed(tokens)
        # Per token (Attention Residuals, MUDD, Hyper-Connections): the KV cache is all the
        # state.
        if self.attnres_query is not None or self.mudd_static is not None or self.hc_names:
            y = run_program(self.program, self.block, self.training_connections(x0, False),
                            {0: x0}, kv=cache.layers)
            return self.head(y[:, -1:] if last_only else y)
        weights = self.dwa_weights.per_dwa(self.dwa_alpha)
        if tokens.shape[1] > 1 or not pattern.slot:
            dwa = PrefillDWAState(pattern, {i: w.tolist() for i, w in weights}, storage)
        else:
            if cache.dwa_decode is None:
                cache.dwa_decode = DecodeDWAState(pattern, dict(weights), x0, storage,
                                                  self.config.dwa_impl)
            dwa = cache.dwa_decode
        y = run_program(self.program, self.block, dwa, {0: x0}, kv=cache.layers)
        return self.head(y[:, -1:] if last_only else y)

    # -- analysis ------------------------------------------------------------------------

    def num_params(self, non_embedding: bool = False) -> int:
        """Learned parameters on this rank (alphas outside the DWA pattern not counted)."""
        return lm_parts.num_params(self, non_embedding)

    def dwa_matrix(self) -> torch.Tensor:
        """alpha as a dense (d, d + 1) float tensor; identity rows for blocks without DWA."""
        return self.dwa_weights.matrix(self.dwa_alpha)

    def load_dwa_matrix(self, matrix: torch.Tensor) -> None:
        """Set alpha from a dense (d, d + 1) matrix; raise if it leaves the pattern."""
        self.dwa_weights.load(self.dwa_alpha, self.dwa_mask, matrix)
