"""Pipeline parallelism of Attention Residuals (pretrain/model/attnres_program.py): what
crosses each boundary against an independent count, the consumer-state merge against an
fp64 softmax, and PP2, PP3 and interleaved PP against one process (loss and every
gradient, the AttnRes queries and key norms included).

Tolerances (fp32): loss 1e-5 absolute, every gradient 1e-5 relative per tensor (3e-5 with
TP = 2, slow only: the row-parallel sums round in another order, measured 1.1e-5 on one
weight with raw sources). A stage that receives consumer states forms the softmax in two
parts and merges them, so it rounds differently from one process (measured: up to 3e-6).
The single-process references are computed in this test process; the ranks load the same
weights. The exhaustive layout matrix is marked slow.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from tests.pipeline_cases import check_stages_chained, reference_step, run_cases_on_ranks
from tests.test_pipeline import random_splits

SHAPE = dict(d_model=32, n_heads=4, vocab_size=200, seq_len=8, connection="attnres")
MODELS = {  # name -> (n_layers, attnres_blocks, extra DenseFormerConfig fields)
    "full-4": (4, None, {}),
    "block-4x4": (4, 4, {}),  # S = 2: every boundary closes a group
    "block-6x4": (6, 4, {}),  # S = 3: boundaries inside a group send its partial sum
    "full-5-llama": (5, None, dict(block="llama", n_kv_heads=2, tie_embeddings=False)),
}


def attnres_config(name: str):
    from pretrain.model import DenseFormerConfig

    n_layers, blocks, extra = MODELS[name]
    return DenseFormerConfig(n_layers=n_layers, attnres_blocks=blocks, **SHAPE, **extra)


# ---------------------------------------------------------------------------------------------
# What crosses a boundary, against an independent count


def expected(d: int, blocks: int | None, b: int) -> dict:
    """Sources, consumers and the fewest hidden-size tensors at the boundary after block b,
    enumerated from the paper's sources (docs/connections.md#attention-residuals)."""
    n_sub = 2 * d
    size = 1 if blocks is None else n_sub // blocks
    cut = 2 * b
    consumers = list(range(cut + 1, n_sub + 2))
    # Consumer c reads the completed group sums below c and its group's partial sum.
    read = {j for c in consumers for j in [*range(0, c, size), c - 1] if j <= cut}
    partial = 1 if cut % size else 0
    return {"sources": len(read), "consumers": len(consumers),
            "fewest": min(len(read), len(consumers) + partial)}


def test_boundary_counts_meet_the_bound():
    from parallel.strategies.plan import build_plan
    from pretrain.model import DenseFormerConfig

    rng = random.Random(0)
    checked = states = 0
    for d in range(2, 13):
        for blocks in [None, *(n for n in range(1, 2 * d + 1) if 2 * d % n == 0)]:
            cfg = DenseFormerConfig(n_layers=d, attnres_blocks=blocks, **SHAPE)
            for n_stages in range(2, min(d, 5) + 1):
                for split in random_splits(d, n_stages, 2, rng):
                    plan = build_plan(cfg, n_stages, split=split)
                    for count, program in zip(plan.counts, plan.programs, strict=False):
                        want = expected(d, blocks, count["after_block"])
                        sent = program.outgoing
                        hidden = [item for item in sent if item.kind != "lse"]
                        assert count["sources"] == count["raw"] == want["sources"]
                        assert count["consumers"] == want["consumers"]
                        assert count["optimal"] == len(hidden) == want["fewest"], (d, blocks)
                        assert count["per_token"]["optimal"] == len(sent) - len(hidden) <= 1
                        if blocks is None:
                            assert count["optimal"] == count["bound"] == min(
                                want["sources"], want["consumers"])
                        else:
                            assert count["optimal"] <= count["raw"] <= blocks + 1
                            assert count["bound"] == blocks + 1
                        states += len(sent) > len(hidden)
                        checked += 1
    assert checked > 500 and states > 100


def test_states_follow_raw_sources_never_back():
    from parallel.strategies.plan import build_plan
    from pretrain.model import DenseFormerConfig

    cfg = DenseFormerConfig(n_layers=12, **SHAPE)
    plan = build_plan(cfg, 6, split=[2] * 6)
    kinds = ["state" if any(i.kind == "state" for i in p.outgoing) else "raw"
             for p in plan.programs[:-1]]
    # Full AttnRes, 25 consumers: boundary after block b has 2b + 1 sources, 25 - 2b consumers.
    assert kinds == ["raw", "raw", "raw", "state", "state"]
    assert [c["optimal"] for c in plan.counts] == [5, 9, 13, 9, 5]


def test_boundary_state_examples():
    from pretrain.model.attnres_layout import AttnResLayout
    from pretrain.model.attnres_program import bound, boundary_state

    names = lambda items: [str(item) for item in items]  # noqa: E731
    full = AttnResLayout(4)  # 8 sub-layers, 9 consumers
    assert names(boundary_state(full, 2)) == ["X_0", "X_1", "X_2", "X_3", "X_4"]  # a tie
    assert names(boundary_state(full, 3)) == ["state_7", "state_8", "state_9", "lse[3]"]
    assert names(boundary_state(full, 3, "raw")) == [f"X_{j}" for j in range(7)]
    assert bound(full, 3) == (3, "min(sources, consumers)")
    block = AttnResLayout(6, 4)  # S = 3: the boundary after block 5 leaves group 4 open
    assert names(boundary_state(block, 5)) == ["X_10", "state_11", "state_12", "state_13",
                                               "lse[3]"]
    assert names(boundary_state(block, 5, "raw")) == ["X_0", "X_3", "X_6", "X_9", "X_10"]
    assert bound(block, 5) == (5, "N + 1 block sums")
    with pytest.raises(ValueError, match="transfer mode"):
        boundary_state(full, 3, "fastest")


def test_plan_prints_the_attnres_counts():
    from parallel.strategies.plan import build_plan

    plan = build_plan(attnres_config("block-6x4"), 2, split=[5, 1])
    report = plan.report(micro_batch=2)
    assert report["connection"] == "attnres" and report["model"] == "AttnRes block 4"
    entry = report["boundaries"][0]
    assert {k: entry[k] for k in ("sources", "consumers", "raw", "optimal", "bound")} == \
        {"sources": 5, "consumers": 3, "raw": 5, "optimal": 4, "bound": 5}
    tokens = 2 * SHAPE["seq_len"]
    assert entry["bytes_per_microbatch"]["optimal"] == (4 * 32 + 3) * tokens * 4
    line = plan.describe(micro_batch=2)[1]
    assert "4 tensors + 1 per-token" in line and "N + 1 block sums" in line
    assert line.endswith("X_10 state_11 state_12 state_13 lse[3]")


# ---------------------------------------------------------------------------------------------
# The state merge against an fp64 softmax


def test_merged_states_equal_one_softmax_in_values_and_gradients():
    from pretrain.model.attnres_mix import group_prefix, merge_partial, merge_states

    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 5, 16, generator=gen, dtype=torch.float64) * (1 + j)
          for j in range(6)]
    queries = torch.randn(3, 16, generator=gen, dtype=torch.float64)
    ref_in = [x.clone().requires_grad_() for x in xs]
    ref_q = queries.clone().requires_grad_()
    eps = 1e-6

    def reference(x, q):  # consumer k over all six sources, then the 7th as a partial sum
        v = torch.stack([t.reshape(-1, 16) for t in x[:5]])
        r = torch.rsqrt(v.square().mean(-1) + eps)
        a = torch.softmax((v @ q.T) * r.unsqueeze(-1), dim=0)
        return [(a[..., k].unsqueeze(-1) * v).sum(0) for k in range(q.shape[0])]

    ours_in = [x.clone().requires_grad_() for x in xs]
    ours_q = queries.clone().requires_grad_()
    before = group_prefix(ours_q, ours_in[:2], eps)  # the sources before a boundary
    after = group_prefix(ours_q, ours_in[2:5], eps)  # those the next stage makes
    merged = [merge_states(*b, *a) for b, a in zip(before, after, strict=True)]
    want = reference(ref_in, ref_q)
    for (o, _), w in zip(merged, want, strict=True):
        torch.testing.assert_close(o, w, rtol=1e-12, atol=1e-12)
    # Through a partial sum as a consumer inside an open group does, then a loss.
    weights = torch.randn(3, generator=gen, dtype=torch.float64)
    loss = sum(w * merge_partial(o, lse, ours_in[5], ours_q[k], eps).square().sum()
               for k, (w, (o, lse)) in enumerate(zip(weights, merged, strict=True)))
    ref_all = [ref_in[5]]
    ref_loss = 0
    for k, w in enumerate(weights):
        v = torch.stack([t.reshape(-1, 16) for t in ref_in[:5] + ref_all])
        r = torch.rsqrt(v.square().mean(-1) + eps)
        a = torch.softmax((v @ ref_q[k]) * r, dim=0)
        ref_loss = ref_loss + w * (a.unsqueeze(-1) * v).sum(0).square().sum()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    loss.backward()
    ref_loss.backward()
    for ours, ref in zip([*ours_in, ours_q], [*ref_in, ref_q], strict=True):
        torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-10, atol=1e-12)


def test_merge_states_is_stable_for_far_apart_lse():
    from pretrain.model.attnres_mix import merge_states

    o1, o2 = torch.ones(3, 4), torch.zeros(3, 4)
    lse1 = torch.tensor([1000.0, -1000.0, 0.0])
    o, lse = merge_states(o1, lse1, o2, torch.zeros(3))
    torch.testing.assert_close(o[:, 0], torch.tensor([1.0, 0.0, 0.5]))
    torch.testing.assert_close(lse, torch.tensor([1000.0, 0.0, 0.6931472]))


# ---------------------------------------------------------------------------------------------
# Stages chained in one process, and the multi-process layouts, against one process


def reference(name: str, batch: int, microbatches: int, seed: int = 0):
    """(full state, tokens (batch, S + 1), loss, {name: full grad}) of the single-process
    model with random queries and key norms (non-uniform depth weights)."""
    from pretrain.model import DenseFormer

    model = DenseFormer(attnres_config(name), seed=7)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.attnres_query.copy_(torch.randn(model.attnres_query.shape, generator=gen))
        model.attnres_key_norm.add_(0.3 * torch.randn(model.attnres_key_norm.shape,
                                                      generator=gen))
    return reference_step(model, batch, microbatches, gen)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("mode", ["raw", "optimal"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_stages_chained_in_one_process_equal_the_model(name, mode, checkpointing):
    from parallel.strategies.plan import build_plan

    ref = reference(name, 4, 1)
    cfg = attnres_config(name)
    d = cfg.n_layers
    splits = [[d - 1, 1], *random_splits(d, min(4, d), 2, random.Random(d))]
    for split in splits:
        plan = build_plan(cfg, len(split), split=split, transfer=mode)
        _, crossed = check_stages_chained(cfg, plan, ref, checkpointing, split)
        assert [len(sent) for sent in crossed] == [len(p.incoming) for p in plan.programs[1:]]


def make_case(name: str, mode: str, m: int, split, virtual_stages: int, tp: int, dp: int,
              sequence_parallel: bool) -> dict:
    """A case for `pipeline_cases`, with its reference (computed here, in the test process);
    TP = 2 sums round in another order, so gradients are held to 3e-5 there."""
    case_split = split(MODELS[name][0])
    return dict(id=f"{name}/{mode}/m{m}/v{virtual_stages}/{case_split}",
                config=attnres_config(name), microbatches=m, split=case_split,
                virtual_stages=virtual_stages, runner_options=dict(transfer=mode),
                grad_tolerance=1e-5 if tp == 1 else 3e-5, sequence_parallel=sequence_parallel,
                reference=reference(name, 2 * dp * m, m, seed=m))


def last_alone(d: int) -> list[int]:
    """PP2 with one block on the last stage: the boundary sends consumer states."""
    return [d - 1, 1]


def three(d: int) -> list[int]:
    """PP3, raw sources across the first boundary and states across the second."""
    return [1, d - 2, 1]


def four(d: int) -> list[int]:
    """Interleaved PP2 x 2 virtual stages (stage s on rank s mod 2)."""
    return [1, 1, d - 3, 1]


LAYOUTS = {  # name -> (pp, virtual stages, split, tp, dp)
    "pp2": (2, 1, last_alone, 1, 1),
    "pp3": (3, 1, three, 1, 1),
    "pp2-interleaved": (2, 2, four, 1, 1),
    "tp2-pp2": (2, 1, last_alone, 2, 1),  # slow only
    "pp2-dp2": (2, 1, last_alone, 1, 2),  # slow only
    "tp2-pp2-sp": (2, 1, last_alone, 2, 1),  # slow only, with sequence parallelism
}
SEQUENCE_PARALLEL = {"tp2-pp2-sp"}
# Default suite: one spawn per layout, full and block AttnRes (block with an open group's
# partial sum crossing beside the states), both modes between them.
DEFAULT_CASES = {
    "pp2": [(["full-4", "block-6x4"], ["optimal"], [2]), (["block-4x4"], ["raw"], [1])],
    "pp3": [(["full-5-llama", "block-6x4"], ["optimal"], [3])],
    "pp2-interleaved": [(["full-4", "block-6x4"], ["optimal"], [2])],
}


def run_layout(layout: str, entries, timeout_s: float) -> None:
    pp, virtual, split, tp, dp = LAYOUTS[layout]
    cases = [make_case(name, mode, m, split, virtual, tp, dp, layout in SEQUENCE_PARALLEL)
             for models, modes, counts in entries
             for name, mode, m in itertools.product(models, modes, counts)]
    run_cases_on_ranks(cases, tp=tp, pp=pp, dp=dp, timeout_s=timeout_s)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(DEFAULT_CASES))
def test_attnres_pipeline_matches_single_process(layout):
    run_layout(layout, DEFAULT_CASES[layout], timeout_s=240)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_attnres_pipeline_exhaustive(layout):
    from parallel.strategies.schedule import schedule_problem

    pp, virtual, _, _, _ = LAYOUTS[layout]
    counts = [m for m in range(1, 7) if schedule_problem(pp, virtual, m) is None]
    run_layout(layout, [(list(MODELS), ["raw", "optimal"], counts)], timeout_s=3500)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cli_attnres_pp2_matches_pp1(tiny_data, tmp_path):
    """The trainer end to end: per-step loss and gradient norm (the queries and key norms
    counted once) of full and block AttnRes at PP=2, with consumer states crossing."""
    from tests.test_pipeline_cli import records
    from tests.test_train import on_ranks, run, train_cmd

    for blocks in ("null", "4"):
        common = ["train.steps=3", "model.n_layers=4", "parallel.microbatches=2",
                  "tracking.enabled=false", "model.connection=attnres",
                  f"model.attnres_blocks={blocks}"]
        one = run(train_cmd(tiny_data, tmp_path / f"pp1-{blocks}", *common))
        assert one.returncode == 0, one.stderr
        cmd = train_cmd(tiny_data, tmp_path / f"pp2-{blocks}", *common, "parallel.pp=2",
                        "parallel.pp_split=[3,1]")
        two = run(on_ranks(2, cmd))
        assert two.returncode == 0, two.stderr
        assert "state_7 state_8 state_9 lse[3]" in two.stderr
        a, b = records(tmp_path / f"pp1-{blocks}"), records(tmp_path / f"pp2-{blocks}")
        assert a.keys() == b.keys() == {1, 2, 3}
        for step in a:
            assert abs(a[step]["loss"] - b[step]["loss"]) < 1e-4, (blocks, step)
            assert abs(a[step]["grad_norm"] - b[step]["grad_norm"]) < 1e-4 * a[step]["grad_norm"]


def test_bf16_boundaries_send_the_lse_in_fp32():
    """Under bf16 autocast with bf16 boundaries (parallel.pipeline_dtype compute) the states'
    o cross in bf16 and their lse in fp32. The mix's matrix products run in bf16 under
    autocast, in one process too, so a softmax split at the boundary and merged rounds
    otherwise: the loss to 1e-4 relative of one process's, with either boundary dtype
    (measured 2e-5)."""
    from parallel.strategies.plan import build_plan
    from parallel.strategies.stage_model import StageModel, StageModule
    from pretrain.model import DenseFormer
    from pretrain.model.state import load_full_model_state

    state, tokens, _, _ = reference("block-6x4", 4, 1)
    cfg = attnres_config("block-6x4")
    one = DenseFormer(cfg)
    load_full_model_state(one, state)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = one.loss(tokens[:, :-1], tokens[:, 1:]).item()
    plan = build_plan(cfg, 2, split=[5, 1])
    model = StageModel(cfg, plan.programs)
    load_full_model_state(model, state)
    for dtype in (torch.float32, torch.bfloat16):
        first, last = (StageModule(model, p, boundary_dtype=dtype) for p in plan.programs)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            sent = first(tokens[:, :-1])
            assert [t.dtype for t in sent] == [dtype] * 4 + [torch.float32]
            assert sent[-1].shape == (3, 4, SHAPE["seq_len"])
            loss = model.head_loss(*last(*sent), tokens[:, 1:]).item()
        assert loss == pytest.approx(ref, rel=1e-4), dtype
