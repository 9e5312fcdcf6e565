"""Activation checkpointing (parallel/strategies/checkpointing.py): same loss and gradients as
`none`, and what each mode keeps.

Single process, fp32, dropout on (the recomputation must replay the same masks). Tolerance:
loss 1e-6 absolute, every gradient 1e-6 relative per tensor, against `none` with the same DWA
implementation (in practice the results are bitwise equal). With ZeRO and TP the modes run in
tests/test_zero.py against the single-process AdamW run.
"""

from __future__ import annotations

import pytest
import torch

CASES = {  # name -> DenseFormerConfig overrides
    "dense-1x1": dict(n_layers=4),
    "dense-2x3": dict(n_layers=7, dwa_dilation=2, dwa_period=3),
    "dense-4x5": dict(n_layers=10, dwa_dilation=4, dwa_period=5),
    "last-2": dict(n_layers=5, dwa_window=2),
    "transformer": dict(n_layers=3, dwa=False),
}
SHAPE = dict(d_model=32, n_heads=2, vocab_size=200, seq_len=16, dropout=0.1)
VARIANTS = [("block", 1), ("block", 2), ("dwa_block", 1), ("dwa_block", 2), ("dwa_block", 3)]


def make_model(case: str):
    from pretrain.model import DenseFormer, DenseFormerConfig

    model = DenseFormer(DenseFormerConfig(**SHAPE, **CASES[case]), seed=3)
    if model.dwa_alpha is not None:  # away from the identity, so alpha gradients matter
        with torch.no_grad():
            gen = torch.Generator().manual_seed(1)
            model.dwa_alpha.add_(torch.randn(model.dwa_alpha.shape, generator=gen)
                                 * model.dwa_mask)
    return model


def functional_loss(model, tokens, targets, functional: bool):
    y = model.run_blocks(model.embed(tokens), functional=functional)
    return model.head_loss(model.final_norm(y), model.head_weight, targets)


def loss_and_grads(model, mode: str, every: int, functional: bool):
    from parallel.strategies.checkpointing import apply_activation_checkpointing

    apply_activation_checkpointing(model, mode, every)
    model.zero_grad(set_to_none=True)
    tokens = torch.randint(0, 200, (2, 17), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(11)  # dropout
    loss = functional_loss(model, tokens[:, :-1], tokens[:, 1:], functional)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_every_mode_gives_the_loss_and_gradients_of_none(case):
    model = make_model(case)
    for functional in (False, True):
        ref_loss, ref_grads = loss_and_grads(model, "none", 1, functional)
        for mode, every in VARIANTS:
            loss, grads = loss_and_grads(model, mode, every, functional)
            assert abs(loss - ref_loss) <= 1e-6, (case, mode, every, functional)
            for name, ref in ref_grads.items():
                rel = ((grads[name] - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                assert rel <= 1e-6, (case, mode, every, functional, name, rel)


def test_units_cover_the_blocks_in_order():
    from parallel.strategies.checkpointing import ActivationCheckpointing

    assert ActivationCheckpointing("block", 1).units(3) == [(1, 1), (2, 2), (3, 3)]
    assert ActivationCheckpointing("dwa_block", 2).units(5) == [(1, 2), (3, 4), (5, 5)]
    assert ActivationCheckpointing("dwa_block", 9).units(4) == [(1, 4)]
    with pytest.raises(ValueError, match="mode"):
        ActivationCheckpointing("blocks")
    with pytest.raises(ValueError, match="every"):
        ActivationCheckpointing("block", 0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["dense-1x1", "dense-2x3", "dense-4x5", "transformer"])
def test_dwa_block_stores_each_read_output_once(case):
    """dwa_block keeps exactly: the X_j later DWAs read (the buffers, one slot each), the
    inputs of units that no DWA reads, and the LM head's tensors; block internals, DWA
    outputs Y_i and second copies of X_j are all recomputed. Checked against autograd."""
    from parallel.strategies.checkpointing import apply_activation_checkpointing
    from parallel.strategies.memory import ActivationShape, Precision
    from parallel.strategies.memory_probe import measure_activations

    model = make_model(case)
    cfg = model.config
    shape = ActivationShape(micro_batch=2, seq=16, hidden=32, heads=2, mlp_ratio=4,
                            padded_vocab=cfg.padded_vocab_size, vocab=200, tp=1,
                            sequence_parallel=False, precision=Precision(4, 4, 4))
    tokens = torch.randint(0, 200, (2, 17), generator=torch.Generator().manual_seed(2))
    stored = cfg.dwa_pattern.stored
    reads = cfg.dwa_pattern.inputs
    slack = 64 * len(reads)
    totals = {}
    for functional in (False, True):
        apply_activation_checkpointing(model, "dwa_block", 1)
        report = measure_activations(model, tokens[:, :-1], tokens[:, 1:],
                                     loss_fn=lambda x, t, f=functional: functional_loss(
                                         model, x, t, f))
        kept_inputs = [j for j in range(cfg.n_layers) if j not in reads
                       and (functional or j not in stored)]
        if not functional:
            assert report.stored_outputs == len(stored) == len(model.dwa_pattern.slot)
            assert report.dwa_buffer_bytes == len(stored) * shape.stream_tensor
            # Autograd itself keeps only the head and the unit inputs nobody else stores
            # (and each DWA outside a unit its few alpha weights: a few bytes).
            extra = report.saved_bytes - shape.head - len(kept_inputs) * shape.stream_tensor
            assert 0 <= extra <= slack, (report.largest, extra)
        totals[functional] = report.saved_bytes + report.dwa_buffer_bytes
    # The functional DWA keeps X_j by reference instead of in buffers: the same bytes.
    assert abs(totals[True] - totals[False]) <= slack
