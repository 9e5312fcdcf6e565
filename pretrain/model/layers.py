"""Transformer blocks built from megatron-core tensor-parallel layers.

Pre-norm block: X_i = h + MLP(N(h)), h = Y_{i-1} + Attn(N(Y_{i-1})), with causal attention
(`scaled_dot_product_attention`) and RoPE (rotate-half), no biases. Two kinds
(`model.block`): gpt, the paper's (N = LayerNorm without bias, a GELU MLP of `ffn_width`),
and llama (N = RMSNorm, SwiGLU: fc_out(silu(gate(x)) * up(x))). QKV and the MLP's input
layers are column-parallel (heads / hidden units split over the TP group), the attention
output and `fc_out` row-parallel; at TP=1 they are plain linears (pretrain/model/linear.py).

Parameter layouts (what pretrain/hf/llama_weights.py maps Hugging Face Llama weights onto):
`attn.qkv.weight` has rows (kv group g, [the g-th group's n_heads / n_kv_heads query heads,
its key head, its value head], head_dim): a contiguous TP shard holds whole groups, and with
n_kv_heads = n_heads it is (head, q|k|v, head_dim). Query head j of group g is head
g * (n_heads / n_kv_heads) + j, as in transformers' `repeat_kv`. `attn.proj.weight` is the
output projection (o_proj); llama's `mlp.gate.weight`, `mlp.up.weight`, `mlp.fc_out.weight`
are gate_proj, up_proj, down_proj; `norm_attn` and `norm_mlp` are the input and
post-attention norms.

Under MUDD with the qkvr streams (pretrain/model/mudd.py) a block reads four inputs, a tuple
(Y^Q, Y^K, Y^V, Y^R): H = Y^R + Attn(N_q(Y^Q), N_k(Y^K), N_v(Y^V)), X = H + MLP(N(H)), with
`norm_attn` as N_q and `norm_k`, `norm_v` the key and value inputs' own norms (every block
has them; block 1 reads X_0 for all four). The fused QKV weight is then applied to three
inputs as three matmuls of its query, key and value rows (`Attention.project_qkv`): the
FLOPs of one, split into heads apart (`split_qkv`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce
from torch import nn

from parallel.primitives.tensor import tp_rank_rng
from pretrain.model.config import DenseFormerConfig
from pretrain.model.linear import column_linear, row_linear
from pretrain.model.rotary import RotaryEmbedding, split_qkv


class Attention(nn.Module):
    """Causal self-attention. Activations are (B, S, H), or (S, B, H) under sequence
    parallelism (megatron's SP collectives split and gather the first dimension)."""

    def __init__(self, cfg: DenseFormerConfig, mp: ModelParallelConfig, tp_group):
        super().__init__()
        self.tp_group = tp_group
        self.seq_first = mp.sequence_parallel
        self.heads_local = cfg.n_heads // tp_group.size()
        self.groups_local = cfg.kv_heads // tp_group.size()  # key/value heads on this rank
        self.group = cfg.n_heads // cfg.kv_heads  # query heads per key/value head
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        # Output features laid out by key/value group (module docstring), so that a
        # contiguous TP shard holds whole groups with their queries, key and value.
        width = (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_dim
        self.qkv = column_linear(cfg.d_model, width, mp, tp_group)
        self.proj = row_linear(cfg.d_model, cfg.d_model, mp, tp_group)

    def forward(self, x, rope: RotaryEmbedding, kv=None) -> torch.Tensor:
        """`kv`: this block's view of a KV cache (pretrain/generation.py `LayerKVCache`) for
        a cached inference step; None (training, full forward) attends causally within x.
        `x`: one input, or the query, key and value inputs (MUDD)."""
        if kv is not None:
            return self._cached(x, rope, kv)
        qkv = self.project_qkv(x)  # under SP: gathered to the full sequence first
        q, k, v = rope.qkv(qkv, self.groups_local, self.group, self.seq_first)
        b, s = q.shape[0], q.shape[2]
        dropout = self.dropout if self.training else 0.0
        with tp_rank_rng(self.tp_group, enabled=dropout > 0):  # heads differ per TP rank
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout,
                                                 enable_gqa=self.group > 1)
        if self.seq_first:
            out = out.permute(2, 0, 1, 3).reshape(s, b, self.heads_local * self.head_dim)
        else:
            out = out.transpose(1, 2).reshape(b, s, self.heads_local * self.head_dim)
        return self.proj(out)[0]

    def project_qkv(self, x):
        """The QKV output (module docstring layout) of one input, or of three inputs (xq,
        xk, xv) the three projections apart, each through its rows of the fused weight
        (this rank's shard), which `split_qkv` takes as they are (no copy into the fused
        layout). Under TP each is megatron's column-parallel matmul (under SP,
        each input is gathered to the full sequence: three all-gathers instead of one)."""
        if isinstance(x, torch.Tensor):
            return self.qkv(x)[0]
        xq, xk, xv = x
        if xq is xk and xk is xv:
            return self.qkv(xq)[0]
        width = self.qkv.weight.shape[1]
        w = self.qkv.weight.view(self.groups_local, self.group + 2, self.head_dim, width)
        parts = [self._column(inp, w[:, rows].reshape(-1, width))
                 for inp, rows in ((xq, slice(0, self.group)),
                                   (xk, slice(self.group, self.group + 1)),
                                   (xv, slice(self.group + 1, self.group + 2)))]
        return tuple(parts)

    def _column(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight^T as the QKV layer computes it (column-parallel; plain at one rank)."""
        if self.tp_group.size() == 1 and not self.seq_first:
            return F.linear(x, weight)
        return linear_with_grad_accumulation_and_async_allreduce(
            x, weight, None, gradient_accumulation_fusion=False,
            allreduce_dgrad=not self.seq_first, sequence_parallel=self.seq_first,
            tp_group=self.tp_group)

    def _cached(self, x, rope: RotaryEmbedding, kv) -> torch.Tensor:
        """Attention of the new tokens x (B, S, H) to every cached token and themselves:
        their keys and values are appended to `kv`; RoPE at `kv.positions`, and `kv.mask`
        (or plain causality) says which cached slots each new token sees."""
        if self.seq_first:
            raise ValueError("cached attention needs a model without sequence parallelism")
        qkv = self.project_qkv(x)
        b, s, _ = qkv[0].shape if isinstance(qkv, tuple) else qkv.shape
        q, k, v = split_qkv(qkv, self.groups_local, self.group)
        q, k = rope.at(q, kv.positions), rope.at(k, kv.positions)
        keys, values = kv.append(k, v)  # the cache holds key/value heads only
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=kv.mask,
                                             is_causal=kv.is_causal, enable_gqa=self.group > 1)
        out = out.transpose(1, 2).reshape(b, s, self.heads_local * self.head_dim)
        return self.proj(out)[0]


class MLP(nn.Module):
    """gpt: fc_out(gelu(fc_in(x))); llama: fc_out(silu(gate(x)) * up(x)) (SwiGLU)."""

    def __init__(self, cfg: DenseFormerConfig, mp: ModelParallelConfig, tp_group):
        super().__init__()
        hidden = cfg.ffn_width
        self.swiglu = cfg.block == "llama"
        if self.swiglu:
            self.gate = column_linear(cfg.d_model, hidden, mp, tp_group)
            self.up = column_linear(cfg.d_model, hidden, mp, tp_group)
        else:
            self.fc_in = column_linear(cfg.d_model, hidden, mp, tp_group)
        self.fc_out = row_linear(hidden, cfg.d_model, mp, tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.fc_out(F.silu(self.gate(x)[0]) * self.up(x)[0])[0]
        return self.fc_out(F.gelu(self.fc_in(x)[0]))[0]


def norm(cfg: DenseFormerConfig) -> nn.Module:
    """The block's normalisation: LayerNorm without bias (gpt) or RMSNorm (llama)."""
    if cfg.block == "llama":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=False)


class Block(nn.Module):
    """One pre-LN transformer block; with `skip_gains`, each residual gets a learned gain."""

    def __init__(self, cfg: DenseFormerConfig, mp: ModelParallelConfig, tp_group,
                 rope: RotaryEmbedding):
        super().__init__()
        self.rope = rope  # one table shared by all blocks (non-persistent buffers)
        self.norm_attn = norm(cfg)
        self.attn = Attention(cfg, mp, tp_group)
        self.norm_mlp = norm(cfg)
        self.mlp = MLP(cfg, mp, tp_group)
        # MUDD's qkvr streams: the key and value inputs' own norms (norm_attn: the query's).
        self.norm_k = self.norm_v = None
        if cfg.mudd_layout is not None and cfg.mudd_layout.block_norms:
            self.norm_k, self.norm_v = norm(cfg), norm(cfg)
        self.dropout = nn.Dropout(cfg.dropout)
        # Under SP each TP rank holds another slice of the sequence: its own dropout stream.
        self.tp_group = tp_group if mp.sequence_parallel else None
        if cfg.skip_gains:
            self.skip_gain_attn = nn.Parameter(torch.ones(()))
            self.skip_gain_mlp = nn.Parameter(torch.ones(()))
        else:
            self.skip_gain_attn = self.skip_gain_mlp = None

    def forward(self, x, kv=None) -> torch.Tensor:
        """X_i from Y_{i-1} (or MUDD's streams, module docstring); `kv` (inference only):
        this block's KV cache, see Attention."""
        if self.norm_k is not None:  # MUDD qkvr: one input, or (Y^Q, Y^K, Y^V, Y^R)
            q, k, v, r = (x,) * 4 if isinstance(x, torch.Tensor) else x
            inputs = (self.norm_attn(q), self.norm_k(k), self.norm_v(v))
            h = r + self._dropout(self.attn(inputs, self.rope, kv))
            return self.mlp_sublayer(h)
        return self.mlp_sublayer(self.attention_sublayer(x, kv))

    # The two sub-layers, which a block program (pretrain/model/program.py) runs one by one
    # when a depth connection sits between them.

    def attention_sublayer(self, x: torch.Tensor, kv=None) -> torch.Tensor:
        """H_i = Y_{i-1} + Attn(N(Y_{i-1})) (each term with its gain under `skip_gains`)."""
        skip = x if self.skip_gain_attn is None else x * self.skip_gain_attn
        return skip + self.attention_branch(x, kv)

    def mlp_sublayer(self, h: torch.Tensor) -> torch.Tensor:
        """X_i = H_i + MLP(N(H_i))."""
        skip = h if self.skip_gain_mlp is None else h * self.skip_gain_mlp
        return skip + self.mlp_branch(h)

    # The branches alone, for a connection that forms each sub-layer's input from earlier
    # branch outputs (Attention Residuals, pretrain/model/attnres.py).

    def attention_branch(self, x: torch.Tensor, kv=None) -> torch.Tensor:
        """Attn(N(x)), with dropout."""
        return self._dropout(self.attn(self.norm_attn(x), self.rope, kv))

    def mlp_branch(self, h: torch.Tensor) -> torch.Tensor:
        """MLP(N(h)), with dropout."""
        return self._dropout(self.mlp(self.norm_mlp(h)))

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.dropout.p == 0:
            return x  # what nn.Dropout returns then, without dispatching an op
        with tp_rank_rng(self.tp_group):
            return self.dropout(x)
