"""Data parallelism through torch DDP (parallel/strategies/ddp.py) equals the flat all-reduce.

Each case runs the trainer's engine (`build_engine`) for 3 AdamW steps twice in one spawn,
`parallel.dp_reduction: ddp` and `flat`, on the same data, and compares per step the summed
micro-batch losses and the global gradient norms (1e-6 relative at the first step: DDP
divides each gradient by DP before it sums, the flat path after, so the last bits differ;
1e-5 once AdamW's normalised updates have amplified them), and at the end every
parameter of the rank (1e-6 absolute: AdamW's normalised step turns a last-bit difference in
a near-zero gradient entry into a move of up to ~2e-7 at lr 1e-2). Before the update, DDP's
gradients are already the DP mean (equal on both DP ranks), the flat path's still the rank's
own: proof that DDP reduced during the backward.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed_test

MODEL = ["model.n_layers=6", "model.d_model=32", "model.n_heads=2", "model.vocab_size=128",
         "model.seq_len=16"]
BASE = [*MODEL, "train.batch_size=8", "parallel.microbatches=2", "train.steps=3",
        "optim.lr=1e-2", "optim.warmup_steps=1", "optim.grad_clip=0.5"]
STEPS = 3
TOL = 1e-6
LATER_TOL = 1e-5  # steps 2 and 3: after AdamW updates (measured 1.4e-6 at PP2 x DP2)


def engine_run(world_size: int, reduction: str, *overrides: str,
               dtype: torch.dtype = torch.float32) -> dict:
    """3 steps of the trainer's engine on this rank's DP slice of fixed random batches (under
    autocast to `dtype`, as the trainer runs them)."""
    from parallel.primitives.layout import setup_layout
    from pretrain.config import load_config
    from pretrain.engine import build_engine, dp_reduction
    from pretrain.evaluate import autocast_for

    cfg = load_config(None, [*BASE, f"parallel.dp_reduction={reduction}", *overrides],
                      world_size=world_size)
    layout = setup_layout(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.timeout_s)
    engine = build_engine(cfg.model, cfg, layout, dtype)
    data = torch.randint(0, 128, (STEPS, 8, 17), generator=torch.Generator().manual_seed(3))
    out = {"reduction": dp_reduction(cfg, layout), "losses": [], "norms": [],
           "describe": engine.describe()}
    for step in range(STEPS):
        engine.set_lr(1e-2)
        local = data[step].chunk(layout.dp)[layout.dp_rank]
        with autocast_for(layout.device, dtype):
            loss = engine.forward_backward(local[:, :-1], local[:, 1:],
                                           cfg.parallel.microbatches)
        out["losses"].append(loss.item())
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in engine.model.named_parameters()
                            if p.grad is not None}
        out["norms"].append(float(engine.update()))  # a device tensor without ZeRO
    out["params"] = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    return out


def both(world: int, overrides: tuple[str, ...] = ()) -> dict:
    """The ddp and the flat run of one layout, in one spawn."""
    return {r: engine_run(world, r, *overrides) for r in ("ddp", "flat")}


def assert_equal_runs(results: list[dict], dp_ranks: list[list[int]]) -> None:
    for rank, result in enumerate(results):
        ddp, flat = result["ddp"], result["flat"]
        assert ddp["reduction"] == "ddp" and flat["reduction"] == "flat"
        for key in ("losses", "norms"):
            torch.testing.assert_close(torch.tensor(ddp[key][0]), torch.tensor(flat[key][0]),
                                       rtol=TOL, atol=0, msg=f"rank {rank} step 1 {key}")
            torch.testing.assert_close(torch.tensor(ddp[key]), torch.tensor(flat[key]),
                                       rtol=LATER_TOL, atol=0, msg=f"rank {rank} {key}")
        for name, value in flat["params"].items():
            torch.testing.assert_close(ddp["params"][name], value, rtol=TOL, atol=TOL,
                                       msg=f"rank {rank} {name}")
    for pair in dp_ranks:  # ranks that differ only in their DP rank
        a, b = (results[r] for r in pair)
        for name, grad in a["ddp"]["grads"].items():
            torch.testing.assert_close(b["ddp"]["grads"][name], grad, rtol=1e-6, atol=1e-8)
        assert any(not torch.allclose(a["flat"]["grads"][n], b["flat"]["grads"][n])
                   for n in a["flat"]["grads"]), "the flat path reduced before the update?"


@pytest.mark.timeout(240)
def test_ddp_equals_flat_reduction_at_dp2():
    results = run_distributed_test(both, world_size=2, timeout_s=200, world=2)
    assert_equal_runs(results, [[0, 1]])


# 6 blocks split 3 + 3 with a 1 x 5 pattern: the only DWA (after block 5) is on the second
# stage and raw transfer sends the X_j unweighted, so the first stage's DDP module holds an
# alpha matrix that no forward reads.
PIPELINE = ("parallel.pp=2", "model.dwa_period=5", "parallel.pp_split=[3,3]",
            "parallel.pp_transfer=raw")


@pytest.mark.timeout(300)
def test_ddp_stages_equal_flat_reduction_at_pp2_dp2():
    results = run_distributed_test(both, world_size=4, timeout_s=280, set_up_groups=False,
                                   world=4, overrides=PIPELINE)
    # megatron-core's rank order is tp-dp-pp: ranks 0, 1 are stage 0 at DP ranks 0, 1.
    assert_equal_runs(results, [[0, 1], [2, 3]])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_equals_flat_reduction_at_tp2_dp2_with_sp_and_checkpointing():
    overrides = ("parallel.tp=2", "parallel.sequence_parallel=true",
                 "parallel.activation_checkpointing=block")
    results = run_distributed_test(both, world_size=4, timeout_s=280, set_up_groups=False,
                                   world=4, overrides=overrides)
    assert_equal_runs(results, [[0, 2], [1, 3]])  # ranks tp-major: (0, 1) one TP group


def test_interleaved_stages_fall_back_to_flat():
    from parallel.primitives.layout import Layout
    from pretrain.config import load_config
    from pretrain.engine import dp_reduction

    cfg = load_config(None, [*BASE, "parallel.pp=2", "parallel.virtual_stages=2",
                             "parallel.microbatches=2"], world_size=4)
    layout = Layout(world=4, rank=0, tp=1, tp_rank=0, tp_src=0, tp_group=None, dp=2,
                    dp_rank=0, dp_group=None, device=torch.device("cpu"), pp=2)
    assert cfg.parallel.dp_reduction == "ddp" and dp_reduction(cfg, layout) == "flat"
