"""Rotary position embeddings (RoPE, rotate-half convention, as Llama and transformers).

For a head vector x = (x1, x2) (two halves) at position t, with c = cos(t * f) and
s = sin(t * f) over the half's frequencies f = base^(-2m / head_dim):

    rope(x) = (x1 * c - x2 * s,  x2 * c + x1 * s)

Training goes through `RotaryEmbedding.qkv`, from the QKV matmul's output to the q, k, v
that attention reads, in plain autograd ops chosen so that backward writes no gradient
twice: q, k and v are pieces of one `split` of the output in its own memory order (their
gradients are concatenated back in one pass, where slicing and indexing would each
allocate, zero-fill and then sum a QKV-sized gradient), and the rotation's halves come
from `chunk` and go back through `cat` (the same: one pass each way).
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """cos/sin tables (seq_len, head_dim / 2) and the rotations that use them (one table
    shared by every block: non-persistent buffers)."""

    def __init__(self, head_dim: int, seq_len: int, base: float):
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def at(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x of shape (B, heads, S, head_dim) whose tokens sit at `positions` (B, S)."""
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)  # (B, 1, S, head_dim / 2)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        return rotated(x, cos, sin)

    def qkv(self, qkv: torch.Tensor, groups: int, group: int, seq_first: bool = False):
        """q (B, groups * group, S, head_dim) rotated, k (B, groups, S, head_dim) rotated
        and v (B, groups, S, head_dim) from the QKV output (B, S, groups * (group + 2) *
        head_dim), or (S, B, ...) if `seq_first`, whose features are laid out (key/value
        group, [its `group` query heads, its key head, its value head], head_dim); or the three
        projections apart (`split_qkv`)."""
        s = qkv[0].shape[0 if seq_first else 1] if isinstance(qkv, tuple) else \
            qkv.shape[0 if seq_first else 1]
        dtype = qkv[0].dtype if isinstance(qkv, tuple) else qkv.dtype
        cos, sin = self.cos[:s], self.sin[:s]
        if cos.dtype != dtype:  # bf16 under autocast
            cos, sin = cos.to(dtype), sin.to(dtype)
        q, k, v = split_qkv(qkv, groups, group, seq_first)
        return rotated(q, cos, sin), rotated(k, cos, sin), v


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rope(x) for x (..., S, head_dim) and tables broadcasting to (..., S, head_dim / 2)."""
    x1, x2 = x.chunk(2, dim=-1)
    # Plain products, not addcmul: its backward multiplies by its scalar `value` in extra
    # ops (a third more aten ops for a Transformer block's backward).
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def split_qkv(qkv, groups: int, group: int, seq_first: bool = False):
    """q (B, groups * group, S, head_dim), k and v (B, groups, S, head_dim), not rotated,
    from the QKV output (as `RotaryEmbedding.qkv` takes it), or from the query, key and value
    projections apart, a tuple of (B, S, groups * [group, 1, 1] * head_dim)."""
    lead = (qkv[0] if isinstance(qkv, tuple) else qkv).shape[:2]
    if seq_first:
        s, b = lead
        order = (1, 2, 3, 0, 4)  # (S, B, groups, n, d) -> (B, groups, n, S, d)
    else:
        b, s = lead
        order = (0, 2, 3, 1, 4)
    if isinstance(qkv, tuple):  # the three projections apart (MUDD: Attention.project_qkv)
        q, k, v = (piece.view(*piece.shape[:2], groups, n, -1).permute(order)
                   for piece, n in zip(qkv, (group, 1, 1), strict=True))
    else:
        q, k, v = (piece.permute(order) for piece in
                   qkv.view(*qkv.shape[:2], groups, group + 2, -1).split([group, 1, 1], dim=3))
    # With one query head per group (no GQA) dropping the group dimension is a view; a
    # reshape would copy q (the groups' strides skip their key and value heads).
    q = q.squeeze(2) if group == 1 else q.reshape(b, groups * group, s, q.shape[-1])
    return q, k.squeeze(2), v.squeeze(2)
