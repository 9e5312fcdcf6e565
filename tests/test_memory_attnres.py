"""The memory estimator for Attention Residuals (parallel/strategies/attnres_memory.py)
against the autograd probe (parallel/strategies/memory_probe.py) on CPU, as
tests/test_memory.py checks the DWA's: to the byte in fp32 in every mode (the blocks
counted as their two branches), and as the DWA's at TP=2 with and without sequence
parallelism and under bf16 autocast.

Pipeline stages: each stage of a plan run in one process (StageModule chained on detached
outputs, as the schedule hands them over) and measured by `measure_stage`, against the
estimate of its pipeline rank with one micro-batch in flight: equal to the byte at fp32 in
both modes that PP allows, for full and block AttnRes at PP = 2 and 3, raw X_j and consumer
states (with their lse) crossing, interleaved stages summed per rank; within 5% with a bf16
boundary under autocast (CPU autocast keeps one small fp32 tensor a block more); to the byte
at TP = 2 with and without sequence parallelism.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed_test
from tests.test_memory import (
    MODES,
    assert_within,
    config,
    estimated,
    measured_activations,
    measured_report,
    run_memory,
)

MODELS = {  # name -> overrides; 4 blocks are 8 sub-layers, 6 are 12
    "full": ("model.n_layers=4", "model.connection=attnres"),
    "block-2": ("model.n_layers=4", "model.connection=attnres", "model.attnres_blocks=2"),
    "block-3": ("model.n_layers=6", "model.connection=attnres", "model.attnres_blocks=3"),
}


def mode_config(name: str, mode: str, every: int, *extra: str, world_size: int = 1):
    return config(*MODELS[name], f"parallel.activation_checkpointing={mode}",
                  f"parallel.checkpoint_every={every}", *extra, world_size=world_size)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", list(MODELS))
def test_activation_estimate_matches_the_probe(name):
    for mode, every in MODES:
        cfg = mode_config(name, mode, every)
        assert measured_activations(cfg) == estimated(cfg).activation_bytes, (name, mode, every)


@pytest.mark.parametrize("name", ["full", "block-3"])
def test_dwa_block_keeps_each_crossing_output_once(name):
    """Under dwa_block autograd keeps exactly the LM head's tensors, each X_j that crosses a
    unit boundary once, and the output mix's per-token state: the estimate's three terms to
    the byte. Full AttnRes keeps all 2d + 1 X_j; block AttnRes with units of 2 blocks (4
    sub-layers, groups of 4) its completed sums X_0, X_4, X_8, X_12 and nothing else."""
    cfg = mode_config(name, "dwa_block", 2)
    report, estimate = measured_report(cfg), estimated(cfg).activations
    assert report.saved_bytes == estimate["lm_head"] + estimate["attnres_held"] + \
        estimate["attnres_mixes"]
    tokens = cfg.train.batch_size * cfg.model.seq_len
    held = estimate["attnres_held"] // (tokens * cfg.model.d_model * 4)
    assert held == (2 * cfg.model.n_layers + 1 if name == "full" else 4)


def test_checkpointing_modes_order_for_attnres():
    """At a paper-like shape, dwa_block keeps less than block, which keeps less than none."""
    totals = {}
    for mode in ("none", "block", "dwa_block"):
        cfg = config("model.n_layers=48", "model.d_model=768", "model.n_heads=12",
                     "model.seq_len=256", "model.connection=attnres", "model.attnres_blocks=8",
                     f"parallel.activation_checkpointing={mode}")
        totals[mode] = estimated(cfg).activation_bytes
    assert totals["dwa_block"] < totals["block"] < totals["none"]


def tp_cases() -> dict:
    out = {}
    for name in ("full", "block-2"):
        for sp in (False, True):
            for mode, every in (("none", 1), ("dwa_block", 2)):
                cfg = mode_config(name, mode, every, "parallel.tp=2", "train.batch_size=4",
                                  f"parallel.sequence_parallel={str(sp).lower()}",
                                  world_size=4)
                cfg.train.batch_size = 2  # this rank's micro-batch (DP=2)
                out[(name, sp, mode)] = measured_activations(cfg)
    return out


@pytest.mark.timeout(200)
def test_tp2_with_and_without_sequence_parallelism_matches_the_probe():
    """TP=2 x DP=2 (rank 0 measured): the mix runs on the whole sequence without SP, on this
    rank's slice with it."""
    measured = run_distributed_test(tp_cases, world_size=2, tp=2, timeout_s=180)[0]
    for (name, sp, mode), value in measured.items():
        cfg = mode_config(name, mode, 2 if mode == "dwa_block" else 1, "parallel.tp=2",
                          "train.batch_size=4", f"parallel.sequence_parallel={str(sp).lower()}",
                          world_size=4)
        assert_within(value, estimated(cfg, 4).activation_bytes, mode, (name, sp, mode))


@pytest.mark.parametrize("name", ["full", "block-2"])
def test_bf16_autocast_estimate_matches_the_probe(name):
    """Under bf16 autocast the X_j past the embedding are bf16 branch outputs (and their
    sums), the mixes fp32: within 5%, and the weight copies exactly the estimate's."""
    cfg = config(*MODELS[name], "train.dtype=bf16")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = measured_report(cfg)
    estimate = estimated(cfg)
    assert report.autocast_copy_bytes == estimate.autocast_copies_bytes > 0
    assert_within(report.total_bytes, estimate.activation_bytes, "block", name)


STAGE_MODELS = {  # name -> overrides, besides MODELS
    "full-6": ("model.n_layers=6", "model.connection=attnres"),
    "block-4": ("model.n_layers=6", "model.connection=attnres", "model.attnres_blocks=4"),
}
STAGE_CASES = {  # id -> (model, parallel overrides); what crosses each boundary in comments
    "full-pp2": ("full", ["parallel.pp=2"]),  # X_0..X_4 (raw on the tie)
    "full-pp2-states": ("full", ["parallel.pp=2", "parallel.pp_split=[3,1]"]),  # o_7..9, lse
    "full-pp3-states-twice": ("full-6", ["parallel.pp=3", "parallel.pp_split=[4,1,1]"]),
    "block-pp3": ("block-2", ["parallel.pp=3"]),  # group sums and partial sums raw
    "block-pp2-partial-states": ("block-4", ["parallel.pp=2", "parallel.pp_split=[5,1]"]),
    "block-3-pp3": ("block-3", ["parallel.pp=3"]),
}


def stage_config(case: str, mode: str, *extra: str, tp: int = 1):
    name, overrides = STAGE_CASES[case]
    model = {**MODELS, **STAGE_MODELS}[name]
    pp = int(overrides[0].rpartition("=")[2])
    return config(*model, *overrides, f"parallel.activation_checkpointing={mode}",
                  f"parallel.tp={tp}", *extra, world_size=tp * pp)


def measured_stages(cfg, boundary_dtype: torch.dtype = torch.float32) -> list:
    """The probe's ActivationReport of each stage of cfg's plan, in stage order: one
    micro-batch through the stages chained in this process, each from its predecessor's
    outputs detached (as the schedule receives them), the last through the loss."""
    from parallel.primitives import groups
    from parallel.strategies.memory_probe import measure_stage
    from parallel.strategies.plan import build_plan, micro_batch_size
    from parallel.strategies.stage_model import StageModel, StageModule

    groups.ensure_initialized()
    p = cfg.parallel
    plan = build_plan(cfg.model, p.pp, p.virtual_stages, p.pp_split, p.pp_transfer)
    model = StageModel(cfg.model, plan.programs, seed=1,
                       sequence_parallel=p.sequence_parallel)
    gen = torch.Generator().manual_seed(0)
    micro_batch = micro_batch_size(p, cfg.train.batch_size, p.tp * p.pp)  # DP = 1
    batch = torch.randint(0, cfg.model.vocab_size, (micro_batch, cfg.model.seq_len + 1),
                          generator=gen)
    reports, outputs = [], (batch[:, :-1],)
    for s, program in enumerate(plan.programs):
        stage = StageModule(model, program, p.activation_checkpointing == "block",
                            boundary_dtype)
        received = outputs if s == 0 else tuple(t.detach().requires_grad_() for t in outputs)
        if program.is_last:
            reports.append(measure_stage(stage, received,
                                         lambda out: model.head_loss(*out, batch[:, 1:])))
        else:
            reports.append(measure_stage(stage, received))
            outputs = stage(*received)
    return reports


@pytest.mark.parametrize("mode", ["none", "block"])
@pytest.mark.parametrize("case", list(STAGE_CASES))
def test_pipeline_stage_estimate_equals_the_probe(case, mode):
    """Each pipeline rank's estimate (one micro-batch in flight) is what its stage keeps, to
    the byte: the X_j it makes, the tensors it receives and sends (the lse included), the
    mixes' and merge_states' saved state, and its branches (`none`) or their checkpointed
    inputs and one branch's recomputation (`block`)."""
    cfg = stage_config(case, mode)
    pp = cfg.parallel.pp
    for rank, report in enumerate(measured_stages(cfg)):
        estimate = estimated(cfg, pp, rank)
        assert estimate.activations["in_flight_microbatches"] == 1
        assert estimate.activation_bytes == report.total_bytes, (case, mode, rank,
                                                                 report.as_dict())
        assert estimate.activations["recompute_working_set"] == report.recompute_bytes


@pytest.mark.parametrize("mode", ["none", "block"])
def test_interleaved_stages_sum_per_rank(mode):
    """PP = 2 with two virtual stages a rank (one block each): a rank's estimate is its two
    stages' bytes times the micro-batches in flight (2 on rank 0, 1 on rank 1), plus the
    larger recomputation."""
    cfg = config(*MODELS["full"], "parallel.pp=2", "parallel.virtual_stages=2",
                 "parallel.microbatches=2", "train.batch_size=4",
                 f"parallel.activation_checkpointing={mode}", world_size=2)
    reports = measured_stages(cfg)
    for rank, stages in enumerate(([0, 2], [1, 3])):
        terms = estimated(cfg, 2, rank).activations
        in_flight = terms["in_flight_microbatches"]
        assert in_flight == 2 - rank
        assert terms["stages"] == in_flight * sum(
            reports[s].total_bytes - reports[s].recompute_bytes for s in stages)
        assert terms["recompute_working_set"] == max(reports[s].recompute_bytes for s in stages)


def bf16_stage_reports(stage_config, case: str):
    """(mode, config, pp rank, probe report) of each stage of `stage_config`'s `case` with
    train.dtype bf16 (a bf16 boundary under autocast), checkpointing `none` and `block`."""
    for mode in ("none", "block"):
        cfg = stage_config(case, mode, "train.dtype=bf16")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            reports = measured_stages(cfg, torch.bfloat16)
        for rank, report in enumerate(reports):
            yield mode, cfg, rank, report


@pytest.mark.parametrize("case", ["full-pp2-states", "block-pp2-partial-states", "block-pp3"])
def test_pipeline_stages_with_a_bf16_boundary_under_autocast(case):
    """train.dtype bf16 with parallel.pipeline_dtype compute: X_j and states cross in bf16
    (the lse in fp32) and are widened on receipt where something keeps them; within 5%, and
    autocast's weight copies of each stage's blocks exactly the estimate's."""
    for mode, cfg, rank, report in bf16_stage_reports(stage_config, case):
        estimate = estimated(cfg, cfg.parallel.pp, rank)
        assert report.autocast_copy_bytes == estimate.autocast_copies_bytes > 0
        assert_within(report.total_bytes, estimate.activation_bytes, "block", (case, mode, rank))


def test_cli_pipeline_ranks_of_attnres():
    """`python -m parallel.memory` estimates AttnRes stages: 1F1B in flight per rank, the
    tied embedding on the first and the last rank."""
    import json

    done = run_memory("--config", "configs/tiny-attnres.yaml", "--set", "model.vocab_size=512",
                      "--set", "parallel.pp=2", "--set", "parallel.microbatches=4",
                      "--world-size", "2", "--json")
    assert done.returncode == 0, done.stderr
    ranks = json.loads(done.stdout)["ranks"]
    assert [r["pp_rank"] for r in ranks] == [0, 1]
    assert all(r["activation_bytes"] > 0 for r in ranks)
    text = run_memory("--config", "configs/tiny-attnres.yaml", "--set", "model.vocab_size=512",
                      "--set", "parallel.pp=2", "--world-size", "2")
    assert text.returncode == 0, text.stderr
    assert "rank 1:" in text.stdout and "in_flight_microbatches" in text.stdout


def tp_stage_totals(stage_config, cases) -> dict:
    """{(case, sp, mode): each stage's probe total} on this rank of a TP group of 2, the
    config of each from `stage_config(case, mode, sequence parallelism override, tp=2)`."""
    out = {}
    for case in cases:
        for sp in (False, True):
            for mode in ("none", "block"):
                cfg = stage_config(case, mode,
                                   f"parallel.sequence_parallel={str(sp).lower()}", tp=2)
                out[(case, sp, mode)] = [r.total_bytes for r in measured_stages(cfg)]
    return out


def measured_stages_under_tp2(stage_config, cases, timeout_s: float) -> dict:
    """TP = 2 x PP (the stages chained on one TP group, TP rank 0 measured) for each case,
    with and without sequence parallelism, checkpointing `none` and `block`:
    {(case, sp, mode, pp rank): (the config, the stage's probe total)}. `stage_config` is a
    module-level function (the ranks import it)."""
    measured = run_distributed_test(tp_stage_totals, world_size=2, tp=2, timeout_s=timeout_s,
                                    stage_config=stage_config, cases=cases)[0]
    out = {}
    for (case, sp, mode), totals in measured.items():
        cfg = stage_config(case, mode, f"parallel.sequence_parallel={str(sp).lower()}", tp=2)
        for pp_rank, total in enumerate(totals):
            out[(case, sp, mode, pp_rank)] = (cfg, total)
    return out


@pytest.mark.timeout(200)
def test_pipeline_stages_under_tp2_with_and_without_sequence_parallelism():
    """TP = 2 x PP = 2 (the stages chained on one TP group, TP rank 0 measured): to the byte,
    the mixes on this rank's sequence slice under SP."""
    measured = measured_stages_under_tp2(
        stage_config, ("full-pp2-states", "block-pp2-partial-states"), timeout_s=180)
    for (case, sp, mode, pp_rank), (cfg, total) in measured.items():
        assert estimated(cfg, 2 * cfg.parallel.pp, 2 * pp_rank).activation_bytes == total, (
            case, sp, mode, pp_rank)
