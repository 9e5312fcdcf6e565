"""Rotary position embeddings (RoPE, rotate-half convention, as Llama and transformers).

For a head vector x = (x1, x2) (two halves) at position t, with c = cos(t * f) and
s = sin(t * f) over the half's frequencies f = base^(-2m / head_dim):

    rope(x) = (x1 * c - x2 * s,  x2 * c + x1 * s)

Training goes through `RotaryEmbedding.qkv`, one autograd function from the QKV matmul's
output to the q, k, v that attention reads: forward rotates q and k and copies v into one
buffer, each half written in place by two multiplies; backward applies the inverse rotation
(s -> -s) to the gradients of q and k and writes them and v's gradient straight into the
gradient of the QKV output. Written with plain autograd (split, neg, cat, mul per q and k)
the same map makes every step allocate, zero-fill and sum a QKV-sized gradient per piece.
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
        group, [its `group` query heads, its key head, its value head], head_dim)."""
        s = qkv.shape[0] if seq_first else qkv.shape[1]
        cos, sin = self.cos[:s].to(qkv.dtype), self.sin[:s].to(qkv.dtype)
        if torch.compiler.is_compiling():  # plain ops, which the compiler fuses
            return rotary_qkv_reference(qkv, cos, sin, groups, group, seq_first)
        return _RotaryQKV.apply(qkv, cos, sin, groups, group, seq_first)


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rope(x) in plain differentiable ops (the same ones as `_rotate_into`: same roundings)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([torch.addcmul(x1 * cos, x2, sin, value=-1),
                      torch.addcmul(x2 * cos, x1, sin)], dim=-1)


def rotary_qkv_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         groups: int, group: int, seq_first: bool = False):
    """`RotaryEmbedding.qkv` in plain differentiable ops (under torch.compile, and the
    reference the tests hold the autograd function to)."""
    q, k, v = split_qkv(qkv, groups, group, seq_first)
    return rotated(q, cos, sin), rotated(k, cos, sin), v


def split_qkv(qkv: torch.Tensor, groups: int, group: int, seq_first: bool = False):
    """q (B, groups * group, S, head_dim), k and v (B, groups, S, head_dim), not rotated,
    from the QKV output (as `RotaryEmbedding.qkv` takes it)."""
    src = _grouped(qkv, groups, group, seq_first)
    b, _, _, s, d = src.shape
    q = src[:, :, :group].reshape(b, groups * group, s, d)
    return q, src[:, :, group], src[:, :, group + 1]


def _rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 sign: int = 1) -> None:
    """out = rope(x), or its inverse (the rotation by -angle) with sign=-1; out and x do
    not overlap."""
    x1, x2 = x.chunk(2, dim=-1)
    out1, out2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=out1)
    out1.addcmul_(x2, sin, value=-sign)
    torch.mul(x2, cos, out=out2)
    out2.addcmul_(x1, sin, value=sign)


def _grouped(qkv: torch.Tensor, groups: int, group: int, seq_first: bool) -> torch.Tensor:
    """The QKV output viewed (B, groups, group + 2, S, head_dim)."""
    if seq_first:
        s, b, width = qkv.shape
        return qkv.view(s, b, groups, group + 2, -1).permute(1, 2, 3, 0, 4)
    b, s, width = qkv.shape
    return qkv.view(b, s, groups, group + 2, -1).permute(0, 2, 3, 1, 4)


class _RotaryQKV(torch.autograd.Function):
    """q, k, v as views of one (B, groups * (group + 2), S, head_dim) buffer: query heads
    first (head g * group + j is group g's j-th), then the key heads, then the values."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, groups: int, group: int, seq_first: bool):
        src = _grouped(qkv, groups, group, seq_first)
        b, _, _, s, d = src.shape
        heads = groups * group
        out = qkv.new_empty(b, heads + 2 * groups, s, d)
        q, k, v = out.split([heads, groups, groups], dim=1)
        _rotate_into(q.view(b, groups, group, s, d), src[:, :, :group], cos, sin)
        _rotate_into(k, src[:, :, group], cos, sin)
        v.copy_(src[:, :, group + 1])
        ctx.save_for_backward(cos, sin)
        ctx.layout = (qkv.shape, groups, group, seq_first)
        return q, k, v

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        cos, sin = ctx.saved_tensors
        shape, groups, group, seq_first = ctx.layout
        grad = grad_v.new_empty(shape)
        dst = _grouped(grad, groups, group, seq_first)
        b, _, _, s, d = dst.shape
        # The rotation is orthogonal: its transpose is the rotation by -angle.
        _rotate_into(dst[:, :, :group], grad_q.reshape(b, groups, group, s, d), cos, sin, -1)
        _rotate_into(dst[:, :, group], grad_k, cos, sin, -1)
        dst[:, :, group + 1].copy_(grad_v)
        return grad, None, None, None, None, None
