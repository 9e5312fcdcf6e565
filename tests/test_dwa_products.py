"""The buffered DWA's products (pretrain/model/dwa_products.py): both paths compute the same
values in fp32 and from bf16 storage, and each issues the ops it should per stored X_j."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pretrain.model import DenseFormer, dwa_products
from pretrain.model.dwa_products import (
    contraction_path,
    forced_contraction,
    stored_output_grads,
    weighted_rows,
)
from tests.test_model import random_alpha, tiny

PRODUCTS = {torch.ops.aten.mv.default, torch.ops.aten.addmv.default, torch.ops.aten.addmv_.default,
            torch.ops.aten.mm.default, torch.ops.aten.mv.out, torch.ops.aten.addmv.out}


class OpCounter(TorchDispatchMode):
    """Counts every aten op, and the matrix products apart."""

    def __init__(self):
        super().__init__()
        self.ops, self.products = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.products += func in PRODUCTS
        return func(*args, **(kwargs or {}))


def inputs(m: int, n: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rows, x = torch.randn(m, n, generator=gen), torch.randn(n, generator=gen)
    weights, grad = torch.randn(m, generator=gen), torch.randn(n, generator=gen)
    return rows.to(dtype), weights, x.to(dtype), grad


def test_the_device_picks_the_path_and_a_test_can_force_it():
    assert contraction_path(torch.device("cpu")) == "chunked"
    assert contraction_path(torch.device("cuda")) == "one_pass"
    with forced_contraction("one_pass"):
        assert contraction_path(torch.device("cpu")) == "one_pass"
    assert contraction_path(torch.device("cpu")) == "chunked"
    with pytest.raises(ValueError, match="one of"):
        with forced_contraction("tiles"):
            pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["chunked", "one_pass"])
def test_both_paths_equal_the_fp64_products(path, dtype):
    rows, weights, x, grad = inputs(5, 23, dtype)
    wide = rows.double(), weights.double(), x.double(), grad.double()
    with forced_contraction(path):
        for chunk in (3, 23, None):
            for upstream in (grad, None):
                got_x, got_w = stored_output_grads(rows, weights, x, upstream, chunk=chunk)
                assert got_x.dtype == got_w.dtype == torch.float32  # fp32 sums from bf16 too
                want_x = wide[0].t() @ wide[1] + (0 if upstream is None else wide[3])
                torch.testing.assert_close(got_x.double(), want_x, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(got_w.double(), wide[0] @ wide[2], rtol=1e-5,
                                           atol=1e-5)
        got_y = weighted_rows(rows, weights, torch.float32)
        torch.testing.assert_close(got_y.double(), wide[0].t() @ wide[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ops_per_stored_output_on_each_path(dtype):
    """chunked: two products per column chunk (33 chunks here); one_pass: two in all."""
    rows, weights, x, grad = inputs(4, 33 * 1024, dtype)
    counts = {}
    for path in ("chunked", "one_pass"):
        with forced_contraction(path), OpCounter() as counter:
            stored_output_grads(rows, weights, x, grad, chunk=1024)
        counts[path] = counter.products
    assert counts == {"chunked": 2 * 33, "one_pass": 2}


def test_one_pass_model_backward_issues_two_products_per_stored_output(monkeypatch):
    """A DenseFormer 1x1 backward on the one-pass path: two products per stored X_j whatever
    its size, where the chunked path issues two per chunk (chunks made small here)."""
    model = DenseFormer(tiny(4, 1, 1), seed=0)
    model.load_dwa_matrix(random_alpha(model, torch.Generator().manual_seed(1)))
    tokens = torch.randint(0, 50, (4, 17), generator=torch.Generator().manual_seed(2))
    stored = len(model.dwa_pattern.stored)  # X_0..X_4, each read by a DWA
    monkeypatch.setattr(dwa_products, "_CHUNK_BYTES", 1)  # the 1024-column minimum chunk
    chunks = -(-tokens[:, :-1].numel() * 32 // 1024)  # 4 x 16 tokens x 32 wide
    counts = {}
    for path in ("chunked", "one_pass"):
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        with forced_contraction(path), OpCounter() as counter:
            loss.backward()
        counts[path] = counter.products
    # The rest of the backward (LM head, blocks) is the same on both paths.
    assert counts["chunked"] - counts["one_pass"] == stored * 2 * (chunks - 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_pass_on_cuda_equals_the_fp64_products(dtype):
    """The path a GPU takes by default. From bf16 storage it is torch.mm's out_dtype overload,
    which takes the alphas in bf16 too: those products are then exact to bf16 precision in
    the weights (2^-9 relative), with fp32 sums."""
    rows, weights, x, grad = (t.cuda() for t in inputs(7, 4099, dtype))
    assert contraction_path(rows.device) == "one_pass"
    got_x, got_w = stored_output_grads(rows, weights, x, grad)
    got_y = weighted_rows(rows, weights, torch.float32)
    assert got_x.dtype == got_w.dtype == got_y.dtype == torch.float32
    wide = [t.double().cpu() for t in (rows, weights, x, grad)]
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got_x.double().cpu(), wide[0].t() @ wide[1] + wide[3],
                               rtol=tol, atol=tol)
    torch.testing.assert_close(got_w.double().cpu(), wide[0] @ wide[2], rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(got_y.double().cpu(), wide[0].t() @ wide[1], rtol=tol, atol=tol)
