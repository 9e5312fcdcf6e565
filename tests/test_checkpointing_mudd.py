"""Activation checkpointing of MUDD (parallel/strategies/checkpointing.py): every mode gives
the loss and gradients of `none`. A unit reads the held X_j (the `Store` results) of the
mixes it forms and recomputes them into the same buffer slots; `dwa_block` recomputes the
unit's leading mix. fp64, dropout on, 1e-10 relative per gradient tensor."""

from __future__ import annotations

import pytest
import torch

VARIANTS = [("block", 1), ("block", 2), ("dwa_block", 1), ("dwa_block", 3)]


def make_model(dynamic: bool, streams: str):
    from pretrain.model import DenseFormer, DenseFormerConfig

    cfg = DenseFormerConfig(n_layers=5, d_model=32, n_heads=2, vocab_size=200, seq_len=16,
                            dropout=0.1, connection="mudd", mudd_dynamic=dynamic,
                            mudd_streams=streams)
    model = DenseFormer(cfg, seed=3).double()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # away from init, so every weight's gradient matters
        for name, p in model.named_parameters():
            if name.startswith("mudd_"):
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def loss_and_grads(model, mode: str, every: int):
    from parallel.strategies.checkpointing import apply_activation_checkpointing

    apply_activation_checkpointing(model, mode, every)
    model.zero_grad(set_to_none=True)
    tokens = torch.randint(0, 200, (2, 17), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(11)  # dropout
    loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dynamic,streams", [
    (True, "qkvr"), pytest.param(False, "r", marks=pytest.mark.slow)])
def test_every_mode_gives_the_loss_and_gradients_of_none(dynamic, streams):
    model = make_model(dynamic, streams)
    ref_loss, ref_grads = loss_and_grads(model, "none", 1)
    for mode, every in VARIANTS:
        loss, grads = loss_and_grads(model, mode, every)
        assert abs(loss - ref_loss) <= 1e-12, (mode, every)
        for param, ref in ref_grads.items():
            rel = ((grads[param] - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            assert rel <= 1e-10, (mode, every, param, rel)
