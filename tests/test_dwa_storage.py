"""model.dwa_dtype: the DWAs' stored X_j (and gradient rows) in bf16, sums in fp32.

What bf16 storage must do (pretrain/model/dwa.py): Y_i = alpha[i, i] X_i + sum over the
other j in S_i of alpha[i, j] bf16(X_j), summed in fp32, with X_i live. So a model at
initialisation equals the Transformer bitwise, forward and backward; with random alphas it
follows that formula (written out naively below) on every path: buffered, functional,
checkpointed and both contraction paths (cached generation: tests/test_generate.py).
"""

import pytest
import torch

from parallel.strategies.checkpointing import apply_activation_checkpointing
from pretrain.model import DenseFormer, DenseFormerConfig, ModelConfigError
from pretrain.model.dwa_products import forced_contraction
from tests.test_model import random_alpha, tiny


def rounded_forward(model, tokens, matrix):
    """Y_i = M[i-1, i] X_i + sum_{j < i} M[i-1, j] bf16(X_j), in fp32."""
    xs = [model.embed(tokens)]
    y = xs[0]
    for i, block in enumerate(model.blocks, start=1):
        xs.append(block(y))
        y = matrix[i - 1, i] * xs[i] + sum(
            matrix[i - 1, j] * xs[j].to(torch.bfloat16).float() for j in range(i))
    return model.head(y)


def pair(d, k, p, **kw):
    """A bf16-storage DenseFormer and an fp32-storage twin with the same weights."""
    narrow = DenseFormer(tiny(d, k, p, dwa_dtype="bf16", **kw), seed=3)
    wide = DenseFormer(tiny(d, k, p, **kw), seed=3)
    return narrow, wide


def assert_close_in_norm(got: torch.Tensor, want: torch.Tensor, bound: float, what) -> None:
    """|got - want| <= bound |want| (Frobenius): bf16 rounds each element by up to 2^-9 of
    itself, so elementwise bounds fail on the near-zero elements of a sum."""
    error = (got - want).norm().item()
    assert error <= bound * want.norm().item(), (what, error, want.norm().item())


def grads(model, tokens):
    model.zero_grad()
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("functional", [False, True], ids=["buffered", "functional"])
def test_at_initialisation_bf16_storage_equals_the_transformer_bitwise(functional):
    tokens = torch.randint(0, 50, (2, 17), generator=torch.Generator().manual_seed(0))
    dense = DenseFormer(tiny(5, 1, 1, dwa_dtype="bf16"), seed=3)
    plain = DenseFormer(DenseFormerConfig(**{**vars(tiny(5)), "dwa": False}), seed=3)
    y = dense.head(dense.run_blocks(dense.embed(tokens[:, :-1]), functional=functional))
    assert torch.equal(y, plain(tokens[:, :-1]))
    dense.zero_grad()
    dense.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    want = grads(plain, tokens)
    for name, grad in want.items():  # the live diagonal keeps X_i's gradient exact
        assert torch.equal(dict(dense.named_parameters())[name].grad, grad), name


@pytest.mark.parametrize("path", ["chunked", "one_pass"])
@pytest.mark.parametrize("functional", [False, True], ids=["buffered", "functional"])
@pytest.mark.parametrize("d,k,p", [(4, 1, 1), (10, 4, 5), (7, 3, 2)])
def test_bf16_storage_follows_the_rounded_formula(d, k, p, functional, path):
    gen = torch.Generator().manual_seed(d * 10 + k)
    model = DenseFormer(tiny(d, k, p, dwa_dtype="bf16"), seed=1)
    matrix = random_alpha(model, gen)
    model.load_dwa_matrix(matrix)
    tokens = torch.randint(0, 50, (2, 16), generator=gen)
    with forced_contraction(path):
        got = model.head(model.run_blocks(model.embed(tokens), functional=functional))
        torch.testing.assert_close(got, rounded_forward(model, tokens, matrix),
                                   rtol=1e-5, atol=1e-5)
        got_grads = grads(model, tokens)
    # The exact gradient of the rounded formula, against ours, whose gradient rows are
    # bf16 too: equal to bf16 precision.
    model.zero_grad()
    want_loss = torch.nn.functional.cross_entropy(
        rounded_forward(model, tokens[:, :-1], matrix).flatten(0, 1), tokens[:, 1:].flatten())
    want_loss.backward()
    for name, param in model.named_parameters():
        if name == "dwa_alpha":
            continue  # the matrix is a constant in rounded_forward
        assert_close_in_norm(got_grads[name], param.grad, 1e-2, name)


def test_bf16_storage_alpha_gradients_read_the_stored_values():
    """A DWA's alpha gradients are <dY_i, X_j> with X_j as stored: close to fp32 storage's."""
    narrow, wide = pair(6, 1, 1)
    matrix = random_alpha(wide, torch.Generator().manual_seed(2))
    narrow.load_dwa_matrix(matrix)
    wide.load_dwa_matrix(matrix)
    tokens = torch.randint(0, 50, (2, 17), generator=torch.Generator().manual_seed(1))
    got, want = grads(narrow, tokens)["dwa_alpha"], grads(wide, tokens)["dwa_alpha"]
    assert_close_in_norm(got, want, 0.1, "dwa_alpha")
    assert not torch.equal(got, want)  # bf16 storage does change them


@pytest.mark.parametrize("mode,every", [("block", 1), ("block", 2), ("dwa_block", 1)])
def test_checkpointing_with_bf16_storage(mode, every):
    """`block` equals no checkpointing; `dwa_block` recomputes a unit's leading DWA from the
    buffers, diagonal included, so it equals it to bf16 precision."""
    model = DenseFormer(tiny(6, 2, 1, dwa_dtype="bf16"), seed=0)
    model.load_dwa_matrix(random_alpha(model, torch.Generator().manual_seed(4)))
    tokens = torch.randint(0, 50, (2, 17), generator=torch.Generator().manual_seed(5))
    want = grads(model, tokens)
    apply_activation_checkpointing(model, mode, every)
    got = grads(model, tokens)
    for name, grad in want.items():
        if mode == "block":
            torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=name)
        else:  # the alpha gradients are sums with much cancellation: bf16 storage alone
            # moves them by about 4% here (test above), the other gradients by 0.1%
            assert_close_in_norm(got[name], grad, 0.1 if name == "dwa_alpha" else 1e-2, name)


def test_bad_dwa_dtype_names_the_key():
    with pytest.raises(ModelConfigError,
                       match=r"model.dwa_dtype: must be fp32 or bf16, got 'fp16'"):
        tiny(4, dwa_dtype="fp16")
