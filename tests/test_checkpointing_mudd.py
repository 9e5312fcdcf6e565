"""Activation checkpointing of MUDD (parallel/strategies/checkpointing.py): every mode gives
the loss and gradients of `none`. A unit reads the held X_j (the `Store` results) of the
mixes it forms and recomputes them into the same buffer slots; `dwa_block` recomputes the
unit's leading mix. fp64, dropout on, 1e-10 relative per gradient tensor."""

from __future__ import annotations

import pytest
import torch

from tests.test_checkpointing_attnres import assert_every_mode_gives_none


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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dynamic,streams", [
    (True, "qkvr"), pytest.param(False, "r", marks=pytest.mark.slow)])
def test_every_mode_gives_the_loss_and_gradients_of_none(dynamic, streams):
    assert_every_mode_gives_none(make_model(dynamic, streams), (dynamic, streams))
