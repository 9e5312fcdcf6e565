"""The buffered MUDD mix: Y_i^s = sum_{j=0}^{i} A_i[s, j] X_j for every stream s at once, per
token (index conventions: pretrain/model/mudd_program.py).

Each X_j is copied once, as it is made, into slot j of a token-major buffer (T, d + 1, H)
(`Store`; T the tokens of the stream, the local ones under sequence parallelism). Mix M_i
is then one batched product of its weights (T, C, i + 1) (or (C, i + 1) for the static
mix, the same for every token) with the buffer's first i + 1 slots (T, i + 1, H): no stack
of the X_j per mix, no loop over them. In backward (`Mix`) the weights' gradient is one
batched product with the same slots, and the gradient of every X_j it read is accumulated
into a gradient buffer of the same layout (one batched multiply-add into the slots, in
place); when autograd reaches X_j's `Store` (after every mix that reads X_j: the mixes take
the `Store` results as inputs, as pretrain/model/dwa.py's Combine does) it adds slot j to
X_j's gradient. Autograd never saves or version-checks the buffers, so later slots may be
written; they belong to one forward pass (micro-batches do not share them), and an
activation-checkpointing recomputation writes identical values again.

The mix runs with autocast off, in the buffer's dtype (the residual stream's: fp32 under
autocast).
"""

from __future__ import annotations

import weakref

import torch

from pretrain.model.dwa import _BufferPool

_POOL = _BufferPool()


class MuddBuffers:
    """One forward pass's X_0..X_d, token-major (T, n_slots, H), and their gradients."""

    def __init__(self, n_slots: int, like: torch.Tensor):
        self.shape = like.shape
        width = like.shape[-1]
        self.values = _POOL.take((like.numel() // width, n_slots, width), like)
        self.grads: dict[int, torch.Tensor] = {}  # {0: the gradient buffer}, once made
        weakref.finalize(self, _POOL.give_back, {0: self.values}, self.grads)

    def grad_slots(self, n: int) -> torch.Tensor:
        """The gradient buffer's first n slots (zeros when first made)."""
        if 0 not in self.grads:
            self.grads[0] = _POOL.take(tuple(self.values.shape), self.values).zero_()
        return self.grads[0][:, :n]


def _no_autocast(t: torch.Tensor):
    return torch.autocast(t.device.type, enabled=False)


class Store(torch.autograd.Function):
    """Identity on X_j that copies it into buffer slot j; in backward it adds the slot's
    accumulated gradient (every mix's share) to X_j's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, buffers: MuddBuffers, j: int):
        buffers.values[:, j].copy_(x.reshape(-1, x.shape[-1]))
        ctx.buffers, ctx.j = buffers, j
        ctx.set_materialize_grads(False)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grads = ctx.buffers.grads.get(0)
        if grads is None:  # no mix's output reached the loss
            return grad, None, None
        slot = grads[:, ctx.j]
        total = slot.to(grad.dtype if grad is not None else slot.dtype, copy=True) \
            if grad is None else grad + slot.view(grad.shape).to(grad.dtype)
        slot.zero_()  # read once: a second backward through the graph starts from zero
        return total.view(ctx.buffers.shape), None, None


class Mix(torch.autograd.Function):
    """The C streams of mix M_i from buffer slots lo..i (lo = 0 but on a pipeline stage that
    received partial sums): weights (T, C, i + 1 - lo), or (C, i + 1 - lo) for every token;
    one output per stream (each (T, H) reshaped to the stream's shape, so that each stream's
    gradient arrives alone). `stored`: the `Store` results of X_lo..X_i,
    passed only to order autograd (their gradient goes through the gradient buffer)."""

    @staticmethod
    def forward(ctx, weights: torch.Tensor, buffers: MuddBuffers, i: int, lo: int, *stored):
        values = buffers.values[:, lo:i + 1]
        with _no_autocast(values):
            y = torch.matmul(weights.to(values.dtype), values)  # (T, C, H)
        ctx.save_for_backward(weights)
        ctx.buffers, ctx.i, ctx.lo, ctx.n_stored = buffers, i, lo, len(stored)
        ctx.set_materialize_grads(False)
        return tuple(s.view(buffers.shape) for s in y.unbind(1))

    @staticmethod
    def backward(ctx, *grads):
        (weights,) = ctx.saved_tensors
        buffers, n, lo = ctx.buffers, ctx.i + 1, ctx.lo
        none = (None,) * (3 + ctx.n_stored)
        if all(g is None for g in grads):
            return (None, *none)
        values = buffers.values[:, lo:n]
        t, width = values.shape[0], values.shape[2]
        with _no_autocast(values):
            dy = torch.stack([values.new_zeros(t, width) if g is None
                              else g.reshape(t, width).to(values.dtype) for g in grads], dim=1)
            w = weights.to(values.dtype)
            # dX_j += sum_s A[s, j] dY^s: one batched multiply-add into the slots, in place
            # (on one CPU thread 3-5 x faster than an outer-product update per stream, and
            # than a product into a new tensor added afterwards).
            w_t = w.transpose(-1, -2)
            if w_t.dim() == 2:  # static: the same weights for every token
                w_t = w_t.expand(t, *w_t.shape)
            buffers.grad_slots(n)[:, lo:].baddbmm_(w_t, dy)
            grad_w = None
            if ctx.needs_input_grad[0]:
                grad_w = torch.bmm(dy, values.transpose(1, 2))  # (T, C, i + 1)
                if weights.dim() == 2:
                    grad_w = grad_w.sum(0)
                grad_w = grad_w.to(weights.dtype)
        return (grad_w, *none)


def store(buffers: MuddBuffers, j: int, x: torch.Tensor) -> torch.Tensor:
    return Store.apply(x, buffers, j)


def mix(buffers: MuddBuffers, i: int, weights: torch.Tensor, stored: list[torch.Tensor],
        lo: int = 0) -> tuple[torch.Tensor, ...]:
    """The streams of M_i over slots lo..i (a tuple, one per row of `weights`)."""
    return Mix.apply(weights, buffers, i, lo, *stored)


def functional_mix(weights: torch.Tensor, xs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The same mix over the X_j themselves, in plain autograd ops (no buffers)."""
    dtype = xs[-1].dtype
    with _no_autocast(xs[-1]):
        v = torch.stack([x.reshape(-1, x.shape[-1]).to(dtype) for x in xs], dim=1)
        y = torch.matmul(weights.to(dtype), v)
    return tuple(s.view(xs[0].shape) for s in y.unbind(1))
