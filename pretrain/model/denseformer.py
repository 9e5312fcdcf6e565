"""DenseFormer language model (a plain Transformer when `dwa=False`).

    X_0 = embed(tokens);  X_i = block_i(Y_{i-1});  Y_i = DWA_i(X_0..X_i) or X_i;
    logits = LM_head(final_norm(Y_d))          (LM head: the embedding's transpose, or
                                                 `lm_head` when model.tie_embeddings is off)

The training loss never forms the logits of a whole micro-batch: `loss` hands the final
norm's output and the head weight to pretrain/model/loss.py, which works in chunks of tokens.

See dwa_pattern.py for the index conventions and the DWA pattern, dwa.py for the contraction.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import (
    VocabParallelEmbedding,
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.layers import (
    linear_with_grad_accumulation_and_async_allreduce,
    set_tensor_model_parallel_attributes,
)
from torch import nn

from parallel.primitives import groups
from parallel.primitives.tensor import mark_sequence_parallel
from pretrain.model.config import DenseFormerConfig
from pretrain.model.dwa import (
    BufferedDWA,
    DecodeDWAState,
    PrefillDWAState,
    depth_weighted_average,
    storage_dtype,
)
from pretrain.model.dwa_pattern import DWAPattern
from pretrain.model.init import init_parameters
from pretrain.model.layers import Block, norm
from pretrain.model.linear import column_linear, vocab_embedding
from pretrain.model.loss import linear_cross_entropy
from pretrain.model.rotary import RotaryEmbedding


def megatron_config(tp_size: int, sequence_parallel: bool = False) -> ModelParallelConfig:
    """megatron-core layer config: we draw weights ourselves (layout-independent init)."""
    return ModelParallelConfig(
        tensor_model_parallel_size=tp_size, sequence_parallel=sequence_parallel,
        use_cpu_initialization=True, perform_initialization=False,
        params_dtype=torch.float32)


def _mark_tensor_parallel(model: nn.Module) -> None:
    """Record each sharded weight's split dim (megatron sets it only when it inits weights)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    for module in model.modules():
        dim = next((d for cls, d in ((ColumnParallelLinear, 0), (RowParallelLinear, 1),
                                     (VocabParallelEmbedding, 0)) if isinstance(module, cls)),
                   None)
        if dim is not None and not hasattr(module.weight, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(module.weight, True, dim, 1)


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
        self.register_buffer("dwa_mask", dwa_mask_tensor(self.dwa_pattern), persistent=False)
        # One full (d, d + 1) matrix whatever the layout; None when no block has a DWA.
        self.dwa_alpha = dwa_alpha_parameter(self.dwa_pattern)
        # Set by parallel.strategies.checkpointing.apply_activation_checkpointing: run_blocks then
        # runs the blocks (and DWAs) in checkpointed units.
        self.activation_checkpointing = None
        _mark_tensor_parallel(self)
        if self.sequence_parallel:
            mark_sequence_parallel(self)
        self.init_weights(seed)

    def init_weights(self, seed: int) -> None:
        """(Re-)draw every parameter from `seed`, identically for every layout."""
        init_parameters(self.named_parameters(), self.config, seed, self.tp_rank, self.tp_size)

    # -- the three stages of the forward pass --------------------------------------------

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """X_0: token embeddings (B, S, H)."""
        return self.embedding(tokens)

    def run_blocks(self, x0: torch.Tensor, functional: bool | None = None) -> torch.Tensor:
        """Y_d from X_0: every block, each followed by its DWA (if any).

        `functional` picks the DWA as one custom op per DWA (default under torch.compile)
        instead of the buffered one (default in eager mode); both compute the same function."""
        if functional is None:
            functional = torch.compiler.is_compiling()
        if self.activation_checkpointing is not None:
            return self.activation_checkpointing.run_blocks(self, x0, functional)
        pattern, storage = self.dwa_pattern, storage_dtype(self.config.dwa_dtype)
        buffered = None if functional or not pattern.slot else BufferedDWA(
            pattern.layout, self.dwa_alpha, x0, storage, self.config.dwa_impl)
        kept = {}  # j -> X_j, for the X_j that a later DWA reads

        def keep(j: int, x: torch.Tensor) -> torch.Tensor:
            if j in pattern.slot:
                x = x if buffered is None else buffered.store(j, x)
                kept[j] = x
            return x

        y = keep(0, x0)
        for i, block in enumerate(self.blocks, start=1):
            x = keep(i, block(y))
            js = pattern.inputs.get(i)
            if js is None:
                y = x
            elif buffered is None:
                y = depth_weighted_average(self.dwa_alpha[pattern.layout.weights_index[i]],
                                           [kept[j] for j in js], storage, diagonal=True,
                                           impl=self.config.dwa_impl)
            else:
                y = buffered.combine(i, [kept[j] for j in js], live=x)
        return y

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's (V / TP, H) shard: the embedding's, or the untied `lm_head`'s."""
        return self.embedding.weight if self.lm_head is None else self.lm_head.weight

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
        return linear_cross_entropy(
            h, head_weight, targets, vocab_size=self.config.vocab_size, tp_group=self.tp_group,
            sequence_parallel=self.sequence_parallel,
            chunk_tokens=self.config.loss_chunk_tokens)

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
        if tokens.shape[1] > 1 or not pattern.slot:
            dwa = PrefillDWAState(pattern, {i: w.tolist() for i, w in self._dwa_weights()},
                                  storage)
        else:
            if cache.dwa_decode is None:
                cache.dwa_decode = DecodeDWAState(pattern, dict(self._dwa_weights()), x0,
                                                  storage, self.config.dwa_impl)
            dwa = cache.dwa_decode
        dwa.keep(0, x0)
        y = x0
        for i, block in enumerate(self.blocks, start=1):
            x = block(y, cache.layers[i - 1])
            dwa.keep(i, x)
            y = dwa.combine(i, x) if pattern.has_dwa(i) else x
        return self.head(y[:, -1:] if last_only else y)

    def _dwa_weights(self):
        """(i, alpha[i, j] for j in S_i) for every DWA, detached."""
        for i, js in self.dwa_pattern.inputs.items():
            yield i, self.dwa_alpha[i - 1, list(js)].detach()

    def generate(self, prompts: list[list[int]], max_new_tokens: int | None = None, **options):
        """Continue each prompt (token ids); see `pretrain.generation.generate`."""
        from pretrain.generation import generate

        return generate(self, prompts, max_new_tokens, **options)

    # -- analysis ------------------------------------------------------------------------

    def num_params(self, non_embedding: bool = False) -> int:
        """Learned parameters on this rank (alphas outside the DWA pattern not counted)."""
        n = sum(p.numel() for p in self.parameters())
        if self.dwa_alpha is not None:
            n -= self.dwa_alpha.numel() - self.dwa_pattern.n_connections
        if non_embedding:
            for module in (self.embedding, self.lm_head):
                n -= 0 if module is None else module.weight.numel()
        return n

    def dwa_matrix(self) -> torch.Tensor:
        """alpha as a dense (d, d + 1) float tensor; identity rows for blocks without DWA."""
        d = self.config.n_layers
        matrix = torch.zeros(d, d + 1)
        if self.dwa_alpha is not None:
            matrix.copy_(self.dwa_alpha.detach().float().cpu())
        for i in range(1, d + 1):
            if not self.dwa_pattern.has_dwa(i):
                matrix[i - 1, i] = 1.0
        return matrix

    @torch.no_grad()
    def load_dwa_matrix(self, matrix: torch.Tensor) -> None:
        """Set alpha from a dense (d, d + 1) matrix; raise if it leaves the pattern."""
        d = self.config.n_layers
        matrix = torch.as_tensor(matrix, dtype=torch.float32)
        if matrix.shape != (d, d + 1):
            raise ValueError(f"DWA matrix must have shape {(d, d + 1)}, got {tuple(matrix.shape)}")
        live = self.dwa_mask.cpu()
        expected_fixed = self.dwa_matrix() * ~live
        outside = (matrix * ~live - expected_fixed).abs() > 0
        if outside.any():
            i, j = outside.nonzero()[0].tolist()
            raise ValueError(
                f"DWA matrix puts weight {matrix[i, j].item():g} at row {i} (block {i + 1}), "
                f"column {j} (X_{j}), outside the {self.config.dwa_dilation}x"
                f"{self.config.dwa_period} pattern")
        if self.dwa_alpha is not None:
            self.dwa_alpha.copy_(matrix * live)


def lm_head(cfg: DenseFormerConfig, mp: ModelParallelConfig, tp_group) -> nn.Module | None:
    """The untied LM head, vocabulary-parallel like the embedding (rows V / TP per rank), or
    None when the head is the embedding's transpose (model.tie_embeddings)."""
    if cfg.tie_embeddings:
        return None
    return column_linear(cfg.d_model, cfg.padded_vocab_size, mp, tp_group)


def dwa_mask_tensor(pattern: DWAPattern) -> torch.Tensor:
    """The pattern's (d, d + 1) live alpha entries as a boolean tensor."""
    return torch.tensor(pattern.mask(), dtype=torch.bool, device="cpu")


def dwa_alpha_parameter(pattern: DWAPattern) -> nn.Parameter | None:
    """The full alpha matrix at its initial value; None when no block has a DWA."""
    if not pattern.inputs:
        return None
    return nn.Parameter(torch.tensor(pattern.initial_alpha(), device="cpu"))

