"""Which code computes the DWA's products (`model.dwa_impl`): chosen here, and only here.

    auto    Triton kernels on a CUDA device when triton is installed, else torch
    triton  Triton kernels (pretrain/model/dwa_triton.py); on a CPU only under Triton's
            interpreter (TRITON_INTERPRET=1, as the tests run them)
    torch   torch operators (pretrain/model/dwa_products.py for the buffered DWA)

`dwa_ops(name, device)` gives a `DWAOps`; the buffered DWA keeps it in its buffers
(pretrain/model/dwa.py), so every path (the model, pipeline stages, activation checkpointing,
decoding) runs the products the same way, and the custom op of the compiled graph
(pretrain/model/dwa_op.py) resolves its `impl` string here too. Four products:

    weighted_rows(V, w, live)          y = V^T w[:m] (+ w[m] live): a buffered DWA
    stored_output_grads(R, w, x, g)    (g + R^T w, R x): a stored X_j's gradients
    weighted_list(xs, w)               sum_i w_i xs_i: a DWA over separate tensors
    weighted_list_grads(xs, w, g)      ([w_i g], [<xs_i, g>]): its backward

Results are in w's dtype (the residual stream's), sums in fp32 or wider. If a Triton kernel
fails the first time it runs on a GPU (it did not compile there), the process logs one
warning line and uses torch from then on.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from pretrain.model import dwa_products

IMPLS = ("auto", "triton", "torch")
log = logging.getLogger(__name__)


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


class TorchOps:
    """The products as torch operators (the buffered ones device-aware, dwa_products.py)."""

    name = "torch"

    def weighted_rows(self, values: torch.Tensor, weights: torch.Tensor,
                      live: torch.Tensor | None = None) -> torch.Tensor:
        if live is None:
            return dwa_products.weighted_rows(values, weights, weights.dtype)
        if values.shape[0] == 0:
            return live.reshape(-1) * weights[-1]
        y = dwa_products.weighted_rows(values, weights[:-1], weights.dtype)
        return y.add_(live.reshape(-1) * weights[-1])

    def stored_output_grads(self, rows, weights, x, grad):
        return dwa_products.stored_output_grads(rows, weights, x, grad)

    def weighted_list(self, xs: list[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
        # The compiler fuses the stack into the reduction where it traces this (CPU: it runs
        # inside the custom op, eagerly).
        stacked = torch.stack([x.to(weights.dtype) for x in xs])
        return torch.tensordot(weights, stacked, dims=1)

    def weighted_list_grads(self, xs, weights, grad):
        stacked = torch.stack([x.to(weights.dtype) for x in xs])
        grad_weights = stacked.reshape(len(xs), -1) @ grad.reshape(-1)
        grad_xs = torch._foreach_mul([grad] * len(xs), list(weights.unbind()))
        return [g.to(x.dtype) for g, x in zip(grad_xs, xs, strict=True)], grad_weights


class TritonOps:
    """The products as the kernels of dwa_triton.py (each input read once, fp32 sums)."""

    name = "triton"

    def __init__(self):
        # deferred: pulls in Triton (slow to start, or optional)
        from pretrain.model import dwa_triton

        self.kernels = dwa_triton

    def weighted_rows(self, values, weights, live=None):
        return self.kernels.weighted_sum(list(values.unbind(0)), weights, live=live)[0]

    def stored_output_grads(self, rows, weights, x, grad):
        return self.kernels.weighted_sum(list(rows.unbind(0)), weights, base=grad,
                                         dot_with=x)

    def weighted_list(self, xs, weights):
        xs = [x.contiguous() for x in xs]
        return self.kernels.weighted_sum(xs, weights)[0].view(xs[0].shape)

    def weighted_list_grads(self, xs, weights, grad):
        return self.kernels.scaled_copies([x.contiguous() for x in xs], weights,
                                          grad.contiguous())


class _FallbackOnce:
    """TritonOps that switch this process to torch if a kernel fails on its first run on a
    GPU (later failures, and all of them under the interpreter, are raised)."""

    name = "triton"

    def __init__(self):
        self.triton, self.torch = TritonOps(), TorchOps()
        self.proven: set[str] = set()
        self.failed = False

    def _call(self, product: str, device: torch.device, *args):
        if self.failed:
            return getattr(self.torch, product)(*args)
        try:
            result = getattr(self.triton, product)(*args)
        except Exception as err:
            if device.type != "cuda" or product in self.proven:
                raise
            self.failed = True
            log.warning("model.dwa_impl: the Triton DWA kernel %s failed on %s (%s: %s); "
                        "using torch", product, device, type(err).__name__,
                        str(err).splitlines()[0] if str(err) else "")
            return getattr(self.torch, product)(*args)
        self.proven.add(product)
        return result

    def weighted_rows(self, values, weights, live=None):
        return self._call("weighted_rows", values.device, values, weights, live)

    def stored_output_grads(self, rows, weights, x, grad):
        return self._call("stored_output_grads", rows.device, rows, weights, x, grad)

    def weighted_list(self, xs, weights):
        return self._call("weighted_list", weights.device, xs, weights)

    def weighted_list_grads(self, xs, weights, grad):
        return self._call("weighted_list_grads", weights.device, xs, weights, grad)


DWAOps = TorchOps | TritonOps | _FallbackOnce
_TORCH = TorchOps()
_triton: _FallbackOnce | None = None


def resolve(name: str, device: torch.device) -> str:
    """`triton` or `torch`: what `model.dwa_impl=name` runs on `device`."""
    if name not in IMPLS:
        raise ValueError(f"model.dwa_impl must be one of {IMPLS}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_installed() else "torch"
    if name == "triton":
        if not triton_installed():
            raise ValueError("model.dwa_impl=triton: triton is not installed "
                             "(pip install -e '.[triton]')")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"model.dwa_impl=triton runs on CUDA devices, not {device} "
                             "(or under TRITON_INTERPRET=1, Triton's interpreter)")
    return name


def dwa_ops(name: str, device: torch.device) -> DWAOps:
    """The products that `model.dwa_impl=name` runs on `device`."""
    global _triton
    if resolve(name, device) == "torch":
        return _TORCH
    if _triton is None:
        _triton = _FallbackOnce()
    return _triton
