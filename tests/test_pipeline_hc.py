"""Pipeline parallelism of Hyper-Connections and mHC (pretrain/model/hc_program.py): what
crosses each boundary (one n-stream state), the plan's output, and PP2, PP3 and
interleaved PP against one process (loss and every gradient, the connection weights
included).

Tolerances (fp32): loss 1e-5 absolute, every gradient 1e-5 relative per tensor (1e-4
with TP = 2, slow only: the row-parallel sums round in another order; measured 3.4e-5 with
and without sequence parallelism). The single-process
references are computed in this test process with every connection weight drawn away from
its init (as tests/test_hc.py); the ranks load the same weights. The layouts on ranks
beyond PP3 and interleaved PP2 are marked slow.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from tests.pipeline_cases import check_stages_chained, reference_step, run_cases_on_ranks
from tests.test_pipeline import random_splits

SHAPE = dict(d_model=32, n_heads=4, vocab_size=200, seq_len=8)
MODELS = {  # name -> DenseFormerConfig fields beyond SHAPE
    "hc-static-n2": dict(n_layers=4, connection="hc", hc_streams=2, hc_dynamic=False),
    "hc-dynamic-n2": dict(n_layers=4, connection="hc", hc_streams=2, block="llama",
                          n_kv_heads=2, tie_embeddings=False),
    "hc-dynamic-n4": dict(n_layers=5, connection="hc", hc_streams=4),
    "mhc-n4": dict(n_layers=4, connection="mhc", hc_streams=4, mhc_sinkhorn_iters=7),
}


def hc_config(name: str):
    from pretrain.model import DenseFormerConfig

    return DenseFormerConfig(**SHAPE, **MODELS[name])


# ---------------------------------------------------------------------------------------------
# What crosses a boundary


def test_every_boundary_carries_one_state():
    from parallel.strategies.plan import build_plan
    from pretrain.model.hc_program import HCLayout, hc_program

    rng = random.Random(0)
    checked = 0
    for name in MODELS:
        cfg = hc_config(name)
        d, n = cfg.n_layers, cfg.hc_layout.streams
        for n_stages in range(2, d + 1):
            for split in random_splits(d, n_stages, 2, rng):
                for mode in ("raw", "optimal"):
                    plan = build_plan(cfg, n_stages, split=split, transfer=mode)
                    for count, program, after in zip(plan.counts, plan.programs,
                                                     plan.programs[1:], strict=False):
                        b = count["after_block"]
                        assert program.last == b and after.first == b + 1
                        assert [str(i) for i in program.outgoing] == [f"X_{2 * b}"]
                        assert after.incoming == program.outgoing
                        assert (count["raw"], count["optimal"], count["bound"],
                                count["streams"]) == (1, 1, 1, n)
                        # The stage reads the state it received, and nothing older.
                        assert after.held <= {2 * b, *range(2 * b + 1, 2 * d + 1)}
                        checked += 1
    assert checked > 40
    layout = HCLayout("hc", 3, 2, True)
    with pytest.raises(ValueError, match="starts from X_2 alone"):
        hc_program(layout, 2, 3, incoming=())
    from pretrain.model.program import Item
    with pytest.raises(ValueError, match="sends X_4 alone"):
        hc_program(layout, 1, 2, outgoing=(Item("x", 3),))
    with pytest.raises(ValueError, match="sends nothing"):
        hc_program(layout, 2, 3, outgoing=(Item("x", 6),))


def test_plan_prints_the_hc_state():
    from parallel.strategies.plan import build_plan

    plan = build_plan(hc_config("hc-dynamic-n4"), 3, split=[2, 2, 1])
    report = plan.report(micro_batch=2)
    assert report["connection"] == "hc" and report["items"] == [["X_4"], ["X_8"]]
    tokens = 2 * SHAPE["seq_len"]
    for entry in report["boundaries"]:
        assert entry["bytes_per_microbatch"] == {"raw": 4 * 32 * tokens * 4,
                                                 "optimal": 4 * 32 * tokens * 4}
    lines = plan.describe(micro_batch=2)
    assert "HC n=4" in lines[0]
    assert lines[1].startswith("  after block 2: one n-stream state (4 hidden-size tensors), "
                               "0.01 MiB per micro-batch")
    assert "one n-stream state (n=4 hidden-size tensors' bytes)" in lines[1]
    assert lines[1].endswith("X_4") and lines[2].endswith("X_8")


@pytest.mark.timeout(120)
def test_plan_cli_says_what_crosses():
    """`python -m parallel.plan` for mhc: one n-stream state, n hidden-size tensors' bytes."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT, cli_env

    args = ["--config", "configs/tiny-mhc.yaml", "--set", "model.vocab_size=512",
            "--set", "parallel.pp=2", "--world-size", "2"]
    text = subprocess.run([sys.executable, "-m", "parallel.plan", *args], capture_output=True,
                          text=True, timeout=60, env=cli_env(), cwd=ROOT)
    assert text.returncode == 0, text.stderr
    assert "mHC n=4" in text.stdout and "one n-stream state (4 hidden-size tensors)" in text.stdout
    doc = subprocess.run([sys.executable, "-m", "parallel.plan", *args, "--json"],
                         capture_output=True, text=True, timeout=60, env=cli_env(), cwd=ROOT)
    report = json.loads(doc.stdout)
    (entry,) = report["boundaries"]
    assert (entry["optimal"], entry["streams"]) == (1, 4)
    per_tensor = report["micro_batch"] * report["seq_len"] * report["d_model"] \
        * report["dtype_bytes"]
    assert entry["bytes_per_microbatch"]["optimal"] == 4 * per_tensor


# ---------------------------------------------------------------------------------------------
# Stages chained in one process, and the multi-process layouts, against one process


def reference(name: str, batch: int, microbatches: int, seed: int = 0):
    """(full state, tokens (batch, S + 1), loss, {name: full grad}) of the single-process
    model with every connection weight drawn away from its init."""
    from pretrain.model import DenseFormer

    model = DenseFormer(hc_config(name), seed=7)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.hc_parameters().items():
            p.add_((0.5 if pname.endswith("scale") else 0.3)
                   * torch.randn(p.shape, generator=gen))
    return reference_step(model, batch, microbatches, gen)


@pytest.mark.parametrize("name", list(MODELS))
def test_stages_chained_in_one_process_equal_the_model(name):
    from parallel.strategies.plan import build_plan

    ref = reference(name, 4, 1)
    ref_grads = ref[3]
    cfg = hc_config(name)
    d = cfg.n_layers
    # PP2, PP3 and one block per stage; activation checkpointing on the last.
    for split, checkpointing in (([d - 1, 1], False), ([1, d - 2, 1], False), ([1] * d, True)):
        plan = build_plan(cfg, len(split), split=split)
        model, crossed = check_stages_chained(cfg, plan, ref, checkpointing, split)
        for sent in crossed:
            assert len(sent) == 1 and sent[0].shape == (4, SHAPE["seq_len"],
                                                        cfg.hc_layout.streams, SHAPE["d_model"])
        assert set(model.hc_names) <= set(ref_grads) and model.hc_names
        # The pipeline's sum over its group: here every stage ran on this one model.
        assert {id(p) for p in model.replicated_connection_parameters()} >= {
            id(p) for p in model.hc_parameters().values()}


def check_hc_gradients(runner, case: dict, errors: dict) -> None:
    """On the ranks: every connection weight's gradient was compared."""
    assert set(runner.model.hc_names) <= errors.keys()


def make_case(name: str, m: int, split, virtual_stages: int, tp: int, dp: int,
              sequence_parallel: bool) -> dict:
    """A case for `pipeline_cases`, with its reference (computed here, in the test process);
    TP = 2 holds gradients to 1e-4 (see above)."""
    cfg = hc_config(name)
    case_split = split(cfg.n_layers)
    return dict(id=f"{name}/m{m}/v{virtual_stages}/{case_split}", config=cfg, microbatches=m,
                split=case_split, virtual_stages=virtual_stages,
                grad_tolerance=1e-5 if tp == 1 else 1e-4, sequence_parallel=sequence_parallel,
                reference=reference(name, 2 * dp * m, m, seed=m))


# On ranks, all slow (the default suite's time budget: a spawn costs ~12 s; PP2, PP3 and
# one block per stage run in one process above).
LAYOUTS = {  # name -> (pp, virtual stages, split, tp, dp)
    "pp2": (2, 1, lambda d: [d - 1, 1], 1, 1),
    "pp3": (3, 1, lambda d: [d - 2, 1, 1], 1, 1),
    "pp2-interleaved": (2, 2, lambda d: [1, d - 3, 1, 1], 1, 1),
    "tp2-pp2": (2, 1, lambda d: [d - 1, 1], 2, 1),
    "pp2-dp2": (2, 1, lambda d: [d - 1, 1], 1, 2),
    "tp2-pp2-sp": (2, 1, lambda d: [d - 1, 1], 2, 1),  # with sequence parallelism
}
SEQUENCE_PARALLEL = {"tp2-pp2-sp"}


def run_layout(layout: str, models, counts, timeout_s: float) -> list[dict]:
    pp, virtual, split, tp, dp = LAYOUTS[layout]
    cases = [make_case(name, m, split, virtual, tp, dp, layout in SEQUENCE_PARALLEL)
             for name, m in itertools.product(models, counts)]
    results = run_cases_on_ranks(cases, tp=tp, pp=pp, dp=dp, timeout_s=timeout_s,
                                 check=check_hc_gradients)
    print(layout, "worst relative gradient error:", max(max(r.values()) for r in results))
    return cases


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hc_pipeline_matches_single_process(layout):
    from parallel.strategies.schedule import schedule_problem

    pp, virtual, _, _, _ = LAYOUTS[layout]
    counts = [m for m in (1, 2, 4) if schedule_problem(pp, virtual, m) is None]
    run_layout(layout, list(MODELS), counts[-2:], timeout_s=3500)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cli_hc_pp2_matches_pp1_and_loads_at_pp1(tiny_data, tmp_path):
    """The trainer end to end, dynamic HC and mHC: per-step loss and gradient norm (the
    connection weights counted once) at PP=2 equal PP=1's, and the checkpoint written at
    PP=2 after step 2 resumes at PP=1 for step 3 on the same trajectory."""
    from tests.test_pipeline_cli import records
    from tests.test_train import on_ranks, run, train_cmd

    for connection in ("hc", "mhc"):
        common = ["train.steps=3", "model.n_layers=4", "parallel.microbatches=2",
                  "tracking.enabled=false", f"model.connection={connection}"]
        one = run(train_cmd(tiny_data, tmp_path / f"pp1-{connection}", *common))
        assert one.returncode == 0, one.stderr
        mixed = tmp_path / f"pp2-{connection}"
        two = run(on_ranks(2, train_cmd(tiny_data, mixed, *common, "parallel.pp=2",
                                        "parallel.pp_split=[3,1]", "train.stop_at=2")))
        assert two.returncode == 0, two.stderr
        assert "one n-stream state (4 hidden-size tensors)" in two.stderr
        assert two.stderr.rstrip().count("X_6") >= 1
        back = run(train_cmd(tiny_data, mixed, *common, "train.resume=auto"))
        assert back.returncode == 0, back.stderr
        a, b = records(tmp_path / f"pp1-{connection}"), records(mixed)
        assert a.keys() == b.keys() == {1, 2, 3}
        for step in a:
            assert abs(a[step]["loss"] - b[step]["loss"]) < 1e-4, (connection, step)
            assert abs(a[step]["grad_norm"] - b[step]["grad_norm"]) < 1e-4 * a[step]["grad_norm"]
