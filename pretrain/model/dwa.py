"""Depth weighted averages (DWA): the connectivity pattern and the contraction.

Y_i = sum_{j in S_i} alpha[i, j] X_j with S_i = {0 <= j <= i : j = i (mod k)}, optionally cut
to the window j > i - K (Last-K); block i has a DWA iff i = 0 (mod p). See config.py for the
index conventions. The alphas of all DWAs live in one (d, d + 1) matrix: row i - 1 is the DWA
after block i, and entries outside the pattern stay exactly zero (they never get gradient).
"""

from __future__ import annotations

import torch

from pretrain.model.config import DenseFormerConfig


def dwa_mask(cfg: DenseFormerConfig) -> torch.Tensor:
    """Boolean (d, d + 1) mask: True where alpha[i, j] is a learned connection."""
    d, k, p = cfg.n_layers, cfg.dwa_dilation, cfg.dwa_period
    mask = torch.zeros(d, d + 1, dtype=torch.bool, device="cpu")
    if not cfg.dwa:
        return mask
    for i in range(p, d + 1, p):
        low = 0 if cfg.dwa_window is None else i - cfg.dwa_window + 1
        for j in range(i % k, i + 1, k):
            if j >= low:
                mask[i - 1, j] = True
    return mask


def dwa_inputs(cfg: DenseFormerConfig) -> dict[int, list[int]]:
    """For each block i that has a DWA, the sorted j of the X_j it reads."""
    mask = dwa_mask(cfg)
    rows = {}
    for i in range(1, cfg.n_layers + 1):
        js = mask[i - 1].nonzero().flatten().tolist()
        if js:
            rows[i] = js
    return rows


def initial_alpha(cfg: DenseFormerConfig) -> torch.Tensor:
    """alpha at init: 1 on X_i for the DWA after block i, `dwa_init_offdiag` elsewhere in S_i."""
    mask = dwa_mask(cfg)
    alpha = mask.float() * cfg.dwa_init_offdiag
    for i in range(1, cfg.n_layers + 1):
        if mask[i - 1, i]:
            alpha[i - 1, i] = 1.0
    return alpha


class DepthWeightedAverage(torch.autograd.Function):
    """y = sum_n weights[n] * xs[n], as one contraction.

    Autograd saves only references to the inputs (which are alive anyway: they are block
    outputs), never the stacked copy, so memory stays linear in depth; the backward pass is one
    contraction for the weights and one outer product for the inputs. No in-place writes into
    shared buffers, so activation checkpointing and torch.compile see a plain function.
    """

    @staticmethod
    def forward(ctx, weights: torch.Tensor, *xs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weights, *xs)
        if len(xs) == 1:
            return xs[0] * weights[0].to(xs[0].dtype)
        return torch.tensordot(weights.to(xs[0].dtype), torch.stack(xs), dims=1)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        weights, *xs = ctx.saved_tensors
        flat_grad = grad_y.reshape(-1)
        grad_weights = grad_xs = None
        if ctx.needs_input_grad[0]:
            stacked = torch.stack(xs).reshape(len(xs), -1)
            grad_weights = (stacked @ flat_grad).to(weights.dtype)
        if any(ctx.needs_input_grad[1:]):
            grad_xs = torch.outer(weights.to(grad_y.dtype), flat_grad)
            grad_xs = grad_xs.view(len(xs), *grad_y.shape).unbind(0)
        else:
            grad_xs = (None,) * len(xs)
        return (grad_weights, *grad_xs)


def depth_weighted_average(weights: torch.Tensor, xs: list[torch.Tensor]) -> torch.Tensor:
    """sum_n weights[n] * xs[n] (weights: 1-D, one per input; inputs of equal shape)."""
    return DepthWeightedAverage.apply(weights, *xs)
