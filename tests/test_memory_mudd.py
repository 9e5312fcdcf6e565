"""The memory estimator for MUDD (parallel/strategies/mudd_memory.py) against the autograd
probe (parallel/strategies/memory_probe.py) on CPU, as tests/test_memory_attnres.py checks
Attention Residuals': to the byte in fp32 in every checkpointing mode, dynamic and static,
streams qkvr and r, gpt and llama blocks (the probe counts the buffer of X_0..X_d and the
streams a checkpoint keeps in a tuple); the gradient buffer, which only backward makes, to
the byte after a backward; the parameters, gradients and AdamW state equal to the real
tensors; at TP = 2 with and without sequence parallelism within 48 bytes, under bf16
autocast within 5% (the weight copies exactly).

Pipeline stages (`measure_stage`, the stages of a plan chained in one process): every stage
of PP = 2 and PP = 3 plans, dynamic and static in both transfer modes, to the byte in fp32
(the forward's terms: the gradient buffer apart), interleaved stages summed per rank, TP = 2
with and without SP to the byte, a bf16 boundary under autocast within 2%; and each rank's
parameter count equal to its StageModel's."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed_test
from tests.test_memory import (
    LLAMA,
    MODES,
    assert_within,
    config,
    estimated,
    expected_state_bytes,
    measured_report,
    real_state_bytes,
    run_memory,
)

VARIANTS = [(dynamic, streams, block) for dynamic in (True, False)
            for streams in ("qkvr", "r") for block in ("gpt", "llama")]
FAST = {(True, "qkvr", "gpt"), (False, "r", "llama")}


def mudd(dynamic: bool = True, streams: str = "qkvr", block: str = "gpt",
         n_layers: int = 4) -> list[str]:
    return [f"model.n_layers={n_layers}", "model.connection=mudd",
            f"model.mudd_dynamic={str(dynamic).lower()}", f"model.mudd_streams={streams}",
            *(LLAMA if block == "llama" else [])]


def forward_bytes(cfg, world_size: int = 1) -> int:
    """The estimate of what the forward keeps: all but the gradient buffer."""
    r = estimated(cfg, world_size)
    return r.activation_bytes - r.activations["mudd_grad_buffers"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("variant", [
    v if v in FAST else pytest.param(v, marks=pytest.mark.slow) for v in VARIANTS],
    ids=lambda v: "-".join(map(str, v)))
def test_activation_estimate_matches_the_probe(variant):
    for mode, every in MODES:
        cfg = config(*mudd(*variant), f"parallel.activation_checkpointing={mode}",
                     f"parallel.checkpoint_every={every}")
        report = measured_report(cfg)
        estimate = estimated(cfg)
        assert forward_bytes(cfg) == report.total_bytes, (variant, mode, every)
        assert estimate.activations["mudd_buffers"] == report.dwa_buffer_bytes
        assert estimate.activations.get("recompute_working_set", 0) == \
            report.recompute_bytes, (variant, mode, every)


@pytest.mark.parametrize("dynamic", [True, False])
def test_dwa_block_keeps_the_head_the_read_x_and_the_output_mix(dynamic):
    """Under dwa_block autograd keeps the LM head's tensors, X_0..X_{d-1} (the units'
    inputs; X_d too when M_d's weights-MLP saves it) and M_d's state, nothing else: the
    estimate's terms to the byte; the buffer holds d + 1 slots."""
    cfg = config(*mudd(dynamic), "parallel.activation_checkpointing=dwa_block")
    report, terms = measured_report(cfg), estimated(cfg).activations
    assert report.saved_bytes == terms["lm_head"] + terms["mudd_held"] + terms["mudd_mixes"]
    assert report.stored_outputs == 5
    tensor = cfg.train.batch_size * cfg.model.seq_len * cfg.model.d_model * 4
    assert terms["mudd_held"] == (5 if dynamic else 4) * tensor
    assert (terms["mudd_mixes"] > 0) == dynamic


@pytest.mark.parametrize("mode", ["none", "dwa_block"])
def test_the_gradient_buffer_is_made_in_backward_at_the_estimated_size(mode):
    from parallel.strategies.checkpointing import apply_activation_checkpointing
    from parallel.strategies.memory_probe import dwa_buffers_of
    from pretrain.model import DenseFormer

    cfg = config(*mudd(), f"parallel.activation_checkpointing={mode}")
    model = DenseFormer(cfg.model, seed=1)
    apply_activation_checkpointing(model, mode, 1)
    batch = torch.randint(0, cfg.model.vocab_size, (2, 33),
                          generator=torch.Generator().manual_seed(0))
    loss = model.loss(batch[:, :-1], batch[:, 1:])
    (buffers,) = dwa_buffers_of(loss)
    assert not buffers.grads  # none in the forward
    loss.backward()
    grad = buffers.grads[0]
    assert grad.numel() * grad.element_size() == \
        estimated(cfg).activations["mudd_grad_buffers"]


@pytest.mark.parametrize("extra", [("model.mudd_dynamic=true",), ("model.mudd_dynamic=false",
                                                                   "model.mudd_streams=r")])
def test_state_estimate_equals_real_tensors(extra):
    """MUDD's weights (and the key and value norms under qkvr) in parameters, gradients and
    AdamW state, with ZeRO-less DP; and the estimate's parameter count is the config's."""
    from parallel.strategies.memory import local_parameters
    from pretrain.config import load_config

    overrides = ("model.connection=mudd", *extra)
    assert real_state_bytes(0, extra=overrides) == expected_state_bytes(0, extra=overrides)
    cfg = load_config(None, ["model.n_layers=3", "model.d_model=32", "model.n_heads=2",
                             "model.vocab_size=200", *overrides])
    groups = local_parameters(cfg.model, 1, range(1, 4), True, True, False)
    assert sum(map(sum, groups.values())) == cfg.model.num_params()


def test_checkpointing_modes_order_for_mudd():
    """At the paper shape dwa_block keeps less than block, which keeps less than none."""
    totals = {}
    for mode in ("none", "block", "dwa_block"):
        cfg = config("model.n_layers=48", "model.d_model=768", "model.n_heads=12",
                     "model.seq_len=256", "model.connection=mudd", "train.batch_size=8",
                     f"parallel.activation_checkpointing={mode}")
        totals[mode] = estimated(cfg).activation_bytes
    assert totals["dwa_block"] < totals["block"] < totals["none"]


def test_cli_prints_the_mudd_terms():
    done = run_memory("--config", "configs/tiny.yaml", "--set", "model.vocab_size=512",
                      "--set", "model.connection=mudd", "--device", "cpu")
    assert done.returncode == 0, done.stderr
    for term in ("mudd_buffers", "mudd_grad_buffers", "mudd_held", "mudd_mixes", "blocks"):
        assert term in done.stdout


@pytest.mark.parametrize("variant", [(True, "qkvr"), (False, "r")])
def test_bf16_autocast_estimate_matches_the_probe(variant):
    """Under bf16 autocast the X_j and the buffer stay fp32 (the stream's), the weights-MLP
    computes in fp32, the blocks' matmul tensors are bf16: autocast's weight copies exactly
    the estimate's, the kept activations within 5% (CPU autocast keeps a little more)."""
    for mode in ("none", "dwa_block"):
        cfg = config(*mudd(*variant), "train.dtype=bf16",
                     f"parallel.activation_checkpointing={mode}")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            report = measured_report(cfg)
        estimate = estimated(cfg)
        assert report.autocast_copy_bytes == estimate.autocast_copies_bytes > 0
        assert_within(report.total_bytes, forward_bytes(cfg), "block", (variant, mode))


def tp_cases() -> dict:
    out = {}
    for streams in ("qkvr", "r"):
        for sp in (False, True):
            for mode, every in (("none", 1), ("dwa_block", 2)):
                cfg = config(*mudd(True, streams), "parallel.tp=2", "train.batch_size=4",
                             f"parallel.sequence_parallel={str(sp).lower()}",
                             f"parallel.activation_checkpointing={mode}",
                             f"parallel.checkpoint_every={every}", world_size=4)
                cfg.train.batch_size = 2  # this rank's micro-batch (DP=2)
                out[(streams, sp, mode, every)] = measured_report(cfg).total_bytes
    return out


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_tp2_with_and_without_sequence_parallelism_matches_the_probe():
    """TP=2 x DP=2 (rank 0 measured): the mixes and the buffer on the whole sequence without
    SP, on this rank's slice with it; the three QKV projections gather their inputs under SP
    and save the local ones."""
    measured = run_distributed_test(tp_cases, world_size=2, tp=2, timeout_s=180)[0]
    diffs = {}
    for (streams, sp, mode, every), value in measured.items():
        cfg = config(*mudd(True, streams), "parallel.tp=2", "train.batch_size=4",
                     f"parallel.sequence_parallel={str(sp).lower()}",
                     f"parallel.activation_checkpointing={mode}",
                     f"parallel.checkpoint_every={every}", world_size=4)
        diffs[(streams, sp, mode)] = value - forward_bytes(cfg, 4)
    # The probe sees 48 bytes more at TP = 2 (a few small tensors of the vocabulary-parallel
    # loss, as for Attention Residuals and the DWA), whatever the MUDD variant or mode.
    assert all(0 <= d <= 48 for d in diffs.values()), diffs


# Pipeline stages: each stage of a plan chained in one process and measured by
# `measure_stage` (tests/test_memory_attnres.py `measured_stages`), against the estimate of
# its rank with one micro-batch in flight (the gradient buffer apart: a forward makes none).
STAGE_CASES = {
    "dynamic-pp2": (True, "qkvr", ["parallel.pp=2"]),  # X_0..X_2 raw
    "dynamic-pp3-r": (True, "r", ["parallel.pp=3", "model.n_layers=5"]),
    "static-pp2-raw": (False, "qkvr", ["parallel.pp=2", "parallel.pp_split=[3,1]",
                                       "parallel.pp_transfer=raw"]),
    "static-pp2-sums": (False, "qkvr", ["parallel.pp=2", "model.n_layers=11",
                                        "parallel.pp_split=[9,2]"]),  # 9 sums, not X_0..X_9
    "static-pp3-qkvr-sums-twice": (False, "qkvr", ["parallel.pp=3", "model.n_layers=11",
                                                   "parallel.pp_split=[9,1,1]"]),
    "static-pp3-sums-twice": (False, "r", ["parallel.pp=3", "model.n_layers=6",
                                           "parallel.pp_split=[3,2,1]"]),
    "static-pp3-raw-then-sums": (False, "qkvr", ["parallel.pp=3", "model.n_layers=6",
                                                 "parallel.pp_split=[1,3,2]"]),
}


def stage_config(case: str, mode: str, *extra: str, tp: int = 1):
    dynamic, streams, overrides = STAGE_CASES[case]
    pp = int(overrides[0].rpartition("=")[2])
    return config(*mudd(dynamic, streams), *overrides, f"parallel.activation_checkpointing={mode}",
                  f"parallel.tp={tp}", *extra, world_size=tp * pp)


def stage_forward_bytes(cfg, world_size: int, rank: int) -> int:
    terms = estimated(cfg, world_size, rank).activations
    return estimated(cfg, world_size, rank).activation_bytes - \
        terms["in_flight_microbatches"] * terms["mudd_grad_buffers/microbatch"]


FAST_STAGES = {("dynamic-pp3-r", "block"), ("static-pp2-raw", "none"),
               ("static-pp2-sums", "block"), ("static-pp3-sums-twice", "none")}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case,mode", [
    c if c in FAST_STAGES else pytest.param(*c, marks=pytest.mark.slow)
    for c in ((case, mode) for case in STAGE_CASES for mode in ("none", "block"))])
def test_pipeline_stage_estimate_equals_the_probe(case, mode):
    """Each pipeline rank's estimate (one micro-batch in flight) is what its stage keeps, to
    the byte: its buffer's slots, the X_j it keeps, what it receives and sends (raw X_j or
    partial sums), its mixes' state and its blocks (`none`) or their checkpointed inputs and
    one block's recomputation (`block`)."""
    from tests.test_memory_attnres import measured_stages

    cfg = stage_config(case, mode)
    pp = cfg.parallel.pp
    plan_slots = [p.last + 1 for p in measured_programs(cfg)]
    for rank, report in enumerate(measured_stages(cfg)):
        estimate = estimated(cfg, pp, rank)
        assert estimate.activations["in_flight_microbatches"] == 1
        assert report.stored_outputs == plan_slots[rank]
        assert estimate.activations["mudd_buffers/microbatch"] == report.dwa_buffer_bytes
        assert stage_forward_bytes(cfg, pp, rank) == report.total_bytes, (
            case, mode, rank, report.as_dict(), estimate.activations)
        assert estimate.activations["recompute_working_set"] == report.recompute_bytes


def measured_programs(cfg):
    from parallel.strategies.plan import build_plan

    p = cfg.parallel
    return build_plan(cfg.model, p.pp, p.virtual_stages, p.pp_split, p.pp_transfer).programs


@pytest.mark.parametrize("mode", [pytest.param("none", marks=pytest.mark.slow), "block"])
def test_interleaved_stages_sum_per_rank(mode):
    """PP = 2 with two virtual stages a rank (one block each), static partial sums on the
    last boundary: a rank's estimate is its two stages' bytes times the micro-batches in
    flight (2 on rank 0, 1 on rank 1), plus the larger recomputation."""
    from tests.test_memory_attnres import measured_stages

    cfg = config(*mudd(False, "r"), "parallel.pp=2", "parallel.virtual_stages=2",
                 "parallel.microbatches=2", "train.batch_size=4",
                 f"parallel.activation_checkpointing={mode}", world_size=2)
    assert any(item.kind == "mudd_r" for item in measured_programs(cfg)[3].incoming)
    reports = measured_stages(cfg)
    for rank, stages in enumerate(([0, 2], [1, 3])):
        terms = estimated(cfg, 2, rank).activations
        in_flight = terms["in_flight_microbatches"]
        assert in_flight == 2 - rank
        assert terms["stages"] - in_flight * terms["mudd_grad_buffers/microbatch"] == \
            in_flight * sum(reports[s].total_bytes - reports[s].recompute_bytes for s in stages)
        assert terms["recompute_working_set"] == max(reports[s].recompute_bytes for s in stages)


@pytest.mark.parametrize("dynamic", [True, False])
def test_rank_parameters_are_the_stage_models(dynamic):
    """Per pipeline rank (PP = 3, and PP = 2 interleaved) the estimate counts the parameters
    its StageModel holds: dynamic, the weights of the mixes its stages form; static, every
    a_i on every rank."""
    from parallel.primitives import groups
    from parallel.strategies.memory import local_parameters
    from parallel.strategies.plan import build_plan
    from parallel.strategies.stage_model import StageModel

    groups.ensure_initialized()
    for extra in (["parallel.pp=3"], ["parallel.pp=2", "parallel.virtual_stages=2"]):
        pp = int(extra[0][-1])
        cfg = config(*mudd(dynamic, n_layers=6), *extra, world_size=pp)
        p = cfg.parallel
        plan = build_plan(cfg.model, p.pp, p.virtual_stages, p.pp_split, p.pp_transfer)
        for rank in range(p.pp):
            stages = plan.stages_of_rank(rank)
            programs = [plan.programs[s] for s in stages]
            model = StageModel(cfg.model, programs)
            blocks = [i for prog in programs for i in range(prog.first, prog.last + 1)]
            groups_ = local_parameters(cfg.model, 1, blocks, 0 in stages,
                                       plan.n_stages - 1 in stages, False)
            assert sum(map(sum, groups_.values())) == \
                sum(t.numel() for t in model.parameters()), (extra, rank)


@pytest.mark.parametrize("case", ["static-pp3-raw-then-sums",
                                  pytest.param("dynamic-pp2", marks=pytest.mark.slow),
                                  pytest.param("static-pp2-sums", marks=pytest.mark.slow)])
def test_pipeline_stages_with_a_bf16_boundary_under_autocast(case):
    """train.dtype bf16 with parallel.pipeline_dtype compute: X_j and partial sums cross in
    bf16 and are widened on receipt where kept; each stage within 2% (CPU autocast keeps a
    little more or less: measured -0.4% to +1.6%), autocast's weight copies exactly."""
    from tests.test_memory_attnres import bf16_stage_reports

    for mode, cfg, rank, report in bf16_stage_reports(stage_config, case):
        pp = cfg.parallel.pp
        assert report.autocast_copy_bytes == estimated(cfg, pp, rank).autocast_copies_bytes
        estimate = stage_forward_bytes(cfg, pp, rank)
        assert abs(estimate - report.total_bytes) <= 0.02 * report.total_bytes, (
            case, mode, rank, report.total_bytes, estimate)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipeline_stages_under_tp2_with_and_without_sequence_parallelism():
    """TP = 2 x PP = 2 (the stages chained on one TP group, TP rank 0 measured): the buffer,
    the mixes and what crosses on this rank's sequence slice under SP."""
    from tests.test_memory_attnres import measured_stages_under_tp2

    measured = measured_stages_under_tp2(stage_config, ("dynamic-pp2", "static-pp2-sums"),
                                         timeout_s=280)
    diffs = {key: total - stage_forward_bytes(cfg, 2 * cfg.parallel.pp, 2 * key[3])
             for key, (cfg, total) in measured.items()}
    assert all(d == 0 for d in diffs.values()), diffs
