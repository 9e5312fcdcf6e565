"""The memory estimator for Attention Residuals (parallel/strategies/attnres_memory.py)
against the autograd probe (parallel/strategies/memory_probe.py) on CPU, as
tests/test_memory.py checks the DWA's: within 5% in the checkpointing modes and 15% with
`none` (in practice 2-4% under, the gap of the Transformer's own block term: the mixes' own
terms are exact, see the dwa_block test), fp32, TP=1 and TP=2 with and without sequence
parallelism, and bf16 autocast; pipeline stages refused by name.
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
        assert_within(measured_activations(cfg), estimated(cfg).activation_bytes, mode,
                      (name, mode, every))


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


def test_pipeline_stages_are_refused_by_name():
    from parallel.strategies.memory import estimate

    cfg = config(*MODELS["full"], "parallel.pp=2", world_size=2)
    with pytest.raises(ValueError, match="parallel.pp=2"):
        estimate(cfg.parallel, cfg.model, cfg.train.batch_size, cfg.train.dtype, 2, "cpu")
    done = run_memory("--config", "configs/tiny-attnres.yaml", "--set", "model.vocab_size=512",
                      "--set", "parallel.pp=2", "--world-size", "2")
    assert done.returncode == 2 and "Attention Residuals with parallel.pp=2" in done.stderr
    assert run_memory("--config", "configs/tiny-attnres.yaml", "--set",
                      "model.vocab_size=512").returncode == 0
