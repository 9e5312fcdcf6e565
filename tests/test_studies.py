"""The studies of configs/studies/ and the sweep language they use: every CPU-tiny study
expands in a dry run within the size the tests allow, shapes matched to a parameter count,
per-architecture learning-rate grids, a dependent `continue:` stage submitted with Slurm
job dependencies, and lm-eval settings. No Slurm, no training (tests/test_study_run.py runs
a study end to end)."""

from __future__ import annotations

import math

import pytest
import yaml

from slurm.sweep import manifest_of, sbatch_command
from slurm.sweep_shapes import matched_width, parse_count
from slurm.sweep_spec import SweepError, expand
from slurm.sweep_stages import follow_up_commands, lm_eval_command
from tests.conftest import ROOT

STUDIES = ROOT / "configs/studies"
TINY_STUDIES = sorted(STUDIES.glob("*-tiny.yaml"))
CLUSTER_STUDIES = sorted(p for p in STUDIES.glob("*.yaml") if not p.name.endswith("-tiny.yaml"))
QUESTIONS = ("width-vs-depth", "lr-tuning", "scaling", "continuation", "downstream", "cost",
             "kxp", "connections")
# Runs a CPU-tiny study may hold (default 6): the connections study compares up to 9
# connections in two arms over 3 seeds, about 12 s a run on the local Slurm.
MAX_TINY_RUNS = {"connections-tiny": 60}


def test_one_tiny_and_one_cluster_study_per_question():
    assert sorted(p.name for p in TINY_STUDIES) == sorted(f"{q}-tiny.yaml" for q in QUESTIONS)
    assert sorted(p.name for p in CLUSTER_STUDIES) == sorted(f"{q}.yaml" for q in QUESTIONS)


@pytest.mark.parametrize("study", TINY_STUDIES, ids=lambda p: p.stem)
def test_tiny_study_expands_small(study, tmp_path, tiny_data):
    sweep = expand(study, [f"data.path={tiny_data}"], out=tmp_path / "out")
    assert 2 <= len(sweep.runs) <= MAX_TINY_RUNS.get(study.stem, 6)
    for run in sweep.runs:
        assert run.config.train.steps <= 50 and run.config.model.d_model <= 64
        assert run.memory_bytes is not None  # the vocabulary is known: estimated
    assert len({r.name for r in sweep.runs}) == len(sweep.runs)


@pytest.mark.parametrize("study", CLUSTER_STUDIES, ids=lambda p: p.stem)
def test_cluster_study_expands(study, tmp_path):
    sweep = expand(study, [], out=tmp_path / "out")
    assert len(sweep.runs) >= 3 and sweep.slurm["gpus_per_node"] == 8


def test_dry_run_of_a_study_prints_the_dependent_jobs(tmp_path, capsys):
    from slurm.__main__ import main

    assert main(["sweep", str(STUDIES / "continuation-tiny.yaml"), "--dry-run",
                 "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "run 2 starts after run 0" in out and "--array=0-0%2" in out
    assert "then 2 dependent run(s)" in out
    assert not (tmp_path / "out").exists()


def test_params_match_widths_with_the_models_own_count(tmp_path):
    sweep = expand(STUDIES / "width-vs-depth.yaml", [], out=tmp_path / "out")
    target = parse_count("85M", "grid.params")
    shapes = {(r.values["n_layers"], r.values["d_model"]) for r in sweep.runs}
    assert {d for d, _ in shapes} == {12, 24, 48, 72} and len(shapes) == 4
    for run in sweep.runs:
        width = run.values["d_model"]
        assert width % 64 == 0 and run.config.model.n_heads == width // 64
        model = run.config.model.with_vocab(50304)
        # No other multiple of 64 is closer to the target in ratio.
        for other in (width - 64, width + 64):
            import dataclasses

            n = dataclasses.replace(model, d_model=other, n_heads=other // 64, dwa=False)
            assert abs(math.log(n.num_params(non_embedding=True) / target)) >= abs(
                math.log(dataclasses.replace(model, dwa=False).num_params(
                    non_embedding=True) / target))
    # Every architecture trains the same shapes.
    by_arch = {}
    for run in sweep.runs:
        by_arch.setdefault(run.architecture, set()).add(run.values["d_model"])
    assert len({frozenset(v) for v in by_arch.values()}) == 1

    from pretrain.model.config import DenseFormerConfig

    tiny = DenseFormerConfig(n_layers=2, d_model=32, n_heads=2, vocab_size=512, seq_len=32)
    assert matched_width(tiny, 4, 1e3, 4) == {"n_layers": 4, "d_model": 4, "n_heads": 1}
    assert parse_count("1.5G", "k") == 1.5e9 and parse_count(2e7, "k") == 2e7
    with pytest.raises(SweepError, match="grid.params: 'twenty' is not a parameter count"):
        parse_count("twenty", "grid.params")


def test_each_architecture_has_its_own_lr_grid(tmp_path):
    spec = yaml.safe_load((STUDIES / "lr-tuning-tiny.yaml").read_text())
    spec["base"] = str(ROOT / "configs/tiny.yaml")
    spec["grid"]["architecture"] = [{"name": "transformer", "lr": [1e-3, 3e-3]},
                                    {"name": "denseformer-1x1", "lr": [1e-2]}]
    spec["grid"]["warmup"] = [0.0, 0.2]
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec))
    sweep = expand(path, [], out=tmp_path / "out")
    got = {(r.architecture, r.config.optim.lr, r.config.optim.warmup_steps) for r in sweep.runs}
    assert got == {("transformer", 1e-3, 0), ("transformer", 1e-3, 4),
                   ("transformer", 3e-3, 0), ("transformer", 3e-3, 4),
                   ("denseformer-1x1", 1e-2, 0), ("denseformer-1x1", 1e-2, 4)}
    dense = [r for r in sweep.runs if r.architecture == "denseformer-1x1"]
    assert all(r.config.model.dwa for r in dense)  # the shorthand's keys in a mapping
    assert {r.tags("x")["grid.lr"] for r in dense} == {"0.01"}


def test_continue_stage_depends_on_its_parent_and_uses_init_from(tmp_path):
    sweep = expand(STUDIES / "continuation-tiny.yaml", [], out=tmp_path / "out")
    parent, *children = sweep.runs
    assert parent.depends_on is None and len(children) == 2
    for child in children:
        assert child.depends_on == 0
        assert child.config.train.init_from == parent.config.run.dir
        assert child.config.train.seed == parent.config.train.seed
        assert child.tags("x")["continues"] == parent.name
        assert child.values["d_model"] == parent.values["d_model"]
    assert {c.architecture for c in children} == {"transformer", "denseformer-1x1"}
    assert manifest_of(sweep)["runs"][2]["depends_on"] == 0
    first = sbatch_command(sweep, sweep.out)
    assert "--array=0-0%2" in first and not any(a.startswith("--dependency") for a in first)
    second = sbatch_command(sweep, sweep.out, array="2", dependency="afterok:77_0")
    assert "--array=2" in second and "--dependency=afterok:77_0" in second
    assert "--kill-on-invalid-dep=yes" in second


@pytest.mark.parametrize("change, message", [
    ({"grid": {"architecture": ["denseformer-1x1"], "tokens": [5120]},
      "from": {"architecture": "denseformer-1x1"}}, "matches no run"),
    ({"grid": {"architecture": ["transformer"]}}, "continue.grid.tokens"),
    ({"grid": {"architecture": ["transformer"], "tokens": [5120], "shape": [{}]}},
     "the shape and seed are the parent's"),
])
def test_invalid_continue_stages_are_refused(tmp_path, change, message):
    spec = yaml.safe_load((STUDIES / "continuation-tiny.yaml").read_text())
    spec["base"] = str(ROOT / "configs/tiny.yaml")
    spec["continue"] = {**spec["continue"], **change}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(SweepError, match=message):
        expand(path, [], out=tmp_path / "out")


def test_a_denseformer_cannot_be_continued_as_a_transformer(tmp_path):
    spec = yaml.safe_load((STUDIES / "continuation-tiny.yaml").read_text())
    spec["base"] = str(ROOT / "configs/tiny.yaml")
    spec["grid"]["architecture"] = ["denseformer-1x1"]
    spec["continue"]["from"] = {}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(SweepError, match="cannot start a transformer run.*model.dwa"):
        expand(path, [], out=tmp_path / "out")


def test_lm_eval_settings_reach_the_manifest_and_the_command(tmp_path):
    sweep = expand(STUDIES / "downstream-tiny.yaml", [], out=tmp_path / "out")
    assert sweep.lm_eval["include_path"] == str(STUDIES / "tasks")
    assert manifest_of(sweep)["lm_eval"] == sweep.lm_eval
    command = lm_eval_command(sweep.lm_eval, "/runs/x", "cpu")
    assert command[:3] == ["lm-eval", "--model_args", "checkpoint=/runs/x"]
    assert "study_cloze" in command and str(STUDIES / "tasks") in command
    spec = yaml.safe_load((STUDIES / "downstream-tiny.yaml").read_text())
    spec["base"] = str(ROOT / "configs/tiny.yaml")
    spec["lm_eval"] = {"tasks": ["x"], "include_path": "no-such-dir"}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(SweepError, match="lm_eval.include_path"):
        expand(path, [], out=tmp_path / "out")


def test_inference_settings_become_the_speed_command(tmp_path):
    sweep = expand(STUDIES / "cost-tiny.yaml", [], out=tmp_path / "out")
    assert manifest_of(sweep)["inference"] == {"batch": 1, "prompt": 16, "new_tokens": 16,
                                               "rounds": 3}
    commands = follow_up_commands(None, sweep.inference, "/runs/x", "cpu")
    assert commands == {"inference_status": [
        "-m", "slurm.inference_speed", "--run", "/runs/x", "--batch", "1", "--prompt", "16",
        "--new-tokens", "16", "--rounds", "3"]}
    spec = yaml.safe_load((STUDIES / "cost-tiny.yaml").read_text())
    spec["base"] = str(ROOT / "configs/tiny.yaml")
    spec["inference"] = {"batch": 0}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(SweepError, match="inference.batch: expected a positive integer"):
        expand(path, [], out=tmp_path / "out")


def test_architecture_shorthands_name_their_connection():
    from slurm.sweep_axes import SweepError, parse_architecture

    assert parse_architecture("attnres").overrides == {
        "model.connection": "attnres", "model.attnres_blocks": None}
    assert parse_architecture("attnres-block8").overrides == {
        "model.connection": "attnres", "model.attnres_blocks": 8}
    assert parse_architecture("denseformer-4x5").overrides["model.dwa_period"] == 5
    assert parse_architecture("mudd").overrides == {
        "model.connection": "mudd", "model.mudd_dynamic": True}
    assert parse_architecture("mudd-static").overrides == {
        "model.connection": "mudd", "model.mudd_dynamic": False}
    with pytest.raises(SweepError, match="attnres-blockN"):
        parse_architecture("attnres-8")


def test_flops_arm_gives_each_variant_the_transformers_flops(tmp_path, tiny_data):
    from slurm.sweep_flops import ARMS_TAG

    sweep = expand(STUDIES / "connections-tiny.yaml", [f"data.path={tiny_data}"],
                   out=tmp_path / "out")
    arms = {r.name: set(r.tags("x")[ARMS_TAG].split(",")) for r in sweep.runs}
    base = {r.config.train.seed: r for r in sweep.runs if r.architecture == "transformer"}
    assert all(arms[r.name] == {"params", "flops"} for r in base.values())
    params = [r for r in sweep.runs if "params" in arms[r.name]]
    flops = [r for r in sweep.runs if "flops" in arms[r.name]]
    # Matched parameters: one shape and one D; N differs by the connections' parameters only.
    assert len({(r.values["n_layers"], r.values["d_model"], r.tokens) for r in params}) == 1
    # (mHC's projections of the n x H state are the most at this width: +50% here, +1.9% at
    # 48 x 768; MUDD's weight MLPs +8.9%, +1.2%.)
    assert all(0 <= r.n_params - base[0].n_params < 0.6 * base[0].n_params for r in params)
    # Matched FLOPs: every architecture once per seed, at the baseline's FLOPs to the nearest
    # whole step (one step more or fewer would be further off).
    assert sorted((r.architecture, r.config.train.seed) for r in flops) == sorted(
        (r.architecture, r.config.train.seed) for r in params)
    twins = 0
    for run in flops:
        target = base[run.config.train.seed].model_flops
        per_token = run.model_flops / run.tokens
        step = run.tokens // run.config.train.steps
        miss = abs(run.model_flops - target)
        assert miss <= per_token * step / 2
        assert miss <= min(abs(per_token * (run.tokens + d) - target) for d in (-step, step))
        twins += "params" not in arms[run.name]
        if per_token * step / 2 < run.model_flops - target:  # more FLOPs a token: fewer tokens
            assert run.tokens < base[0].tokens
    assert twins >= 6  # attnres, attnres-block4 and denseformer-1x1 need fewer steps
    assert len({r.name for r in sweep.runs}) == len(sweep.runs)


def test_matched_tokens_and_what_match_flops_refuses(tmp_path):
    from slurm.sweep_flops import matched_tokens

    assert matched_tokens(1000.0, 8.0) == 125.0
    with pytest.raises(SweepError, match="FLOPs must be positive"):
        matched_tokens(1000.0, 0.0)
    spec = yaml.safe_load((STUDIES / "connections-tiny.yaml").read_text())
    spec["base"] = str(ROOT / "configs/tiny.yaml")
    spec["grid"]["seed"] = [0]
    for change, message in (
            ({"match_flops": "denseformer-2x2"}, "must name an architecture of the grid"),
            ({"grid": {**spec["grid"], "tokens": None, "tokens_per_param": [0.1]}},
             "needs grid.tokens"),
            ({"continue": {"grid": {"tokens": [512]}}}, "match_flops and continue")):
        changed = {**spec, **change}
        changed["grid"] = {k: v for k, v in changed["grid"].items() if v is not None}
        path = tmp_path / "s.yaml"
        path.write_text(yaml.safe_dump(changed))
        with pytest.raises(SweepError, match=message):
            expand(path, [], out=tmp_path / "out")
