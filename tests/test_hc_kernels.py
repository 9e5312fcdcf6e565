"""Hyper-Connections' fused CPU kernels (pretrain/model/hc_kernels.c through hc_native.py)
against the same products as torch operations (the path GPUs and `train.compile` take):
forward and every gradient, fp64 to 1e-12 and fp32 to 2e-6 relative; the in-place gradient
sum (`GradSlot`) against autograd's; and the build: cached, and a missing or failing
compiler falling back to torch with a warning that names why."""

from __future__ import annotations

import logging

import pytest
import torch

from pretrain.model import DenseFormer, DenseFormerConfig, hc_mix, hc_native

pytestmark = pytest.mark.skipif(hc_native.lib() is None, reason="no C compiler here")

TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-6}


def _torch_path(monkeypatch):
    monkeypatch.setattr(hc_native, "lib", lambda: None)


def _run(fn, inputs, grad_seed=1):
    """fn's output and the gradients of every input for a fixed random output gradient."""
    inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*inputs)
    grad = torch.randn(out.shape, dtype=out.dtype,
                       generator=torch.Generator().manual_seed(grad_seed))
    out.backward(grad)
    return [out.detach()] + [x.grad for x in inputs]


def _dynamic_read(state, proj, scale, am, ar, b):
    """h, mix and post of dynamic HC, fused where the kernels serve (hc.py's choice)."""
    fused = hc_mix.dynamic_read(state, proj, scale, am, ar, b, 1e-6)
    if fused is None:
        pre, res, post = hc_mix.hc_dynamic(state, proj, scale, am, ar, b, 1e-6)
        fused = hc_mix.read(pre, state), pre, res.mT, post
    h, _, mix, post = fused
    return torch.cat([h, mix.flatten(-2), post], -1)


def _cases(dtype, n, hidden=19):
    g = torch.Generator().manual_seed(n)

    def r(*shape):
        return torch.randn(*shape, dtype=dtype, generator=g)

    state, out = r(2, 100, n, hidden), r(2, 100, hidden)
    pre, mix, post = r(2, 100, n), r(2, 100, n, n), r(2, 100, n)
    mhc_bias = r(n * n + 2 * n)
    return {
        "read": (hc_mix.read, [pre, state]),
        "write": (hc_mix.write, [mix, post, state, out]),
        "write, shared weights": (hc_mix.write, [mix[0, 0], post[0, 0], state, out]),
        "dynamic weights and read": (_dynamic_read, [state, r(hidden, n + 2), r(2), r(n),
                                                     r(n, n), r(n)]),
        "projection": (lambda x, p: hc_mix._RMSProjection.apply(x, p, 1e-6, None),
                       [state.flatten(-2), r(n * hidden, n * n + 2 * n)]),
        "mhc weights": (lambda x, p, s: torch.cat([w.flatten(-2) if w.dim() == 4 else w
                                                   for w in hc_mix.mhc_weights(
                                                       x, p, s, mhc_bias, 1e-6, 5)], -1),
                        [state, r(n * hidden, n * n + 2 * n), r(3)]),
    }


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_kernels_equal_the_torch_operations(monkeypatch, dtype, n):
    fused = {name: _run(fn, xs) for name, (fn, xs) in _cases(dtype, n).items()}
    _torch_path(monkeypatch)
    for name, (fn, xs) in _cases(dtype, n).items():
        for got, want in zip(fused[name], _run(fn, xs), strict=True):
            err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
            assert err <= TOLERANCE[dtype], (name, err)


def test_results_do_not_depend_on_the_thread_count():
    """Sums across tokens are taken per 64 tokens and then in order: 1 and 2 threads give
    the same bits (200 tokens: four chunks, the last partial). The cases on BLAS products
    (mHC's projection) are left out: BLAS makes no such promise."""
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append([_run(fn, xs) for name, (fn, xs) in _cases(torch.float32, 4).items()
                            if name not in ("projection", "mhc weights")])
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results, strict=True):
        for a, b in zip(one, two, strict=True):
            assert torch.equal(a, b)


def _loss_and_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("connection", [dict(connection="hc"),
                                        dict(connection="hc", hc_dynamic=False),
                                        dict(connection="mhc")], ids=["hc", "hc-static", "mhc"])
def test_model_gradients_equal_with_and_without_kernels_and_slots(monkeypatch, connection):
    """The whole model in fp64: fused kernels with the in-place gradient sum, torch
    operations with it (the GPU path), and torch operations with autograd's plain sum (the
    compiled path, slot None) give one loss and one set of gradients."""
    cfg = DenseFormerConfig(n_layers=2, d_model=16, n_heads=2, vocab_size=32, seq_len=8,
                            dwa=False, hc_streams=3, **connection)
    model = DenseFormer(cfg).double()
    with torch.no_grad():  # away from the identity initialisation, so every weight matters
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, dtype=p.dtype,
                                     generator=torch.Generator().manual_seed(p.numel())))
    tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    runs = [_loss_and_grads(model, tokens)]
    _torch_path(monkeypatch)
    runs.append(_loss_and_grads(model, tokens))
    from pretrain.model import hc
    monkeypatch.setattr(hc.HCConnections, "slot", lambda self: None)
    runs.append(_loss_and_grads(model, tokens))
    loss, grads = runs[0]
    for other_loss, other in runs[1:]:
        assert torch.allclose(loss, other_loss, rtol=1e-13, atol=0)
        for name, g in grads.items():
            assert torch.allclose(g, other[name], rtol=1e-10, atol=1e-13), name


def test_a_non_contiguous_argument_is_refused_by_name():
    x = torch.randn(4, 3, 8).transpose(1, 2)
    with pytest.raises(ValueError, match="hc_sumsq: argument 2 is not contiguous"):
        hc_native.call("hc_sumsq", 4, 24, x, torch.empty(4))


def test_without_a_compiler_torch_runs_and_the_log_says_why(monkeypatch, caplog):
    monkeypatch.setattr(hc_native, "_compiler", lambda: None)
    with caplog.at_level(logging.WARNING, logger=hc_native.__name__):
        assert hc_native.lib.__wrapped__() is None
    assert "no C compiler" in caplog.text and "torch operations run instead" in caplog.text
    monkeypatch.setenv("DENSEFORMER_HC_KERNELS", "0")
    assert hc_native.lib.__wrapped__() is None


def test_an_unusable_kernel_cache_falls_back_naming_it(tmp_path, monkeypatch, caplog):
    """A cache path that cannot be a directory (here: under a file) is a warning naming the
    path, and torch runs."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("DENSEFORMER_KERNEL_CACHE", str(blocker / "kernels"))
    with caplog.at_level(logging.WARNING, logger=hc_native.__name__):
        assert hc_native.lib.__wrapped__() is None
    assert str(blocker) in caplog.text


def test_build_is_cached_per_source_and_a_failing_compiler_falls_back(tmp_path, monkeypatch,
                                                                      caplog):
    """The second build finds the first's library (no compile); a compiler that fails is
    a warning with its exit, not an error."""
    first = hc_native.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert hc_native.build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("DENSEFORMER_KERNEL_CACHE", str(tmp_path / "other"))
    with caplog.at_level(logging.WARNING, logger=hc_native.__name__):
        assert hc_native.lib.__wrapped__() is None
    assert "could not be built" in caplog.text
