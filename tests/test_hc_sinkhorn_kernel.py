"""The fused Sinkhorn kernels (pretrain/model/hc_kernels.c, blocks of tokens one per SIMD
lane) against hc_mix.py's torch path (the same iterates and chain rule as torch operations):
forward and the logits' gradient, for n = 1..5, token counts that fill no block, one block,
and several with a partial last one, leading batch dims, and 1, 7, 20 iterations."""

import pytest
import torch

from pretrain.model import hc_native
from pretrain.model.hc_mix import sinkhorn

SHAPES = ((1,), (7,), (16,), (37,), (3, 37), (1000,))
TOLERANCE = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-6, atol=1e-6)}


def value_and_grad(logits: torch.Tensor, grad: torch.Tensor, iters: int):
    x = logits.clone().requires_grad_(True)
    out = sinkhorn(x, iters)
    out.backward(grad)
    return out.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_sinkhorn_kernel_matches_the_torch_path(monkeypatch, dtype, n):
    if hc_native.lib() is None:
        pytest.skip("the fused CPU kernels could not be built here")
    gen = torch.Generator().manual_seed(n)
    for shape in SHAPES:
        for iters in (1, 7, 20):
            logits = 2 * torch.randn(*shape, n, n, generator=gen, dtype=dtype)
            grad = torch.randn(*shape, n, n, generator=gen, dtype=dtype)
            with monkeypatch.context() as patch:
                patch.setattr(hc_native, "lib", lambda: None)  # torch operations
                want, want_grad = value_and_grad(logits, grad, iters)
            got, got_grad = value_and_grad(logits, grad, iters)
            where = f"shape {shape}, n {n}, iters {iters}"
            torch.testing.assert_close(got, want, **TOLERANCE[dtype], msg=where)
            torch.testing.assert_close(got_grad, want_grad, **TOLERANCE[dtype], msg=where)
