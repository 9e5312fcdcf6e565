"""Depth weighted averages (DWA): the contraction Y_i = sum_{j in S_i} alpha[i, j] X_j.

Which blocks have a DWA, the S_i they read and the buffer layout below come from the model's
`DWAPattern` (pretrain/model/dwa_pattern.py, index conventions there); this file only
computes. Two implementations of the same contraction, tested against each other and a
naive loop:

- eager (`DWABuffers`, `StoreOutput`, `Combine`): each X_j that a later DWA reads is copied
  once into a contiguous buffer of its residue class (`DWAPattern.slot`), so S_i is a slice
  (`DWAPattern.reads`) and a DWA is one matrix-vector product. Gradients w.r.t. the X_j are
  accumulated with one rank-1 update per DWA into a matching gradient buffer and handed to
  block j's output when autograd reaches it. Autograd never saves (or version-checks) the
  buffers, so writing later slots is safe; the buffers belong to one forward pass, so
  micro-batches and activation recomputation (which rewrites identical values) do not
  interfere.
- functional (`depth_weighted_average`): stack + tensordot, used under torch.compile, where
  the compiler fuses the stack into the reduction.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pretrain.model.dwa_pattern import DWAPattern


def _stream_precision(x: torch.Tensor):
    """No autocast inside a DWA: it mixes residual-stream tensors, kept in their own dtype
    (autocast would round the fp32 stream to bf16 in the matrix-vector product)."""
    return torch.autocast(x.device.type, enabled=False)


class DWABuffers:
    """One forward pass's stored X_j (per class, contiguous) and, in backward, their grads."""

    def __init__(self, class_sizes: Mapping[int, int], like: torch.Tensor):
        self.values = {r: like.new_empty((n, *like.shape)) for r, n in class_sizes.items()}
        self.grads: dict[int, torch.Tensor] = {}


class StoreOutput(torch.autograd.Function):
    """Identity on X_j that also copies it into its buffer slot; in backward it adds the
    gradient the DWAs accumulated for X_j (they all ran before: they consume this output)."""

    @staticmethod
    def forward(ctx, x, buffers: DWABuffers, r: int, position: int):
        buffers.values[r][position].copy_(x)
        ctx.buffers, ctx.r, ctx.position = buffers, r, position
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        accumulated = ctx.buffers.grads.get(ctx.r)
        if accumulated is not None:
            grad = grad + accumulated[ctx.position]
        return grad, None, None, None


class Combine(torch.autograd.Function):
    """y = sum_n w[n] * values[r][start + n]: one matrix-vector product over the buffer.

    `stored` are the StoreOutput results for S_i: passed only so that autograd runs this
    backward before theirs; their gradient goes through the gradient buffer instead."""

    @staticmethod
    def forward(ctx, weights, buffers: DWABuffers, r: int, start: int, stop: int, *stored):
        values = buffers.values[r][start:stop]
        ctx.save_for_backward(weights)
        ctx.buffers, ctx.r, ctx.start, ctx.stop = buffers, r, start, stop
        w = weights.to(values.dtype)
        with _stream_precision(values):
            return torch.mv(values.reshape(stop - start, -1).t(), w).view(values.shape[1:])

    @staticmethod
    def backward(ctx, grad_y):
        (weights,) = ctx.saved_tensors
        buffers, r, start, stop = ctx.buffers, ctx.r, ctx.start, ctx.stop
        values = buffers.values[r]
        flat_grad = grad_y.reshape(-1).to(values.dtype)
        grad_weights = torch.mv(values[start:stop].reshape(stop - start, -1), flat_grad)
        if r not in buffers.grads:
            buffers.grads[r] = torch.zeros_like(values)
        buffers.grads[r][start:stop].view(stop - start, -1).addr_(
            weights.to(values.dtype), flat_grad)
        return (grad_weights.to(weights.dtype), None, None, None, None) + \
            (None,) * (stop - start)


class DepthWeightedAverage(torch.autograd.Function):
    """y = sum_n weights[n] * xs[n] (functional form; saves only references to the inputs)."""

    @staticmethod
    def forward(ctx, weights: torch.Tensor, *xs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weights, *xs)
        with _stream_precision(xs[0]):
            return torch.tensordot(weights.to(xs[0].dtype), torch.stack(xs), dims=1)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        weights, *xs = ctx.saved_tensors
        grad_y = grad_y.to(xs[0].dtype)
        grad_weights = torch.stack(xs).reshape(len(xs), -1) @ grad_y.reshape(-1)
        # Separate tensors (not views of one outer product) so each is freed once consumed.
        grad_xs = torch._foreach_mul([grad_y] * len(xs), list(weights.to(grad_y.dtype).unbind()))
        return (grad_weights.to(weights.dtype), *grad_xs)


def depth_weighted_average(weights: torch.Tensor, xs: list[torch.Tensor]) -> torch.Tensor:
    """sum_n weights[n] * xs[n] (weights: 1-D, one per input; inputs of equal shape)."""
    return DepthWeightedAverage.apply(weights, *xs)


# -- inference: the DWA state of a cached forward (pretrain/generation.py drives it) ----------
#
# A DWA mixes block outputs of the same token, so a cached forward over new tokens needs only
# those tokens' X_j, never past tokens' (their keys and values are in the KV cache).


class PrefillDWAState:
    """The X_j of a cached forward over many tokens (a prompt), each dropped as soon as the
    last DWA that reads it (`DWAPattern.last_reader`) has run, so that no block output is
    kept longer than the pattern needs. `weights[i]`: alpha[i, j] for j in S_i, as floats."""

    def __init__(self, pattern: DWAPattern, weights: Mapping[int, list[float]]):
        self.pattern, self.weights = pattern, weights
        self.kept: dict[int, torch.Tensor] = {}
        self.peak = 0  # the most X_j held at once, for tests

    def keep(self, j: int, x: torch.Tensor) -> None:
        if j in self.pattern.slot:
            self.kept[j] = x
            self.peak = max(self.peak, len(self.kept))

    def combine(self, i: int) -> torch.Tensor:
        """Y_i, summed in place into a new tensor (no stacked copy of the X_j)."""
        js = self.pattern.inputs[i]
        with _stream_precision(self.kept[js[0]]):
            y = self.kept[js[0]] * self.weights[i][0]
            for j, w in zip(js[1:], self.weights[i][1:], strict=True):
                y.add_(self.kept[j], alpha=w)
        for j in js:
            if self.pattern.last_reader[j] == i:
                del self.kept[j]
        return y


class DecodeDWAState:
    """The DWA state of one decoding step: per residue class a buffer (n_r, B, 1, H) of the
    current tokens' X_j that later DWAs of the step read, in `DWAPattern.slot` order, written
    again every step; so it holds exactly `len(pattern.stored)` tensors of one token per
    sequence. `weights[i]`: alpha[i, j] for j in S_i as a tensor, made once."""

    def __init__(self, pattern: DWAPattern, weights: Mapping[int, torch.Tensor],
                 like: torch.Tensor):
        self.pattern = pattern
        self.values = {r: like.new_empty((n, *like.shape)) for r, n in pattern.class_sizes.items()}
        self.weights = {i: w.to(like.dtype) for i, w in weights.items()}

    @property
    def num_tensors(self) -> int:
        return sum(v.shape[0] for v in self.values.values())

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.values.values())

    def keep(self, j: int, x: torch.Tensor) -> None:
        slot = self.pattern.slot.get(j)
        if slot is not None:
            self.values[slot[0]][slot[1]].copy_(x)

    def combine(self, i: int) -> torch.Tensor:
        """Y_i: one matrix-vector product over the slice of its class."""
        r, start, stop = self.pattern.reads[i]
        values = self.values[r][start:stop]
        with _stream_precision(values):
            return torch.mv(values.reshape(stop - start, -1).t(), self.weights[i]).view(
                values.shape[1:])
