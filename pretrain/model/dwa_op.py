"""The DWA over separate tensors (the functional form), as the compiler should see it.

    denseformer::dwa_sum(xs, w, impl)                 y = sum_n w_n xs_n, in w's dtype
    denseformer::dwa_sum_backward(xs, w, dy, impl)    [w_n dy for each n] + [<xs_n, dy>]

`train.compile: model` traces the whole loss; the buffered DWA's autograd functions write into
preallocated buffers, which the compiler cannot trace, so under the compiler each DWA is one
`functional_dwa` call (pretrain/model/dwa.py `depth_weighted_average`). Where
`model.dwa_impl` runs the Triton kernels, that is the custom op `dwa_sum`: opaque to the
compiler, one graph node with no graph break, running one kernel that reads each X_j once,
forward and backward. The fake implementations give the shapes and dtypes the compiler
plans with; `register_autograd` makes the backward a second op, so the compiled backward
graph has no break either. Where it runs torch, the same torch products as an autograd
function that the compiler traces into its own code (inductor fuses them with what is
around): on the CPU that measured 9-12% faster per compiled 1x1 step than the opaque op
(docs/benchmarks.md#compilation).

Bytes: forward reads the |S_i| inputs and writes y (the pairwise floor's count for a DWA);
backward reads dy and the inputs and writes one gradient per input, which autograd then
sums per X_j over its readers (the buffered path's single gradient pass per X_j,
docs/design.md#bytes-moved-by-the-dwas, needs state that outlives one op).
"""

from __future__ import annotations

import torch

from pretrain.model.dwa_impl import TorchOps, dwa_ops, resolve


def _no_autocast(device: torch.device):
    """A DWA mixes residual-stream tensors in their own dtype (no autocast rounding)."""
    return torch.autocast(device.type, enabled=False)


@torch.library.custom_op("denseformer::dwa_sum", mutates_args=())
def dwa_sum(xs: list[torch.Tensor], weights: torch.Tensor, impl: str) -> torch.Tensor:
    """sum_n weights[n] xs[n] (weights 1-D, one per input), in weights' dtype."""
    with _no_autocast(weights.device):
        return dwa_ops(impl, weights.device).weighted_list(list(xs), weights).view(
            xs[0].shape)


@dwa_sum.register_fake
def _(xs, weights, impl):
    return xs[0].new_empty(xs[0].shape, dtype=weights.dtype)


@torch.library.custom_op("denseformer::dwa_sum_backward", mutates_args=())
def dwa_sum_backward(xs: list[torch.Tensor], weights: torch.Tensor, grad: torch.Tensor,
                     impl: str) -> list[torch.Tensor]:
    """The gradients of `dwa_sum` given its output's: weights[n] grad for each input (in its
    dtype), then <xs[n], grad> for each n (in weights' dtype)."""
    with _no_autocast(weights.device):
        grads, grad_weights = dwa_ops(impl, weights.device).weighted_list_grads(
            list(xs), weights, grad)
    return [*grads, grad_weights]


@dwa_sum_backward.register_fake
def _(xs, weights, grad, impl):
    return [x.new_empty(x.shape) for x in xs] + [weights.new_empty(weights.shape)]


def _setup_context(ctx, inputs, output) -> None:
    xs, weights, impl = inputs
    ctx.save_for_backward(*xs, weights)
    ctx.impl = impl


def _backward(ctx, grad):
    *xs, weights = ctx.saved_tensors
    *grad_xs, grad_weights = dwa_sum_backward(xs, weights, grad, ctx.impl)
    return grad_xs, grad_weights, None


dwa_sum.register_autograd(_backward, setup_context=_setup_context)


_TORCH = TorchOps()


class _TracedSum(torch.autograd.Function):
    """`dwa_sum` with torch's products, for the compiler to trace through."""

    @staticmethod
    def forward(ctx, weights: torch.Tensor, *xs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weights, *xs)
        return _TORCH.weighted_list(list(xs), weights)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weights, *xs = ctx.saved_tensors
        grad_xs, grad_weights = _TORCH.weighted_list_grads(xs, weights, grad)
        return (grad_weights, *grad_xs)


@torch.compiler.assume_constant_result
def _runs_triton(impl: str, device: torch.device) -> bool:
    return resolve(impl, device) == "triton"


def functional_dwa(xs: list[torch.Tensor], weights: torch.Tensor, impl: str) -> torch.Tensor:
    """sum_n weights[n] xs[n] in weights' dtype: the `dwa_sum` op where `impl` runs the
    Triton kernels on this device, else torch's products traced by the compiler."""
    if _runs_triton(impl, weights.device):
        return dwa_sum(xs, weights, impl)
    return _TracedSum.apply(weights, *xs)
