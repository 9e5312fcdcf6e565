"""The training step at one TP rank: plain ops where megatron's would talk to a one-rank
group, no collective call and no host sync in a trainer step, torch's fused AdamW skipping
non-finite steps on the device, and an aten op count held against `anchor-rope`."""

import sys
from collections import Counter

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tests.conftest import ROOT
from tests.test_train import TINY

# torch.distributed's collectives reach the dispatcher as c10d ops, whatever the backend.
COLLECTIVE_PREFIX = "c10d::"
# What reads a device value on the host: .item(), float(t), bool(t), `if t:`.
HOST_SYNCS = ("aten::_local_scalar_dense", "aten::item", "aten::is_nonzero")


# The CPU kernel of fused AdamW reads each step count with item() from host memory; that is
# no wait for a device (the CUDA kernel reads it on the device), so not counted.
HOST_MEMORY_READERS = ("aten::_fused_adamw_",)


def profiled(fn) -> tuple[object, Counter]:
    """fn()'s result and the names of the ops it dispatched (with their counts); host syncs
    counted under the name "host syncs"."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = fn()
    ops = Counter(event.name for event in prof.events())
    ops["host syncs"] = sum(1 for event in prof.events() if event.name in HOST_SYNCS
                            and not _inside(event, HOST_MEMORY_READERS))
    return result, ops


def _inside(event, names: tuple[str, ...]) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in names:
            return True
        parent = parent.cpu_parent
    return False


def collectives(ops: Counter) -> int:
    return sum(n for name, n in ops.items() if name.startswith(COLLECTIVE_PREFIX))


def test_one_rank_cross_entropy_and_embedding_equal_megatrons():
    """At one TP rank our chunked head loss and F.embedding give megatron's vocab-parallel
    values and gradients (padding rows masked as the model masks them); megatron's cross
    entropy calls all_reduce three times on the one-rank group, ours never."""
    from megatron.core.tensor_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy

    from parallel.primitives import groups
    from pretrain.model import DenseFormer, DenseFormerConfig
    from pretrain.model.loss import linear_cross_entropy

    groups.ensure_initialized()
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(3, 5, 16, generator=gen), torch.randn(48, 16, generator=gen)
    targets = torch.randint(0, 40, (3, 5), generator=gen)
    ours_in, theirs_in = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    ours, ops = profiled(lambda: linear_cross_entropy(
        ours_in, weight, targets, vocab_size=40, tp_group=groups.tp_group(), chunk_tokens=4))

    def megatron_loss():
        logits = theirs_in @ weight.t()
        logits = logits.masked_fill(torch.arange(48) >= 40, torch.finfo(torch.float32).min)
        return vocab_parallel_cross_entropy(logits, targets).mean()

    theirs, their_ops = profiled(megatron_loss)
    torch.testing.assert_close(ours, theirs)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours_in.grad, theirs_in.grad)
    assert collectives(ops) == 0 and collectives(their_ops) == 3

    model = DenseFormer(DenseFormerConfig(n_layers=1, d_model=16, n_heads=2, seq_len=8,
                                          vocab_size=40))
    tokens = torch.randint(0, 40, (2, 8), generator=gen)
    plain = model.embed(tokens)
    megatron = VocabParallelEmbedding.forward(model.embedding, tokens)
    assert torch.equal(plain, megatron)
    grad = torch.randn_like(plain)
    (g_plain,) = torch.autograd.grad(plain, model.embedding.weight, grad)
    (g_megatron,) = torch.autograd.grad(megatron, model.embedding.weight, grad)
    assert torch.equal(g_plain, g_megatron)
    assert dict(model.named_parameters())["embedding.weight"].tensor_model_parallel


def trainer_step_ops(data: str, run_dir: str) -> dict:
    """(in one rank) a warm-up step, then the op counts of a real trainer step (batch,
    forward, backward, norm, clip, fused AdamW) and of a fetch point (the rows' one
    transfer and the stop check)."""
    from pretrain.config import load_config
    from pretrain.optim import is_fused
    from pretrain.signals import StopRequest
    from pretrain.step_rows import PendingRows
    from pretrain.train import Trainer, distributed_session

    cfg = load_config(ROOT / "configs/tiny.yaml",
                      [*TINY, f"data.path={data}", f"run.dir={run_dir}", "data.val_batches=0",
                       "tracking.enabled=false"], world_size=1)
    with distributed_session():
        trainer = Trainer(cfg)
        try:
            batches, pending = iter(trainer.loader), PendingRows()
            pending.add(trainer.train_step(trainer.next_batch(batches)))  # AdamW state made
            row, step_ops = profiled(lambda: trainer.train_step(trainer.next_batch(batches)))
            pending.add(row)
            stop = StopRequest(signals=())
            (rows, _), fetch_ops = profiled(lambda: (pending.fetch(),
                                                     stop.agreed(trainer.layout.device))[0])
            return {"fused": is_fused(trainer.engine.optimizer), "step_ops": step_ops,
                    "fetch_ops": fetch_ops, "rows": rows}
        finally:
            trainer.loader.close()
            if trainer.lock is not None:
                trainer.lock.release()


@pytest.mark.timeout(300)
def test_a_one_process_trainer_step_makes_no_collective_call_and_no_host_sync(tiny_data,
                                                                             tmp_path):
    from tests.distributed import run_distributed_test

    (result,) = run_distributed_test(trainer_step_ops, world_size=1, timeout_s=240,
                                     set_up_groups=False, data=str(tiny_data),
                                     run_dir=str(tmp_path / "run"))
    assert result["fused"]  # optim.fused=auto on this torch's CPU
    step_ops, fetch_ops = result["step_ops"], result["fetch_ops"]
    assert step_ops["aten::_fused_adamw_"] > 0 and step_ops["aten::mm"] > 0  # a real step
    assert collectives(step_ops) == 0, {n: c for n, c in step_ops.items() if "c10d" in n}
    assert step_ops["host syncs"] == 0, {n: step_ops[n] for n in HOST_SYNCS}
    assert collectives(fetch_ops) == 0
    rows = result["rows"]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(isinstance(r[k], float) for r in rows for k in ("loss", "grad_norm"))


def _model_and_update(fused: bool):
    from parallel.primitives import groups
    from parallel.primitives.layout import Layout
    from pretrain.config import Config
    from pretrain.engine import AdamWUpdate
    from pretrain.model import DenseFormer, DenseFormerConfig
    from pretrain.optim import build_optimizer

    groups.ensure_initialized()
    cfg = Config()
    cfg.optim.fused = fused
    model = DenseFormer(DenseFormerConfig(n_layers=2, d_model=16, n_heads=2, seq_len=8,
                                          vocab_size=40))
    optimizer = build_optimizer(model, cfg.optim)
    layout = Layout(world=1, rank=0, tp=1, tp_rank=0, tp_src=0, tp_group=groups.tp_group(),
                    dp=1, dp_rank=0, dp_group=None, device=torch.device("cpu"))
    return model, optimizer, AdamWUpdate(model, optimizer, layout, grad_clip=0.5)


def _snapshot(model, optimizer) -> list[torch.Tensor]:
    return [t.clone() for p in model.parameters()
            for t in (p.detach(), *optimizer.state.get(p, {}).values())]


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_fused_adamw_skips_a_non_finite_step_on_the_device_bitwise(poison):
    """optim.fused: the fused AdamW's steps equal the foreach AdamW's; a step whose gradient
    norm is not finite leaves parameters and AdamW state untouched, bitwise, in both."""
    tokens = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    runs = {}
    for fused in (True, False):
        model, optimizer, update = _model_and_update(fused)
        assert optimizer.defaults["fused"] is (True if fused else None)
        for _ in range(2):
            model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
            assert torch.isfinite(update.update())
        before = _snapshot(model, optimizer)
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        model.blocks[0].attn.qkv.weight.grad[0, 0] = poison
        assert not torch.isfinite(update.update())
        after = _snapshot(model, optimizer)
        assert len(before) == len(after) and all(map(torch.equal, before, after)), fused
        assert all(p.grad is None for p in model.parameters())
        assert not hasattr(optimizer, "found_inf")
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        update.update()
        runs[fused] = dict(model.named_parameters())
    for name, value in runs[True].items():
        torch.testing.assert_close(value, runs[False][name], rtol=1e-5, atol=1e-6)


def test_optim_fused_false_is_foreach_and_true_is_fused():
    from pretrain.config import load_config
    from pretrain.model import DenseFormer, DenseFormerConfig
    from pretrain.optim import build_optimizer, is_fused

    model = DenseFormer(DenseFormerConfig(n_layers=1, d_model=16, n_heads=2, seq_len=8,
                                          vocab_size=40))
    for value, fused in (("auto", True), ("true", True), ("false", False)):
        cfg = load_config(None, [f"optim.fused={value}"])
        assert is_fused(build_optimizer(model, cfg.optim)) is fused, value


def _train_step(model, loss, tokens: torch.Tensor):
    """One step of `model` (forward and backward of `loss`, fused AdamW) as a function."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        loss(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def step_op_counts(layers: int, width: int) -> tuple[int, int]:
    """aten ops dispatched by one train step (forward, backward, fused AdamW) of our
    Transformer and of `anchor-rope` at one shape, on the same tokens (one process)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_model import config, parse_args
    from nanogpt_anchor import AnchorGPT

    from pretrain.model import DenseFormer

    args = parse_args(["--layers", str(layers), "--width", str(width), "--heads", "2",
                       "--seq", "16", "--vocab", "64"])
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    ours = DenseFormer(config(args, None))
    anchor = AnchorGPT(layers, width, 2, 16, 64, rope=True)
    counts = []
    for model, loss in ((ours, ours.loss), (anchor, anchor)):
        step = _train_step(model, loss, tokens)
        step()  # AdamW state made
        _, ops = profiled(step)
        counts.append(sum(n for name, n in ops.items() if name.startswith("aten::")))
    return counts[0], counts[1]


@pytest.mark.parametrize("layers", [2, 8])
def test_our_step_dispatches_at_most_105_percent_of_anchor_ropes_aten_ops(layers):
    ours, anchor = step_op_counts(layers, width=32)
    assert ours <= 1.05 * anchor, (ours, anchor, ours / anchor)
