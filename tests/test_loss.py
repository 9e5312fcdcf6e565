"""The chunked LM-head cross entropy (pretrain/model/loss.py) against F.cross_entropy on the
full logits: values and gradients at one rank over odd shapes and chunk sizes, under bf16
autocast, without gradients, and vocabulary- and sequence-parallel at TP = 2 (gloo); the
chunk size left out of checkpoint fingerprints."""

import pytest
import torch
import torch.nn.functional as F

from pretrain.model.loss import linear_cross_entropy
from tests.distributed import run_distributed_test

VOCAB, PADDED, WIDTH = 37, 48, 16  # 11 padded rows: never predicted


def problem(batch: int, seq: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, WIDTH, generator=gen)
    weight = torch.randn(PADDED, WIDTH, generator=gen)
    weight[VOCAB:] *= 3  # large padded rows would dominate if they were not masked
    targets = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    return hidden, weight, targets


def reference(hidden, weight, targets, scale: float = 1.0):
    """F.cross_entropy on the whole logits (fp32), its value and the gradients of scale x it."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = F.cross_entropy((h @ w[:VOCAB].t()).float().flatten(0, 1), targets.flatten())
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("batch,seq,chunk", [(3, 5, 4), (2, 7, 1), (1, 9, 4096), (4, 3, 5)])
def test_values_and_gradients_equal_f_cross_entropy(batch, seq, chunk):
    hidden, weight, targets = problem(batch, seq)
    want, want_dh, want_dw = reference(hidden, weight, targets, scale=1.7)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_cross_entropy(h, w, targets, vocab_size=VOCAB, chunk_tokens=chunk)
    (loss * 1.7).backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(h.grad, want_dh)
    torch.testing.assert_close(w.grad, want_dw)
    assert w.grad[VOCAB:].abs().max() == 0  # the padded rows get no gradient


def test_under_bf16_autocast_matches_f_linear_in_bf16_within_rounding():
    hidden, weight, targets = problem(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = linear_cross_entropy(h, w, targets, vocab_size=VOCAB, chunk_tokens=8)
        h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        want = F.cross_entropy(F.linear(h2, w2[:VOCAB]).float().flatten(0, 1), targets.flatten())
    loss.backward()
    want.backward()
    assert loss.dtype == torch.float32 and h.grad.dtype == w.grad.dtype == torch.float32
    torch.testing.assert_close(loss, want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(h.grad, h2.grad, rtol=3e-2, atol=3e-3)
    torch.testing.assert_close(w.grad, w2.grad, rtol=3e-2, atol=3e-3)


def test_without_gradients_only_the_value():
    hidden, weight, targets = problem(2, 5)
    want, _, _ = reference(hidden, weight, targets)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden.requires_grad_(), weight, targets,
                                    vocab_size=VOCAB, chunk_tokens=3)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, want)


def tp_loss(sequence_parallel: bool) -> dict:
    """(each rank) the loss and gradients from this rank's vocabulary rows (and, under
    sequence parallelism, its half of the sequence), chunked over 3 tokens."""
    from parallel.primitives import groups

    group = groups.tp_group()
    rank = group.rank()
    hidden, weight, targets = problem(2, 6)
    shard = PADDED // 2
    w = weight[rank * shard:(rank + 1) * shard].clone().requires_grad_()
    h = hidden
    if sequence_parallel:  # this rank's (S / TP, B, H) slice of the sequence-first stream
        h = hidden.transpose(0, 1)[rank * 3:(rank + 1) * 3]
    h = h.clone().requires_grad_()
    loss = linear_cross_entropy(h, w, targets, vocab_size=VOCAB, tp_group=group,
                                sequence_parallel=sequence_parallel, chunk_tokens=3)
    (loss * 1.7).backward()
    return {"loss": loss.detach(), "dh": h.grad, "dw": w.grad}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_vocab_parallel_at_two_ranks_equals_one_rank(sequence_parallel):
    results = run_distributed_test(tp_loss, world_size=2, tp=2, timeout_s=120,
                                   sequence_parallel=sequence_parallel)
    hidden, weight, targets = problem(2, 6)
    want, want_dh, want_dw = reference(hidden, weight, targets, scale=1.7)
    for r in results:
        torch.testing.assert_close(r["loss"], want)
    torch.testing.assert_close(torch.cat([r["dw"] for r in results]), want_dw)
    if sequence_parallel:
        dh = torch.cat([r["dh"] for r in results]).transpose(0, 1)
        torch.testing.assert_close(dh, want_dh)
    else:
        for r in results:
            torch.testing.assert_close(r["dh"], want_dh)


def test_the_chunk_size_is_not_part_of_a_checkpoints_fingerprint():
    """model.loss_chunk_tokens changes how the loss is computed, not the model: a run with
    another value resumes, or starts from, the same checkpoints."""
    from pretrain.config import config_to_dict, load_config
    from pretrain.init_from import model_mismatch
    from pretrain.run_dir import fingerprint, fingerprint_mismatch

    def model(*overrides):
        return config_to_dict(load_config(None, list(overrides)))["model"]

    saved, now = model(), model("model.loss_chunk_tokens=512")
    assert fingerprint_mismatch(fingerprint(saved, "t", 0), fingerprint(now, "t", 0)) == []
    assert model_mismatch(fingerprint(saved, "t", 0)["model"], now) == []
    other = model("model.loss_chunk_tokens=512", "model.n_layers=6")
    assert fingerprint_mismatch(fingerprint(saved, "t", 0), fingerprint(other, "t", 0)) != []
