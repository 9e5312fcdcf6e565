"""Pipeline parallelism of MUDD (pretrain/model/mudd_program.py): what crosses each boundary
against an independent count, the plan's output, and PP2, PP3 and interleaved PP against
one process (loss and every gradient, the mixes' weights included).

Dynamic weights read the consumer's X_i, so X_0..X_b cross raw; static weights may send
the later mixes' partial sums instead (sum_{i>=b} C_i tensors), whichever is fewer (raw
on a tie). Tolerances (fp32): loss 1e-5 absolute, every gradient 1e-5 relative per tensor
(3e-4 with TP = 2, slow only: the row-parallel sums round in another order, and the last
mix's static weights' gradient, a sum over tokens that cancels, is ill-conditioned: one
fp32 process is itself 8.5e-5 from fp64 on it, and TP2 x PP2 measured 1.05e-4). The
single-process references are computed in this test process with random (non-identity) mix
weights; the ranks load the same weights. The exhaustive layout matrix is marked slow.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from tests.pipeline_cases import check_stages_chained, reference_step, run_cases_on_ranks
from tests.test_pipeline import random_splits

SHAPE = dict(d_model=32, n_heads=4, vocab_size=200, seq_len=8, connection="mudd")
MODELS = {  # name -> (n_layers, dynamic, streams, extra DenseFormerConfig fields)
    "dynamic-qkvr-4": (4, True, "qkvr", {}),
    "static-qkvr-6": (6, False, "qkvr", {}),  # after block 5: 5 partial sums < 6 X_j
    "static-r-5": (5, False, "r", {}),  # after blocks 3 and 4: partial sums, sent on
    "dynamic-r-5-llama": (5, True, "r", dict(block="llama", n_kv_heads=2,
                                             tie_embeddings=False)),
}


def mudd_config(name: str):
    from pretrain.model import DenseFormerConfig

    n_layers, dynamic, streams, extra = MODELS[name]
    return DenseFormerConfig(n_layers=n_layers, mudd_dynamic=dynamic, mudd_streams=streams,
                             **SHAPE, **extra)


# ---------------------------------------------------------------------------------------------
# What crosses a boundary, against an independent count


def expected(d: int, dynamic: bool, streams: str, b: int) -> dict:
    """X_0..X_b, and the partial sums: per mix M_i read after the boundary (i = b..d; M_d
    forms the final norm's input alone) one per stream."""
    sources = b + 1
    partial = sum(1 if i == d else len(streams) for i in range(b, d + 1))
    return {"sources": sources, "partial": partial,
            "fewest": sources if dynamic else min(sources, partial)}


def test_boundary_counts_and_the_plan():
    from parallel.strategies.plan import build_plan
    from pretrain.model import DenseFormerConfig

    rng = random.Random(0)
    checked = partial = 0
    for d in range(2, 11):
        for dynamic, streams in itertools.product((True, False), ("qkvr", "r")):
            cfg = DenseFormerConfig(n_layers=d, mudd_dynamic=dynamic, mudd_streams=streams,
                                    **SHAPE)
            for n_stages in range(2, min(d, 4) + 1):
                for split in random_splits(d, n_stages, 2, rng):
                    for mode in ("raw", "optimal"):
                        plan = build_plan(cfg, n_stages, split=split, transfer=mode)
                        for count, program in zip(plan.counts, plan.programs, strict=False):
                            want = expected(d, dynamic, streams, count["after_block"])
                            sent = program.outgoing
                            assert count["raw"] == count["sources"] == want["sources"]
                            assert count["optimal"] == count["bound"] == want["fewest"]
                            assert count["partial_sums"] == (None if dynamic
                                                             else want["partial"])
                            assert len(sent) == (want["sources"] if mode == "raw"
                                                 else want["fewest"])
                            kinds = {item.kind != "x" for item in sent}
                            assert kinds == {len(sent) < want["sources"]}
                            partial += kinds == {True}
                            checked += 1
    assert checked > 300 and partial > 50


def test_boundary_state_examples():
    from pretrain.model.mudd_program import MuddLayout, bound, boundary_state, stage_programs

    names = lambda items: [str(item) for item in items]  # noqa: E731
    static = MuddLayout(6, "qkvr", dynamic=False)
    assert names(boundary_state(static, 4)) == [f"X_{j}" for j in range(5)]  # 5 < 9
    assert names(boundary_state(static, 5)) == ["M_5.q", "M_5.k", "M_5.v", "M_5.r", "M_6.r"]
    assert names(boundary_state(static, 5, "raw")) == [f"X_{j}" for j in range(6)]
    assert bound(static, 5) == (5, "min(b + 1, sum of C_i over i >= b)")
    r = MuddLayout(4, "r", dynamic=False)
    assert names(boundary_state(r, 2)) == ["X_0", "X_1", "X_2"]  # a tie: 3 and 3
    dynamic = MuddLayout(6, "qkvr")
    assert names(boundary_state(dynamic, 5)) == [f"X_{j}" for j in range(6)]
    assert bound(dynamic, 5)[0] == 6
    with pytest.raises(ValueError, match="transfer mode"):
        boundary_state(static, 3, "fastest")
    # Raw after partial sums cannot be: the X_j before the first boundary are gone.
    first, second = stage_programs(MuddLayout(5, "r", dynamic=False),
                                   [(1, 3), (4, 4), (5, 5)])[:2]
    assert names(first.outgoing) == ["M_3.r", "M_4.r", "M_5.r"]
    assert names(second.outgoing) == ["M_4.r", "M_5.r"]
    assert second.sources[0].terms == () and second.outgoing_sources[0].terms == (4,)
    from pretrain.model.mudd_program import boundary_items, mudd_program
    with pytest.raises(ValueError, match="needs X_0"):
        mudd_program(MuddLayout(5, "r", dynamic=False), 4, 4, first.outgoing,
                     boundary_items(MuddLayout(5, "r", dynamic=False), 4))


def test_plan_prints_the_mudd_counts():
    from parallel.strategies.plan import build_plan

    plan = build_plan(mudd_config("static-qkvr-6"), 3, split=[2, 3, 1])
    report = plan.report(micro_batch=2)
    assert report["connection"] == "mudd"
    counts = [{k: e[k] for k in ("after_block", "raw", "partial_sums", "optimal", "bound")}
              for e in report["boundaries"]]
    assert counts == [
        {"after_block": 2, "raw": 3, "partial_sums": 17, "optimal": 3, "bound": 3},
        {"after_block": 5, "raw": 6, "partial_sums": 5, "optimal": 5, "bound": 5}]
    tokens = 2 * SHAPE["seq_len"]
    assert report["boundaries"][1]["bytes_per_microbatch"]["optimal"] == 5 * 32 * tokens * 4
    lines = plan.describe(micro_batch=2)
    assert lines[1].endswith("X_0 X_1 X_2")
    assert "partial sums 5" in lines[2] and "min(b + 1, sum of C_i over i >= b)" in lines[2]
    assert lines[2].endswith("M_5.q M_5.k M_5.v M_5.r M_6.r")
    dynamic = build_plan(mudd_config("dynamic-qkvr-4"), 2, split=[3, 1]).describe()
    assert "partial sums none (dynamic)" in dynamic[1] and dynamic[1].endswith("X_0 X_1 X_2 X_3")


# ---------------------------------------------------------------------------------------------
# Stages chained in one process, and the multi-process layouts, against one process


def reference(name: str, batch: int, microbatches: int, seed: int = 0):
    """(full state, tokens (batch, S + 1), loss, {name: full grad}) of the single-process
    model with random mix weights (a_i, W1_i, W2_i)."""
    from pretrain.model import DenseFormer

    model = DenseFormer(mudd_config(name), seed=7)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for params in (model.mudd_static, model.mudd_w1, model.mudd_w2):
            for p in params.values():
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return reference_step(model, batch, microbatches, gen)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("mode", ["raw", "optimal"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_stages_chained_in_one_process_equal_the_model(name, mode, checkpointing):
    from parallel.strategies.plan import build_plan

    ref = reference(name, 4, 1)
    mudd_names = {n for n in ref[3] if n.startswith("mudd_")}  # ref[3]: the gradients
    cfg = mudd_config(name)
    d = cfg.n_layers
    splits = [[d - 1, 1], [d - 2, 1, 1], *random_splits(d, min(4, d), 2, random.Random(d))]
    partial = 0
    for split in splits:
        plan = build_plan(cfg, len(split), split=split, transfer=mode)
        partial += sum(item.kind != "x" for p in plan.programs for item in p.outgoing)
        model, crossed = check_stages_chained(cfg, plan, ref, checkpointing, split)
        assert [len(sent) for sent in crossed] == [len(p.incoming) for p in plan.programs[1:]]
        names = {pname for pname, _ in model.named_parameters()}
        assert mudd_names <= names or cfg.mudd_dynamic
    # Static weights in optimal mode send partial sums somewhere (dynamic: never).
    assert (partial > 0) == (mode == "optimal" and not cfg.mudd_dynamic)


def check_partial_sums(runner, case: dict, errors: dict) -> None:
    """On the ranks: the runner's plan sends partial sums exactly where the case's did."""
    sent = [item for p in runner.plan.programs for item in p.outgoing]
    assert any(item.kind != "x" for item in sent) == case["partial"], case["id"]


def make_case(name: str, mode: str, m: int, split, virtual_stages: int, tp: int, dp: int,
              sequence_parallel: bool) -> dict:
    """A case for `pipeline_cases`, with its reference (computed here, in the test process)
    and whether its plan sends partial sums; TP = 2 holds gradients to 3e-4 (see above)."""
    from parallel.strategies.plan import build_plan

    cfg = mudd_config(name)
    case_split = split(cfg.n_layers)
    plan = build_plan(cfg, len(case_split) // virtual_stages, virtual_stages, case_split, mode)
    partial = any(item.kind != "x" for p in plan.programs for item in p.outgoing)
    return dict(id=f"{name}/{mode}/m{m}/v{virtual_stages}/{case_split}", model=name,
                config=cfg, microbatches=m, split=case_split, virtual_stages=virtual_stages,
                runner_options=dict(transfer=mode), partial=partial,
                grad_tolerance=1e-5 if tp == 1 else 3e-4, sequence_parallel=sequence_parallel,
                reference=reference(name, 2 * dp * m, m, seed=m))


def last_alone(d: int) -> list[int]:
    """PP2 with one block on the last stage: static weights send partial sums."""
    return [d - 1, 1]


def three(d: int) -> list[int]:
    """PP3: the last two boundaries send partial sums for static-r-5 (sent on)."""
    return [d - 2, 1, 1]


def four(d: int) -> list[int]:
    """Interleaved PP2 x 2 virtual stages (stage s on rank s mod 2)."""
    return [1, d - 3, 1, 1]


LAYOUTS = {  # name -> (pp, virtual stages, split, tp, dp)
    "pp2": (2, 1, last_alone, 1, 1),
    "pp3": (3, 1, three, 1, 1),
    "pp2-interleaved": (2, 2, four, 1, 1),
    "tp2-pp2": (2, 1, last_alone, 2, 1),  # slow only
    "pp2-dp2": (2, 1, last_alone, 1, 2),  # slow only
    "tp2-pp2-sp": (2, 1, last_alone, 2, 1),  # slow only, with sequence parallelism
}
SEQUENCE_PARALLEL = {"tp2-pp2-sp"}
# Default suite (the time budget: a spawn costs ~12 s): PP3 and interleaved PP2, dynamic
# qkvr and static (partial sums crossing and sent on) in optimal mode; plain PP2 and raw
# mode run in one process above (`test_stages_chained_...`) and on ranks in the slow matrix.
DEFAULT_CASES = {
    "pp3": [(["static-r-5", "dynamic-qkvr-4"], ["optimal"], [3])],
    "pp2-interleaved": [(["static-qkvr-6", "dynamic-qkvr-4"], ["optimal"], [2])],
}


def run_layout(layout: str, entries, timeout_s: float) -> None:
    pp, virtual, split, tp, dp = LAYOUTS[layout]
    cases = [make_case(name, mode, m, split, virtual, tp, dp, layout in SEQUENCE_PARALLEL)
             for models, modes, counts in entries
             for name, mode, m in itertools.product(models, modes, counts)]
    run_cases_on_ranks(cases, tp=tp, pp=pp, dp=dp, timeout_s=timeout_s, check=check_partial_sums)
    return cases


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(DEFAULT_CASES))
def test_mudd_pipeline_matches_single_process(layout):
    cases = run_layout(layout, DEFAULT_CASES[layout], timeout_s=240)
    # Static weights send partial sums across a boundary (dynamic ones never do).
    assert {c["model"].startswith("static") for c in cases if c["partial"]} == {True}


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mudd_pipeline_exhaustive(layout):
    from parallel.strategies.schedule import schedule_problem

    pp, virtual, _, _, _ = LAYOUTS[layout]
    counts = [m for m in range(1, 5) if schedule_problem(pp, virtual, m) is None]
    run_layout(layout, [(list(MODELS), ["raw", "optimal"], counts)], timeout_s=3500)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cli_mudd_pp2_matches_pp1(tiny_data, tmp_path):
    """The trainer end to end: per-step loss and gradient norm (the static weights counted
    once) of dynamic and static MUDD at PP=2, with partial sums crossing for static."""
    from tests.test_pipeline_cli import records
    from tests.test_train import on_ranks, run, train_cmd

    for dynamic, sent in (("true", "X_0 X_1 X_2 X_3 X_4 X_5"),
                          ("false", "M_5.q M_5.k M_5.v M_5.r M_6.r")):
        common = ["train.steps=3", "model.n_layers=6", "parallel.microbatches=2",
                  "tracking.enabled=false", "model.connection=mudd",
                  f"model.mudd_dynamic={dynamic}"]
        one = run(train_cmd(tiny_data, tmp_path / f"pp1-{dynamic}", *common))
        assert one.returncode == 0, one.stderr
        cmd = train_cmd(tiny_data, tmp_path / f"pp2-{dynamic}", *common, "parallel.pp=2",
                        "parallel.pp_split=[5,1]")
        two = run(on_ranks(2, cmd))
        assert two.returncode == 0, two.stderr
        assert sent in two.stderr
        a, b = records(tmp_path / f"pp1-{dynamic}"), records(tmp_path / f"pp2-{dynamic}")
        assert a.keys() == b.keys() == {1, 2, 3}
        for step in a:
            assert abs(a[step]["loss"] - b[step]["loss"]) < 1e-4, (dynamic, step)
            assert abs(a[step]["grad_norm"] - b[step]["grad_norm"]) < 1e-4 * a[step]["grad_norm"]
