"""RoPE (pretrain/model/rotary.py) and the TP=1 plain linears (pretrain/model/linear.py).

The rotation is held to the textbook definition (each pair (m, m + head_dim / 2) of a head
rotated by t * base^(-2m / head_dim) as a complex number), values and gradients, for
multi-head, grouped-query and multi-query layouts, batch-first and sequence-first."""

from __future__ import annotations

import pytest
import torch

from pretrain.model.rotary import RotaryEmbedding

LAYOUTS = [(4, 1), (2, 3), (1, 4)]  # (key/value groups, query heads per group)


def textbook_rope(x: torch.Tensor, base: float) -> torch.Tensor:
    """x (..., S, d) with pair (m, m + d/2) at position t rotated by t * base^(-2m/d)."""
    s, d = x.shape[-2:]
    half = d // 2
    theta = torch.arange(s, dtype=torch.float64)[:, None] * base ** (
        -2 * torch.arange(half, dtype=torch.float64) / d)
    z = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(theta), theta)
    return torch.cat([z.real, z.imag], dim=-1)


def qkv_input(groups: int, group: int, seq_first: bool):
    """A float64 QKV output (B=3, S=10) with head_dim 8, and the head_dim."""
    b, s, d = 3, 10, 8
    shape = (s, b) if seq_first else (b, s)
    return torch.randn(*shape, groups * (group + 2) * d, generator=torch.Generator().manual_seed(0),
                       dtype=torch.float64, requires_grad=True), d


def grouped(qkv: torch.Tensor, groups: int, group: int, seq_first: bool) -> torch.Tensor:
    """(B, groups, group + 2, S, d): features are (group, [its queries, key, value], d)."""
    x = qkv.view(*qkv.shape[:2], groups, group + 2, -1)
    if seq_first:
        x = x.transpose(0, 1)
    return x.permute(0, 2, 3, 1, 4)


@pytest.mark.parametrize("seq_first", [False, True])
@pytest.mark.parametrize("groups,group", LAYOUTS)
def test_qkv_is_the_textbook_rotation_of_the_grouped_heads(groups, group, seq_first):
    qkv, d = qkv_input(groups, group, seq_first)
    s = qkv.shape[0 if seq_first else 1]
    rope = RotaryEmbedding(d, 16, 500.0)
    ours = rope.qkv(qkv, groups, group, seq_first)
    x = grouped(qkv, groups, group, seq_first)
    b = x.shape[0]
    expect = (textbook_rope(x[:, :, :group], 500.0).reshape(b, groups * group, s, d),
              textbook_rope(x[:, :, group], 500.0), x[:, :, group + 1])
    # float32 tables: equal up to their rounding; gradients through both, in float64.
    weights = [torch.randn_like(t) for t in expect]
    grads = [torch.autograd.grad(sum((t * w).sum() for t, w in zip(out, weights,
                                                                   strict=True)), qkv)[0]
             for out in (ours, expect)]
    for a, e in zip(ours, expect, strict=True):
        assert a.shape == e.shape
        torch.testing.assert_close(a, e, rtol=0, atol=1e-6)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-6)
    assert torch.autograd.gradcheck(
        lambda t: rope.qkv(t, groups, group, seq_first), (qkv[:2] if seq_first else qkv,))


def test_inference_rotation_at_positions_equals_the_training_one():
    rope = RotaryEmbedding(8, 16, 10000.0)
    qkv, d = qkv_input(2, 2, False)
    q, k, _ = rope.qkv(qkv, 2, 2)
    positions = torch.arange(10).expand(3, 10)
    x = grouped(qkv.detach(), 2, 2, False)
    torch.testing.assert_close(rope.at(x[:, :, :2].reshape(3, 4, 10, d), positions), q.detach())
    torch.testing.assert_close(rope.at(x[:, :, 2], positions), k.detach())
    # Later positions: the rows of the table at those positions.
    shifted = rope.at(x[:, :, 2], positions + 5)
    expect = textbook_rope(torch.cat([torch.zeros(3, 2, 5, d, dtype=x.dtype), x[:, :, 2]],
                                     dim=2), 10000.0)[:, :, 5:]
    torch.testing.assert_close(shifted, expect, rtol=0, atol=1e-6)


def test_linear_layers_at_one_tp_rank_are_plain_matmuls():
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from parallel.primitives import groups
    from pretrain.model.denseformer import megatron_config
    from pretrain.model.linear import column_linear, row_linear

    groups.ensure_initialized()
    mp, tp = megatron_config(1), groups.tp_group()
    for build, parent in ((column_linear, ColumnParallelLinear), (row_linear, RowParallelLinear)):
        layer = build(6, 5, mp, tp)
        assert isinstance(layer, parent)
        torch.nn.init.normal_(layer.weight, generator=torch.Generator().manual_seed(1))
        x = torch.randn(2, 3, 6, requires_grad=True)
        out, bias = layer(x)
        # torch's own autograd nodes, not megatron's Python autograd Functions
        python_node = torch.autograd.function.BackwardCFunction
        assert bias is None and not isinstance(out.grad_fn, python_node)
        mega, _ = parent.forward(layer, x)  # megatron's own path, for comparison
        assert isinstance(mega.grad_fn, python_node)
        g = torch.randn_like(out)
        plain = torch.autograd.grad(out, (x, layer.weight), g)
        theirs = torch.autograd.grad(mega, (x, layer.weight), g)
        torch.testing.assert_close(out, mega, rtol=1e-6, atol=1e-6)
        for a, b in zip(plain, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
