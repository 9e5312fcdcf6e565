"""Activation checkpointing of Attention Residuals (parallel/strategies/checkpointing.py):
every mode gives the loss and gradients of `none`.

A unit's held inputs are counted by sub-layer output index (X_j, j = 1..2d), its steps'
residuals (the open group's partial sum) come in with them, and a unit makes the phase-1
prefixes of its own consumers only, so a recomputed unit makes the same ones again. The
spans of consumers that share a prefix differ between modes (a unit cuts a group), which
sums the same terms in another order: fp64 here, dropout on, tolerance 1e-10 relative per
gradient tensor and 1e-12 on the loss.
"""

from __future__ import annotations

import pytest
import torch

# n_layers=5: 10 sub-layers; groups of 5 (N=2) end inside a block, groups of 2 (N=5) with
# each block; full AttnRes reads every X_j.
BLOCKS = {"full": None, "block-2": 2, "block-5": 5}
VARIANTS = [("block", 1), ("block", 2), ("dwa_block", 1), ("dwa_block", 3)]


def make_model(blocks):
    from pretrain.model import DenseFormer, DenseFormerConfig

    cfg = DenseFormerConfig(n_layers=5, d_model=32, n_heads=2, vocab_size=200, seq_len=16,
                            dropout=0.1, connection="attnres", attnres_blocks=blocks)
    model = DenseFormer(cfg, seed=3).double()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # away from uniform weights, so the queries' gradients matter
        model.attnres_query.copy_(torch.randn(model.attnres_query.shape, generator=gen,
                                              dtype=torch.float64))
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


def assert_every_mode_gives_none(model, label: tuple) -> None:
    """Each of VARIANTS on `model` (fp64, vocabulary 200, dropout on) against `none`: the
    loss to 1e-12 absolute, every gradient to 1e-10 relative; `label` names the model."""
    ref_loss, ref_grads = loss_and_grads(model, "none", 1)
    for mode, every in VARIANTS:
        loss, grads = loss_and_grads(model, mode, every)
        assert abs(loss - ref_loss) <= 1e-12, (*label, mode, every)
        for param, ref in ref_grads.items():
            rel = ((grads[param] - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            assert rel <= 1e-10, (*label, mode, every, param, rel)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(BLOCKS))
def test_every_mode_gives_the_loss_and_gradients_of_none(name):
    assert_every_mode_gives_none(make_model(BLOCKS[name]), (name,))


def test_a_unit_reads_the_residual_made_before_it():
    """Block AttnRes, groups of 3 sub-layers over 3 blocks: the unit of block 2 (sub-layers
    3, 4) reads X_0 and, whether or not it forms its entry itself, X_2: the partial sum
    that sub-layer 3 adds its branch to (made before the unit, by sub-layer index)."""
    from parallel.strategies.checkpointing import _UnitRunner
    from pretrain.model import DenseFormer, DenseFormerConfig

    cfg = DenseFormerConfig(n_layers=3, d_model=16, n_heads=2, vocab_size=50, seq_len=4,
                            connection="attnres", attnres_blocks=2)
    model = DenseFormer(cfg)
    runner = _UnitRunner(model, torch.zeros(1, 4, 16), False, lead_dwa=False)
    start, stop = model.program.block_steps[2][0], model.program.block_steps[2][1]
    assert runner._reads(start, stop, recompute=False) == [0, 2]
    assert runner._reads(start, stop, recompute=True) == [0, 2]
