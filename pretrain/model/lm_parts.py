"""The pieces around the blocks that `DenseFormer` and a pipeline rank's `StageModel`
(parallel/strategies/stage_model.py) both hold: their construction, the embedding, the LM head's
weight and loss, the parameter count. Each function reads the attributes the two models
share (`embedding`, `lm_head`, `dwa_alpha`, `dwa_weights`, `config`, `tp_group`,
`sequence_parallel`), so neither model borrows the other's methods.
"""

from __future__ import annotations

import torch
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from torch import nn

from pretrain.model.config import DenseFormerConfig
from pretrain.model.linear import column_linear
from pretrain.model.loss import linear_cross_entropy


def megatron_config(tp_size: int, sequence_parallel: bool = False) -> ModelParallelConfig:
    """megatron-core layer config: we draw weights ourselves (layout-independent init)."""
    return ModelParallelConfig(
        tensor_model_parallel_size=tp_size, sequence_parallel=sequence_parallel,
        use_cpu_initialization=True, perform_initialization=False,
        params_dtype=torch.float32)


def mark_tensor_parallel(model: nn.Module) -> None:
    """Record each sharded weight's split dim (megatron sets it only when it inits weights)."""
    for module in model.modules():
        dim = next((d for cls, d in ((ColumnParallelLinear, 0), (RowParallelLinear, 1),
                                     (VocabParallelEmbedding, 0)) if isinstance(module, cls)),
                   None)
        if dim is not None and not hasattr(module.weight, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(module.weight, True, dim, 1)


def lm_head(cfg: DenseFormerConfig, mp: ModelParallelConfig, tp_group) -> nn.Module | None:
    """The untied LM head, vocabulary-parallel like the embedding (rows V / TP per rank), or
    None when the head is the embedding's transpose (model.tie_embeddings)."""
    if cfg.tie_embeddings:
        return None
    return column_linear(cfg.d_model, cfg.padded_vocab_size, mp, tp_group)


def embed(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """X_0: token embeddings (B, S, H)."""
    return model.embedding(tokens)


def head_weight(model: nn.Module) -> torch.Tensor:
    """The LM head's (V / TP, H) shard: the embedding's, or the untied `lm_head`'s."""
    return model.embedding.weight if model.lm_head is None else model.lm_head.weight


def head_loss(model: nn.Module, h: torch.Tensor, weight: torch.Tensor,
              targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of the LM head on the final norm's output `h` (B, S, H), or
    (S / TP, B, H) under sequence parallelism; the logits exist a chunk at a time."""
    cfg = model.config
    return linear_cross_entropy(
        h, weight, targets, vocab_size=cfg.vocab_size, tp_group=model.tp_group,
        sequence_parallel=model.sequence_parallel, chunk_tokens=cfg.loss_chunk_tokens)


def num_params(model: nn.Module, non_embedding: bool = False) -> int:
    """Learned parameters on this rank (alphas outside the DWA pattern not counted)."""
    n = sum(p.numel() for p in model.parameters()) - model.dwa_weights.uncounted(model.dwa_alpha)
    if non_embedding:
        for module in (model.embedding, model.lm_head):
            n -= 0 if module is None else module.weight.numel()
    return n
