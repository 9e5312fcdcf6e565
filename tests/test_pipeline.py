"""Pipeline parallelism: the boundary plan against an independent count, and every layout
against the single-process model (loss and every gradient, alphas included).

Single-process references are computed in this test process; the ranks load the same
weights (a full state dict), run one pipelined step and compare their gradients, gathered
over TP into full tensors, with the reference. Tolerances: loss 1e-5 absolute, gradients
1e-5 relative per tensor (fp32). Multi-process layouts run many cases per spawn (spawning
ranks that import megatron-core costs 5-23 s); the exhaustive matrix is marked slow.
"""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, cli_env
from tests.pipeline_cases import check_stages_chained, reference_step, run_cases_on_ranks

SHAPE = dict(d_model=32, n_heads=4, vocab_size=200, seq_len=8)
MODELS = {  # name -> DenseFormerConfig fields beyond SHAPE
    "dense-1x1": dict(n_layers=6, dwa_dilation=1, dwa_period=1),
    "dense-4x1": dict(n_layers=8, dwa_dilation=4, dwa_period=1),
    "dense-4x5": dict(n_layers=10, dwa_dilation=4, dwa_period=5),
    "transformer": dict(n_layers=4, dwa=False),
    "odd-3x2": dict(n_layers=7, dwa_dilation=3, dwa_period=2),  # k, p divide no stage size
    # Llama blocks with grouped-query attention and an untied head: the head's weight lives
    # on the last stage only, with no embedding-group reduction.
    "llama-1x1-untied": dict(n_layers=6, dwa_dilation=1, dwa_period=1, block="llama",
                             n_kv_heads=2, tie_embeddings=False),
    # bf16 DWA storage: stages round the X_j they store (received or made) as one process.
    "dense-2x1-bf16": dict(n_layers=6, dwa_dilation=2, dwa_period=1, dwa_dtype="bf16"),
    # The Triton DWA kernels (model.dwa_impl; Triton's interpreter without a GPU): stages
    # and their partial DWAs run the same products as the model.
    "dense-4x5-triton": dict(n_layers=10, dwa_dilation=4, dwa_period=5, dwa_impl="triton"),
}
LLAMA_KEYS = ("block", "n_kv_heads", "tie_embeddings", "dwa_dtype", "dwa_impl")  # as given


# ---------------------------------------------------------------------------------------------
# The boundary plan against an independent count (docs/design.md#the-boundary-state-bound)


def expected_counts(d: int, k: int, p: int, b: int, dwa: bool = True) -> tuple[int, int]:
    """(bound, raw) at the boundary after block b, by enumerating future DWAs and past
    outputs: bound = sum_r min(|P_r|, |C_r|); raw = X_j read by a later DWA + next input."""
    dwas = [i for i in range(1, d + 1) if dwa and i % p == 0]

    def reads(i: int) -> list[int]:
        return [j for j in range(i + 1) if j % k == i % k]

    bound = 0
    for r in range(k):
        future = [i for i in dwas if i > b and i % k == r]
        consumers = len(future) + (1 if b % k == r else 0)
        if consumers:
            past = len([j for j in range(b + 1) if j % k == r])
            bound += min(past, consumers)
    read_later = {j for i in dwas if i > b for j in reads(i) if j <= b}
    raw = len(read_later) + (1 if b in dwas or b not in read_later else 0)
    return bound, raw


def random_splits(d: int, n_stages: int, count: int, rng: random.Random) -> list[list[int]]:
    splits = []
    for _ in range(count):
        cuts = sorted(rng.sample(range(1, d), n_stages - 1))
        splits.append([b - a for a, b in zip([0, *cuts], [*cuts, d], strict=True)])
    return splits


def model_config(d, k=1, p=1, window=None, dwa=True, **extra):
    from pretrain.model import DenseFormerConfig

    return DenseFormerConfig(n_layers=d, dwa=dwa, dwa_dilation=k, dwa_period=p,
                             dwa_window=window, **{**SHAPE, **extra})


def test_boundary_counts_match_the_bound_and_raw_count():
    from parallel.strategies.plan import build_plan

    rng = random.Random(0)
    checked = 0
    for d, k, p, dwa in [(6, 1, 1, True), (12, 1, 1, True), (12, 4, 1, True), (20, 4, 5, True),
                         (11, 3, 2, True), (9, 2, 3, True), (5, 7, 1, True), (8, 1, 8, True),
                         (48, 4, 5, True), (48, 1, 1, True), (7, 1, 1, False)]:
        cfg = model_config(d, k, p, dwa=dwa)
        for n_stages in range(2, min(d, 6) + 1):
            for split in random_splits(d, n_stages, 4, rng):
                plan = build_plan(cfg, n_stages, split=split)
                for count in plan.counts:
                    bound, raw = expected_counts(d, k, p, count["after_block"], dwa)
                    assert count["bound"] == bound and count["optimal"] == bound, (d, k, p, split)
                    assert count["raw"] == raw, (d, k, p, split, count)
                    assert count["optimal"] <= count["raw"]
                    checked += 1
    assert checked > 300


def test_window_and_connect_to_last_stay_between_bound_and_raw():
    from parallel.strategies.plan import build_plan

    for cfg in [model_config(10, 1, 1, window=3), model_config(9, 2, 1, window=4),
                model_config(8, 1, 8, dwa_init_offdiag=1e-4)]:
        for split in random_splits(cfg.n_layers, 3, 5, random.Random(1)):
            for count in build_plan(cfg, 3, split=split).counts:
                assert count["bound"] <= count["optimal"] <= count["raw"], (cfg, split, count)


def test_partial_sums_only_switch_on_once_per_class():
    from parallel.strategies import stage_state
    from parallel.strategies.plan import build_plan

    cfg = model_config(24, 4, 1)
    plan = build_plan(cfg, 6, split=[4] * 6)
    seen_partial: set[int] = set()
    for program in plan.programs[:-1]:
        classes = stage_state.boundary_classes(plan.pattern, program.last)
        for r, cl in classes.items():
            partial = any(item in program.outgoing for item in cl.consumers
                          if item.kind == "sum")
            assert partial or r not in seen_partial, (program.last, r)
            if partial:
                seen_partial.add(r)
    assert seen_partial


def test_balanced_split_counts_embedding_and_head():
    from parallel.strategies.plan import balanced_split, block_cost_units, stage_split

    assert balanced_split(6, 2, 1.0, 0.3) == [3, 3]
    assert balanced_split(8, 2, 1.0, 3.0) == [5, 3]
    assert balanced_split(4, 4) == [1, 1, 1, 1]
    paper = model_config(48, 4, 5, d_model=768, n_heads=12, vocab_size=50304, seq_len=256)
    embed, head = block_cost_units(paper)
    assert embed == 1.0 and 5.0 < head < 5.3  # 2 V H vs 24 H^2 + 4 S H per token
    split = stage_split(paper, 4)
    assert sum(split) == 48 and split[-1] < split[0]  # the head's stage holds fewer blocks
    assert stage_split(paper, 2, 2, [12] * 4) == [12] * 4
    with pytest.raises(ValueError, match="pp_split"):
        stage_split(paper, 4, 1, [12, 12, 12, 11])
    with pytest.raises(ValueError, match="stages"):
        balanced_split(3, 4)


@pytest.mark.parametrize("override,key", [
    (["parallel.pp=5", "model.n_layers=4"], "parallel.pp"),
    (["parallel.pp=2", "parallel.virtual_stages=3", "model.n_layers=5"],
     "parallel.virtual_stages"),
    (["parallel.pp=1", "parallel.virtual_stages=2"], "parallel.virtual_stages"),
    (["parallel.pp=2", "model.n_layers=6", "parallel.pp_split=[3, 2]"], "parallel.pp_split"),
    (["parallel.pp=2", "model.n_layers=6", "parallel.pp_split=[3, 3, 0]"], "parallel.pp_split"),
    (["parallel.pp=2", "model.n_layers=6", "parallel.pp_split=[6, 0]"], "parallel.pp_split"),
    (["parallel.pp=2", "parallel.pp_split=[a, b]"], "parallel.pp_split"),
    (["parallel.pp=2", "parallel.virtual_stages=2", "parallel.microbatches=5",
      "model.n_layers=8", "train.batch_size=10"], "parallel.microbatches"),
    (["parallel.pp=2", "parallel.zero_stage=2"], "parallel.zero_stage"),
    (["parallel.pp_transfer=best"], "parallel.pp_transfer"),
])
def test_pipeline_config_errors(override, key):
    from pretrain.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(None, override)
    assert err.value.key == key, err.value


def test_plan_cli_prints_only_json():
    overrides = ["parallel.pp=4", "parallel.pp_split=[12, 12, 12, 12]",
                 "parallel.microbatches=50"]  # batch 400: micro-batches of 8
    cmd = [sys.executable, "-m", "parallel.plan", "--config",
           str(ROOT / "configs/paper/dense-48-1x1.yaml"), "--json",
           *[a for o in overrides for a in ("--set", o)]]
    result = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), cwd=ROOT,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["stages"] == [[1, 12], [13, 24], [25, 36], [37, 48]]
    per_tensor = 8 * 256 * 768 * 2  # bf16: train.dtype auto on a GPU, pipeline_dtype compute
    for boundary in plan["boundaries"]:
        b = boundary["after_block"]
        bound, raw = expected_counts(48, 1, 1, b)
        assert (boundary["optimal"], boundary["raw"]) == (bound, raw)
        assert boundary["bytes_per_microbatch"] == {"raw": raw * per_tensor,
                                                    "optimal": bound * per_tensor}
    bad = subprocess.run(cmd[:-6] + ["--set", "parallel.pp=60"], capture_output=True,
                         text=True, env=cli_env(), cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "parallel.pp" in bad.stderr and bad.stdout == ""


# ---------------------------------------------------------------------------------------------
# Single process: every stage of a plan chained by hand equals the model


def reference(model_name: str, batch: int, microbatches: int, seed: int = 0,
              window: int | None = None):
    """(full state, tokens (batch, S + 1), loss, {name: full grad}) of the single-process
    model with random alphas, loss averaged over `microbatches` as the trainer does."""
    from pretrain.model import DenseFormer, DenseFormerConfig

    cfg = DenseFormerConfig(**{**SHAPE, **MODELS[model_name], "dwa_window": window})
    model = DenseFormer(cfg, seed=7)
    gen = torch.Generator().manual_seed(seed)
    if model.dwa_alpha is not None:  # away from the identity, so every alpha matters
        # Scale 0.5: at scale 1 the alpha gradients cancel so heavily over tokens that the
        # fp32 single-process run itself is 3e-5 (relative) away from fp64.
        with torch.no_grad():
            model.dwa_alpha.add_(0.5 * torch.randn(model.dwa_alpha.shape, generator=gen)
                                 * model.dwa_mask)
    return reference_step(model, batch, microbatches, gen)


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("mode", ["raw", "optimal"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_stages_chained_in_one_process_equal_the_model(model_name, mode, checkpointing):
    from parallel.strategies.plan import build_plan

    ref = reference(model_name, 4, 1)
    cfg = model_config(**{"d": MODELS[model_name]["n_layers"],
                          "k": MODELS[model_name].get("dwa_dilation", 1),
                          "p": MODELS[model_name].get("dwa_period", 1),
                          "dwa": MODELS[model_name].get("dwa", True),
                          **{key: MODELS[model_name][key] for key in LLAMA_KEYS
                             if key in MODELS[model_name]}})
    d = cfg.n_layers
    for split in random_splits(d, min(4, d), 2, random.Random(d)):
        plan = build_plan(cfg, len(split), split=split, transfer=mode)
        _, crossed = check_stages_chained(cfg, plan, ref, checkpointing, split)
        assert [len(sent) for sent in crossed] == [count[mode] for count in plan.counts], split


# ---------------------------------------------------------------------------------------------
# Multi-process: the schedules, the transfers and the gradient reductions


def make_case(name: str, mode: str, m: int, *, pp: int, virtual_stages: int = 1, split=None,
              dp: int = 1, **flags) -> dict:
    """A case with its single-process reference (computed here, in the test process)."""
    fields = MODELS[name]
    model = dict(d=fields["n_layers"], k=fields.get("dwa_dilation", 1),
                 p=fields.get("dwa_period", 1), dwa=fields.get("dwa", True),
                 **{key: fields[key] for key in LLAMA_KEYS if key in fields})
    case_split = split(fields["n_layers"]) if callable(split) else split
    flag_text = "".join(f"/{key}" for key, on in flags.items() if on)
    return dict(id=f"{name}/{mode}/m{m}/v{virtual_stages}/{case_split}{flag_text}",
                config=model_config(**model), microbatches=m, split=case_split,
                virtual_stages=virtual_stages,
                sequence_parallel=flags.get("sequence_parallel", False),
                runner_options=dict(transfer=mode,
                                    activation_checkpointing=flags.get("checkpointing", False)),
                reference=reference(name, 2 * dp * m, m, seed=m))


def uneven3(d: int) -> list[int]:
    """An uneven 3-stage split: the middle stage is the largest."""
    first, last = max(1, d // 4), max(1, d // 5)
    return [first, d - first - last, last]


LAYOUTS = {  # name -> (tp, pp, dp, virtual stages, split)
    "pp2": (1, 2, 1, 1, None),
    "pp2-interleaved": (1, 2, 1, 2, None),
    "pp3-uneven": (1, 3, 1, 1, uneven3),
    "pp4": (1, 4, 1, 1, None),
    "tp2-pp2": (2, 2, 1, 1, None),
    "pp2-dp2": (1, 2, 2, 1, None),
}
ALL = [name for name in MODELS if name != "dense-4x5-triton"]  # triton: in tp2-pp2 below
CKPT = {"checkpointing": True}
# Default suite: every model and both modes across the layouts, micro-batch counts from 1 to
# 8, and activation checkpointing (and sequence parallelism) inside stages; the exhaustive
# matrix below is marked slow. Entries: (models, modes, micro-batch counts, flags).
DEFAULT_CASES = {
    "pp2": [(ALL, ["raw", "optimal"], [1, 3], {}), (["dense-4x1"], ["optimal"], [2], CKPT)],
    "pp2-interleaved": [(["dense-1x1", "dense-4x5", "odd-3x2"], ["optimal"], [2, 4], {}),
                        (["dense-4x1"], ["raw"], [6], {})],
    "pp3-uneven": [(ALL, ["optimal"], [5], {}), (["dense-1x1", "odd-3x2"], ["raw"], [3], {})],
    "pp4": [(["dense-1x1", "dense-4x5", "odd-3x2"], ["optimal"], [4], {}),
            (["dense-4x1"], ["raw"], [8], {})],
    "tp2-pp2": [(["dense-1x1", "transformer"], ["optimal"], [2], {}),
                (["odd-3x2"], ["raw"], [2], CKPT),
                (["dense-4x5", "llama-1x1-untied", "dense-4x5-triton"], ["optimal"], [2],
                 {**CKPT, "sequence_parallel": True})],
    "pp2-dp2": [(["dense-1x1", "odd-3x2"], ["optimal"], [2], {}),
                (["dense-4x5"], ["raw"], [3], {})],
}


def run_layout(layout: str, entries, timeout_s: float):
    tp, pp, dp, virtual, split = LAYOUTS[layout]
    cases = [make_case(name, mode, m, pp=pp, virtual_stages=virtual, split=split, dp=dp,
                       **flags)
             for models, modes, counts, flags in entries
             for name, mode, m in itertools.product(models, modes, counts)
             if MODELS[name]["n_layers"] >= pp * virtual]
    return run_cases_on_ranks(cases, tp=tp, pp=pp, dp=dp, timeout_s=timeout_s)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", [  # pp4: slow (pp2, pp3 and interleaved cover its paths)
    pytest.param(name, marks=pytest.mark.slow) if name == "pp4" else name for name in LAYOUTS])
def test_pipeline_layout_matches_single_process(layout):
    run_layout(layout, DEFAULT_CASES[layout], timeout_s=360)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_layout_exhaustive(layout):
    from parallel.strategies.schedule import schedule_problem

    tp, pp, _, virtual, _ = LAYOUTS[layout]
    counts = [m for m in range(1, 9) if schedule_problem(pp, virtual, m) is None]
    entries = [(ALL, ["raw", "optimal"], counts, {}), (ALL, ["raw", "optimal"], [2], CKPT)]
    if tp > 1:
        entries.append((ALL, ["optimal"], [1, 3], {**CKPT, "sequence_parallel": True}))
    run_layout(layout, entries, timeout_s=3500)
