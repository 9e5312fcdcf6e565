"""The model's tensor-parallel layers (megatron-core's linears and vocabulary embedding),
each with a plain path at one TP rank.

With one TP rank and no sequence parallelism a column- or row-parallel linear is x @ W^T:
no collective, no split. megatron-core still runs it through its Python autograd Function
(`LinearWithGradAccumulationAndAsyncCommunication`), whose checks cost about 0.2 ms per
layer and step on CPU, 1-2% of a small model's step (docs/benchmarks.md#model-step-time).
There `forward` is `F.linear`, the same matmuls in both directions; the parameters, their
names and their TP attributes stay megatron's, so checkpoints and TP > 1 are unchanged.
Layers are built without bias and with `no_init` (pretrain/model/init.py draws every weight).

The embedding likewise: at one TP rank megatron's `VocabParallelEmbedding` is F.embedding
followed by an identity autograd Function (its "all-reduce" over a one-rank group); there
`forward` is F.embedding alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)


def no_init(_: torch.Tensor) -> None:
    """Megatron init hook that does nothing: `pretrain.model.init` draws every weight."""


class _PlainAtOneRank:
    """`forward` is F.linear when the layer has one TP rank and no sequence parallelism."""

    def forward(self, x: torch.Tensor):
        if self.tp_group.size() == 1 and not self.sequence_parallel:
            return F.linear(x, self.weight), None
        return super().forward(x)


class ColumnLinear(_PlainAtOneRank, ColumnParallelLinear):
    """Output features split over the TP group (megatron's ColumnParallelLinear)."""


class RowLinear(_PlainAtOneRank, RowParallelLinear):
    """Input features split over the TP group, outputs summed (megatron's RowParallelLinear)."""


def column_linear(n_in: int, n_out: int, mp: ModelParallelConfig, tp_group) -> ColumnLinear:
    return ColumnLinear(n_in, n_out, config=mp, init_method=no_init, bias=False,
                        gather_output=False, tp_group=tp_group)


def row_linear(n_in: int, n_out: int, mp: ModelParallelConfig, tp_group) -> RowLinear:
    return RowLinear(n_in, n_out, config=mp, init_method=no_init, bias=False,
                     input_is_parallel=True, skip_bias_add=False, tp_group=tp_group)


class VocabEmbedding(VocabParallelEmbedding):
    """Rows of the vocabulary split over the TP group (megatron's VocabParallelEmbedding);
    F.embedding at one TP rank without sequence parallelism."""

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.tp_group.size() == 1 and not self.reduce_scatter_embeddings:
            return F.embedding(input_, self.weight)
        return super().forward(input_)


def vocab_embedding(vocab: int, width: int, mp: ModelParallelConfig, tp_group) -> VocabEmbedding:
    return VocabEmbedding(vocab, width, init_method=no_init, config=mp,
                          reduce_scatter_embeddings=mp.sequence_parallel, tp_group=tp_group)
