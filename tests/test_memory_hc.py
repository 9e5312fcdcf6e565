"""The memory estimator for Hyper-Connections (parallel/strategies/hc_memory.py) against the
autograd probe (parallel/strategies/memory_probe.py) on CPU, as tests/test_memory_mudd.py
checks MUDD's: to the byte in fp32 in every checkpointing mode (n = 1, 2, 3), dynamic and
static HC and mHC, n = 2, 3, 4 streams, gpt and llama blocks; under `dwa_block` the saved
tensors equal the head and the units' input states exactly; the parameters, gradients and
AdamW state equal to the real tensors and to the config's count, without ZeRO and with ZeRO
1-3 at DP = 2; at TP = 2 with and without sequence parallelism within 48 bytes; under bf16
autocast within 1% (the weight copies exactly: the mixes cast nothing). Pipeline stages
(`measure_stage` on each stage of a plan chained in one process): every stage of PP = 2 and
3, static and dynamic HC and mHC, gpt and llama blocks, equal to its rank's estimate with
one micro-batch in flight to the byte in fp32 with `none` and `block`; interleaved stages
summed per rank; TP = 2 x PP = 2 with and without sequence parallelism to the byte; a bf16
boundary under autocast within 1% (CPU autocast's small fp32 tensor a block more)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.distributed import run_distributed_test
from tests.test_memory import (
    LLAMA,
    MODES,
    config,
    estimated,
    expected_state_bytes,
    measured_report,
    real_state_bytes,
    run_memory,
)

VARIANTS = {  # name -> overrides (4 blocks: 8 sub-layers)
    "hc": ("model.connection=hc",),
    "hc-static": ("model.connection=hc", "model.hc_dynamic=false"),
    "mhc": ("model.connection=mhc",),
    "hc-llama-n2": ("model.connection=hc", "model.hc_streams=2", *LLAMA),
    "hc-static-llama-n3": ("model.connection=hc", "model.hc_dynamic=false",
                           "model.hc_streams=3", *LLAMA),
    "mhc-llama-n3": ("model.connection=mhc", "model.hc_streams=3", *LLAMA),
}
FAST = {"hc", "mhc-llama-n3"}


def hc_config(name: str, mode: str = "none", every: int = 1, *extra: str,
              world_size: int = 1):
    return config("model.n_layers=4", *VARIANTS[name],
                  f"parallel.activation_checkpointing={mode}",
                  f"parallel.checkpoint_every={every}", *extra, world_size=world_size)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", [
    n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in VARIANTS])
def test_activation_estimate_matches_the_probe(name):
    for mode, every in MODES:
        if (mode, every) == ("dwa_block", 1):
            continue  # the same units as block with n = 1 (checked below)
        cfg = hc_config(name, mode, every)
        report, estimate = measured_report(cfg), estimated(cfg)
        assert estimate.activation_bytes == report.total_bytes, (name, mode, every)
        assert estimate.activations.get("recompute_working_set", 0) == \
            report.recompute_bytes, (name, mode, every)


@pytest.mark.parametrize("name", ["hc-static", "mhc"])
def test_dwa_block_keeps_the_head_and_the_unit_input_states(name):
    """With units of two blocks autograd keeps the LM head's tensors and the units' input
    states, X_0 and X_4 (n = 4 stream tensors each: X_0 is the embedding copied into the
    streams), nothing else; block and dwa_block are the same for HC."""
    cfg = hc_config(name, "dwa_block", 2)
    report, terms = measured_report(cfg), estimated(cfg).activations
    assert report.saved_bytes == terms["lm_head"] + terms["hc_held"]
    tensor = cfg.train.batch_size * cfg.model.seq_len * cfg.model.d_model * 4
    assert terms["hc_held"] == (4 + 4) * tensor
    assert estimated(hc_config(name, "block", 2)).activations == terms


@pytest.mark.parametrize("name", ["hc", "hc-static", "mhc"])
def test_state_estimate_equals_real_tensors(name):
    """HC's weights in parameters, gradients and AdamW state, with ZeRO-less DP; and the
    estimate's parameter count is the config's."""
    from parallel.strategies.memory import local_parameters
    from pretrain.config import load_config

    overrides = VARIANTS[name]
    assert real_state_bytes(0, extra=overrides) == expected_state_bytes(0, extra=overrides)
    cfg = load_config(None, ["model.n_layers=3", "model.d_model=32", "model.n_heads=2",
                             "model.vocab_size=200", *overrides])
    groups = local_parameters(cfg.model, 1, range(1, 4), True, True, False)
    assert sum(map(sum, groups.values())) == cfg.model.num_params()
    decayed = local_parameters(cfg.model, 1, range(1, 4), True, True, True)
    assert sum(decayed["decay"]) - sum(groups["decay"]) == cfg.model.hc_layout.n_params(32)


def test_estimate_at_pp2_gives_each_rank_its_stage():
    """estimate() at PP = 2 (no longer refused): per-rank figures, the first rank's 1F1B
    micro-batches in flight times its stage, which receives nothing and sends X_4 (n = 4
    stream tensors); the last rank receives X_4 and holds the head."""
    from parallel.strategies.memory import estimate

    cfg = hc_config("hc")
    parallel = dataclasses.replace(cfg.parallel, pp=2, microbatches=4)
    ranks = estimate(parallel, cfg.model, 8, "fp32", 2, "cpu")  # micro-batches of 2
    assert [r.pp_rank for r in ranks] == [0, 1]
    first, last = (r.activations for r in ranks)
    assert (first["in_flight_microbatches"], last["in_flight_microbatches"]) == (2, 1)
    state = cfg.model.hc_layout.streams * 2 * cfg.model.seq_len * cfg.model.d_model * 4
    assert first["sent/microbatch"] == last["received/microbatch"] == state > 0
    assert "lm_head/microbatch" in last and "lm_head/microbatch" not in first
    assert first["stages"] == 2 * sum(v for k, v in first.items() if k.endswith("/microbatch"))
    assert all(r.activation_bytes > 0 for r in ranks)
    # `parallel.microbatches: auto` fits an HC model at pp > 1 (it was refused before)
    from parallel.strategies.microbatch_fit import (
        Batch,
        estimated_peak,
        fit_microbatches,
        with_microbatches,
    )

    batch = Batch(8, "fp32")
    peaks = {m: estimated_peak(with_microbatches(parallel, m), cfg.model, batch, 2)
             for m in (2, 4)}
    assert peaks[2] > peaks[4]
    free = int((peaks[2] + peaks[4]) / 2 / 0.85)
    assert fit_microbatches(parallel, cfg.model, batch, 2, free) == (4, peaks[4])


def test_checkpointing_modes_order_for_hc():
    """At the paper shape block (= dwa_block) keeps far less than none."""
    for connection in ("hc", "mhc"):
        totals = {}
        for mode in ("none", "block", "dwa_block"):
            cfg = config("model.n_layers=48", "model.d_model=768", "model.n_heads=12",
                         "model.seq_len=256", f"model.connection={connection}",
                         "train.batch_size=8", f"parallel.activation_checkpointing={mode}")
            totals[mode] = estimated(cfg).activation_bytes
        assert totals["dwa_block"] == totals["block"] < totals["none"] / 3


def test_cli_prints_the_hc_terms():
    done = run_memory("--config", "configs/tiny.yaml", "--set", "model.vocab_size=512",
                      "--set", "model.connection=hc", "--device", "cpu")
    assert done.returncode == 0, done.stderr
    for term in ("hc_held", "hc_mixes", "blocks", "lm_head"):
        assert term in done.stdout


@pytest.mark.parametrize("name", [pytest.param("hc", marks=pytest.mark.slow), "mhc"])
def test_bf16_autocast_estimate_matches_the_probe(name):
    """Under bf16 autocast the states, the mixes and the branch inputs and outputs stay fp32
    (the mixes run with autocast off), the branches' matmul tensors are bf16: autocast's
    weight copies exactly the estimate's (no HC weight is cast), the kept activations
    within 1% (CPU autocast keeps one small fp32 tensor a block more)."""
    for mode in ("none", "block"):
        cfg = hc_config(name, mode, 1, "train.dtype=bf16")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            report = measured_report(cfg)
        estimate = estimated(cfg)
        assert report.autocast_copy_bytes == estimate.autocast_copies_bytes > 0
        assert 0 <= report.total_bytes - estimate.activation_bytes <= \
            0.01 * report.total_bytes, (name, mode)


CASES = [(name, sp, mode, every) for name in ("hc", "mhc") for sp in (False, True)
         for mode, every in (("none", 1), ("block", 2))]


def tp_config(name: str, sp: bool, mode: str, every: int):
    return hc_config(name, mode, every, "parallel.tp=2", "train.batch_size=4",
                     f"parallel.sequence_parallel={str(sp).lower()}", world_size=4)


def tp_cases() -> dict:
    out = {}
    for case in CASES:
        cfg = tp_config(*case)
        cfg.train.batch_size = 2  # this rank's micro-batch (DP=2)
        out[case] = measured_report(cfg).total_bytes
    return out


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_tp2_with_and_without_sequence_parallelism_matches_the_probe():
    """TP=2 x DP=2 (rank 0 measured): the mixes on the whole sequence on every TP rank
    without SP, on this rank's slice with it."""
    measured = run_distributed_test(tp_cases, world_size=2, tp=2, timeout_s=180)[0]
    diffs = {case: value - estimated(tp_config(*case), 4).activation_bytes
             for case, value in measured.items()}
    # The probe sees 48 bytes more at TP = 2 (a few small tensors of the vocabulary-parallel
    # loss, as for the other connections), whatever the variant or mode.
    assert all(0 <= d <= 48 for d in diffs.values()), diffs


def zero_state_cases() -> dict:
    return {(name, stage): real_state_bytes(stage, world_size=2, extra=VARIANTS[name])
            for name, stage in (("hc", 1), ("mhc", 2), ("hc", 3))}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_state_estimate_equals_real_tensors_with_zero_at_dp2():
    """ZeRO 1-3 at DP = 2 (dynamic HC at 1 and 3, mHC at 2): HC's weights partitioned with
    the connections' weight-decay group."""
    results = run_distributed_test(zero_state_cases, world_size=2, timeout_s=280)
    for rank, by_case in enumerate(results):
        for (name, stage), real in by_case.items():
            assert real == expected_state_bytes(stage, world_size=2, rank=rank,
                                                extra=VARIANTS[name]), (rank, name, stage)


# Pipeline stages: each stage of a plan chained in one process and measured by the probe's
# `measure_stage` (tests/test_memory_attnres.py `measured_stages`), against the estimate of
# its rank with one micro-batch in flight.
STAGE_CASES = {  # name -> (variant, blocks, pp)
    "hc-pp2": ("hc", 4, 2),
    "hc-static-pp2": ("hc-static", 4, 2),
    "mhc-pp2": ("mhc", 4, 2),
    "hc-pp3": ("hc", 6, 3),
    "hc-static-pp3": ("hc-static", 6, 3),
    "mhc-pp3": ("mhc", 6, 3),
    "hc-llama-n2-pp2": ("hc-llama-n2", 4, 2),
    "mhc-llama-n3-pp3": ("mhc-llama-n3", 6, 3),
}
FAST_STAGES = {("hc-pp2", "block"), ("mhc-pp3", "none")}


def hc_stage_config(case: str, mode: str, *extra: str, tp: int = 1):
    name, blocks, pp = STAGE_CASES[case]
    return config(f"model.n_layers={blocks}", *VARIANTS[name], f"parallel.pp={pp}",
                  f"parallel.activation_checkpointing={mode}", f"parallel.tp={tp}", *extra,
                  world_size=tp * pp)


@pytest.mark.parametrize("case,mode", [
    (c, m) if (c, m) in FAST_STAGES else pytest.param(c, m, marks=pytest.mark.slow)
    for c in STAGE_CASES for m in ("none", "block")])
def test_pipeline_stage_estimate_equals_the_probe(case, mode):
    """Each pipeline rank's estimate (one micro-batch in flight) is what its stage keeps, to
    the byte in fp32: the received state, the states, mixes and branches of its sub-layers
    (`none`) or their states, mixes and checkpointed branch inputs and outputs and one
    branch's recomputation (`block`), the sent state, the head on the last."""
    from tests.test_memory_attnres import measured_stages

    cfg = hc_stage_config(case, mode)
    pp = cfg.parallel.pp
    reports = measured_stages(cfg)
    assert len(reports) == pp
    for rank, report in enumerate(reports):
        estimate = estimated(cfg, pp, rank)
        assert estimate.activations["in_flight_microbatches"] == 1
        assert estimate.activation_bytes == report.total_bytes, (case, mode, rank,
                                                                 report.as_dict())
        assert estimate.activations["recompute_working_set"] == report.recompute_bytes
        assert (report.recompute_bytes > 0) == (mode == "block")


@pytest.mark.parametrize("mode", [pytest.param("none", marks=pytest.mark.slow), "block"])
def test_interleaved_hc_stages_sum_per_rank(mode):
    """PP = 2 with two virtual stages a rank (one block each): a rank's estimate is its two
    stages' bytes times the micro-batches in flight (2 on rank 0, 1 on rank 1), plus the
    larger recomputation, to the byte."""
    from tests.test_memory_attnres import measured_stages

    cfg = config("model.n_layers=4", *VARIANTS["mhc"], "parallel.pp=2",
                 "parallel.virtual_stages=2", "parallel.microbatches=2", "train.batch_size=4",
                 f"parallel.activation_checkpointing={mode}", world_size=2)
    reports = measured_stages(cfg)
    for rank, stages in enumerate(([0, 2], [1, 3])):
        terms = estimated(cfg, 2, rank).activations
        assert terms["in_flight_microbatches"] == 2 - rank
        assert terms["stages"] == (2 - rank) * sum(
            reports[s].total_bytes - reports[s].recompute_bytes for s in stages)
        assert terms["recompute_working_set"] == max(reports[s].recompute_bytes for s in stages)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["hc-pp2", "mhc-pp2", "hc-static-pp3"])
def test_pipeline_stages_with_a_bf16_boundary_under_autocast(case):
    """train.dtype bf16 with parallel.pipeline_dtype compute: X_{2b} crosses in bf16 and is
    widened to fp32 on receipt (both held); autocast's weight copies exactly the estimate's,
    the activations within 1% (CPU autocast keeps one small fp32 tensor a block more; with
    `block` to the byte)."""
    from tests.test_memory_attnres import bf16_stage_reports

    for mode, cfg, rank, report in bf16_stage_reports(hc_stage_config, case):
        estimate = estimated(cfg, cfg.parallel.pp, rank)
        assert report.autocast_copy_bytes == estimate.autocast_copies_bytes > 0
        assert 0 <= report.total_bytes - estimate.activation_bytes <= \
            0.01 * report.total_bytes, (case, mode, rank)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_pipeline_stages_under_tp2_with_and_without_sequence_parallelism():
    """TP = 2 x PP = 2 (the stages chained on one TP group, TP rank 0 measured): the state and
    the mixes on the whole sequence on every TP rank without SP, on this rank's slice with
    it."""
    from tests.test_memory_attnres import measured_stages_under_tp2

    measured = measured_stages_under_tp2(hc_stage_config, ("hc-pp2", "mhc-pp2"), timeout_s=180)
    diffs = {key: total - estimated(cfg, 2 * cfg.parallel.pp, 2 * key[3]).activation_bytes
             for key, (cfg, total) in measured.items()}
    assert all(d == 0 for d in diffs.values()), diffs
