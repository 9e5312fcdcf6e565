"""`python -m pretrain analyze`: DWA heatmaps and dwa_stats.json of a checkpoint and of a run.

One tiny run (4 blocks, a DWA after blocks 2 and 4, 2 steps, a checkpoint after each) serves
the module.
"""

import json

import pytest
import torch

from tests.test_train import run, train_cmd

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def trained_run(tiny_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("analyze") / "run"
    done = run(train_cmd(tiny_data, run_dir, "model.n_layers=4", "model.dwa_period=2",
                         "model.dwa_init_offdiag=0.05", "train.steps=2", "optim.warmup_steps=1",
                         "optim.lr=0.05", "data.val_batches=0", "checkpoint.every=1",
                         "tracking.enabled=false"))
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def model_matrix(path) -> torch.Tensor:
    from parallel.primitives import groups
    from pretrain.load import load_model

    model, _ = load_model(path, device="cpu")
    matrix = model.dwa_matrix()
    groups.destroy()
    return matrix


def analyze(*args) -> None:
    from pretrain.cli import main

    assert main(["analyze", *map(str, args)]) == 0


@pytest.mark.timeout(120)
def test_analyze_checkpoint_writes_the_heatmap_and_the_models_matrix(trained_run, tmp_path):
    step_dir = trained_run / "checkpoints" / "step-00000002"
    analyze("--checkpoint", step_dir, "--out", tmp_path)
    assert (tmp_path / "step-00000002.png").read_bytes()[:8] == PNG_MAGIC
    stats = json.loads((tmp_path / "dwa_stats.json").read_text())
    (entry,) = stats["checkpoints"]
    assert entry["step"] == 2 and entry["heatmap"] == "step-00000002.png"
    matrix = model_matrix(step_dir)
    assert torch.tensor(entry["matrix"]).equal(matrix)
    assert stats["model"] == {"n_layers": 4, "dilation": 1, "period": 2, "window": None}
    # Blocks 2 and 4 have DWAs: S_2 = {0, 1, 2}, S_4 = {0, ..., 4}.
    assert [(r["block"], r["inputs"]) for r in entry["rows"]] == [(2, [0, 1, 2]),
                                                                  (4, [0, 1, 2, 3, 4])]
    for row in entry["rows"]:
        i = row["block"]
        assert row["row_sum"] == pytest.approx(matrix[i - 1, :i + 1].sum().item(), rel=1e-6)
        assert row["x0"] == pytest.approx(matrix[i - 1, 0].item())
        assert row["own"] == pytest.approx(matrix[i - 1, i].item())


@pytest.mark.timeout(120)
def test_analyze_run_covers_every_checkpoint(trained_run, tmp_path):
    analyze("--run", trained_run, "--out", tmp_path)
    stats = json.loads((tmp_path / "dwa_stats.json").read_text())
    assert [e["step"] for e in stats["checkpoints"]] == [1, 2]
    for name in ("step-00000001.png", "step-00000002.png", "grid.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC
    first = model_matrix(trained_run / "checkpoints" / "step-00000001")
    assert torch.tensor(stats["checkpoints"][0]["matrix"]).equal(first)
    last = torch.tensor(stats["checkpoints"][1]["matrix"])
    assert last.equal(model_matrix(trained_run / "checkpoints" / "step-00000002"))
    assert not last.equal(first)  # training moved the weights between the two


def test_dwa_statistics_by_hand():
    from pretrain.analyze import dwa_row_stats, dwa_summary

    # 2 blocks, 1x1: S_1 = {0, 1}, S_2 = {0, 1, 2}.
    mask = [[True, True, False], [True, True, True]]
    matrix = torch.tensor([[0.5, 1.0, 0.0], [-0.25, -0.75, 1.5]])
    rows = dwa_row_stats(matrix, mask)
    assert rows[0] == {"block": 1, "inputs": [0, 1], "row_sum": 1.5, "x0": 0.5, "own": 1.0,
                       "negative_share": 0.0, "negative_mass": 0.0, "negative_mean": None}
    assert rows[1] == {"block": 2, "inputs": [0, 1, 2], "row_sum": 0.5, "x0": -0.25,
                       "own": 1.5, "negative_share": 2 / 3, "negative_mass": 1.0,
                       "negative_mean": 0.5}
    summary = dwa_summary(rows, matrix, mask)
    assert summary == {"dwas": 2, "weights": 5, "mean_row_sum": 1.0, "mean_x0": 0.125,
                       "mean_own": 1.25, "negative_share": 0.4, "negative_mean": 0.5,
                       "most_negative": -0.75}


def test_heatmap_of_a_strided_pattern(tmp_path):
    """A 4x5 pattern (rows without a DWA, a grid of two steps) draws without error."""
    from pretrain.dwa_plots import write_dwa_grid, write_dwa_heatmap
    from pretrain.model.dwa_pattern import pattern_for_shape

    pattern = pattern_for_shape(10, 4, 5, None)
    matrix = torch.tensor(pattern.initial_alpha()) - 0.3 * torch.tensor(pattern.mask()).float()
    path = write_dwa_heatmap(matrix, pattern.mask(), 7, tmp_path / "a" / "step.png")
    assert path.read_bytes()[:8] == PNG_MAGIC
    grid = write_dwa_grid([(1, matrix), (2, -matrix)], pattern.mask(), tmp_path / "grid.png")
    assert grid.read_bytes()[:8] == PNG_MAGIC


def test_checkpoint_heatmap_for_the_trainer(trained_run, tmp_path):
    from pretrain.analyze import write_checkpoint_heatmap
    from pretrain.model.dwa_pattern import pattern_for_shape

    path = write_checkpoint_heatmap(trained_run / "checkpoints" / "step-00000001",
                                    pattern_for_shape(4, 1, 2), tmp_path / "dwa")
    assert path == tmp_path / "dwa" / "step-00000001.png"
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert write_checkpoint_heatmap(trained_run / "checkpoints" / "step-00000001",
                                    pattern_for_shape(4, 1, None), tmp_path) is None
