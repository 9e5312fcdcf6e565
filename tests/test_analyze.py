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


# -- Attention Residuals: depth weights over a validation batch ------------------------------

# 4 blocks, block AttnRes with 4 groups of 2 sub-layers: consumer c reads X_0, X_2, ... below
# c and its group's partial sum X_{c-1}.
ATTNRES_SOURCES = [[0], [0, 1], [0, 2], [0, 2, 3], [0, 2, 4], [0, 2, 4, 5], [0, 2, 4, 6],
                   [0, 2, 4, 6, 7], [0, 2, 4, 6, 8]]


@pytest.fixture(scope="module")
def attnres_run(tiny_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("analyze-attnres") / "run"
    done = run(train_cmd(tiny_data, run_dir, "model.n_layers=4", "model.connection=attnres",
                         "model.attnres_blocks=4", "train.steps=2", "optim.warmup_steps=1",
                         "optim.lr=0.05", "data.val_batches=0", "checkpoint.every=1",
                         "tracking.enabled=false"))
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.mark.timeout(120)
def test_analyze_attnres_checkpoint_draws_mean_and_spread(attnres_run, tmp_path):
    step_dir = attnres_run / "checkpoints" / "step-00000002"
    analyze("--checkpoint", step_dir, "--out", tmp_path, "--batch-size", "4")
    assert (tmp_path / "step-00000002.png").read_bytes()[:8] == PNG_MAGIC
    assert not (tmp_path / "dwa_stats.json").exists()
    stats = json.loads((tmp_path / "attnres_stats.json").read_text())
    assert stats["model"] == {"n_layers": 4, "attnres_blocks": 4}
    assert stats["batch"] == {"sequences": 4, "tokens": 32}
    assert stats["sources"] == ATTNRES_SOURCES
    (entry,) = stats["checkpoints"]
    assert entry["step"] == 2 and entry["heatmap"] == "step-00000002.png"
    mean, std = entry["mean"], entry["std"]
    for c, sources in enumerate(ATTNRES_SOURCES, start=1):
        read = [j for j, v in enumerate(mean[c - 1]) if v is not None]
        assert read == sources and [j for j, v in enumerate(std[c - 1]) if v is not None] \
            == sources
        assert sum(mean[c - 1][j] for j in read) == pytest.approx(1.0)
        row = entry["consumers"][c - 1]
        assert row["sources"] == sources and row["mean"] == [mean[c - 1][j] for j in read]
        assert row["x0"] == mean[c - 1][0] and row["newest"] == mean[c - 1][sources[-1]]
    assert entry["consumers"][0] == {"consumer": 1, "sources": [0], "mean": [1.0],
                                     "std": [0.0], "x0": 1.0, "newest": 1.0, "max": 1.0,
                                     "entropy": None}
    # Trained queries: weights that differ from uniform and between tokens.
    assert entry["summary"]["max_std"] > 1e-4
    assert any(abs(v - 1 / len(s)) > 1e-4 for s, row in zip(ATTNRES_SOURCES, mean, strict=True)
               for v in row if v is not None)


@pytest.mark.timeout(120)
def test_analyze_attnres_run_covers_every_checkpoint(attnres_run, tmp_path):
    analyze("--run", attnres_run, "--out", tmp_path, "--batch-size", "2")
    stats = json.loads((tmp_path / "attnres_stats.json").read_text())
    assert [e["step"] for e in stats["checkpoints"]] == [1, 2]
    for name in ("step-00000001.png", "step-00000002.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC
    assert stats["checkpoints"][0]["mean"] != stats["checkpoints"][1]["mean"]


def test_analyze_attnres_without_enough_data_names_the_option(attnres_run, tmp_path, capsys):
    from pretrain.cli import main

    step_dir = attnres_run / "checkpoints" / "step-00000001"
    assert main(["analyze", "--checkpoint", str(step_dir), "--out", str(tmp_path),
                 "--batch-size", "100000"]) == 2
    assert capsys.readouterr().err.startswith("error: --batch-size: ")
    assert main(["analyze", "--checkpoint", str(step_dir), "--out", str(tmp_path),
                 "--data", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.startswith("error: --data: ")


def test_recorded_weights_by_hand():
    """One block of full AttnRes with random queries and key norms: the recorded weights of
    consumers 2 (the MLP's input) and 3 (the output) from the formula, and uniform ones at
    init."""
    from pretrain.attnres_analysis import recorded_weights, weight_tables
    from pretrain.model import DenseFormer, DenseFormerConfig

    config = DenseFormerConfig(d_model=16, n_heads=2, vocab_size=50, seq_len=8, n_layers=1,
                               connection="attnres", init_std=0.3)
    model = DenseFormer(config, seed=0).eval()
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    mean, std = weight_tables(config.attnres_layout, recorded_weights(model, tokens))
    uniform = torch.tensor([[1, torch.nan, torch.nan], [0.5, 0.5, torch.nan], [1 / 3] * 3],
                           dtype=torch.float64)
    torch.testing.assert_close(mean, uniform, equal_nan=True)
    assert torch.nan_to_num(std).abs().max() < 1e-6
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        model.attnres_query.normal_(0, 1, generator=generator)
        model.attnres_key_norm.uniform_(0.5, 1.5, generator=generator)
    record = recorded_weights(model, tokens)

    def weights(c, xs):
        q = model.attnres_query[c - 1] * model.attnres_key_norm[c - 1]
        logits = torch.stack([(x * q).sum(-1) / (x.square().mean(-1) + config.norm_eps).sqrt()
                              for x in xs])
        return torch.softmax(logits, dim=0)

    with torch.no_grad():
        block = model.block(1)
        x0 = model.embed(tokens)
        x1 = block.attention_branch(x0)
        a2 = weights(2, [x0, x1])
        x2 = block.mlp_branch(a2[0, ..., None] * x0 + a2[1, ..., None] * x1)
        a3 = weights(3, [x0, x1, x2])
    torch.testing.assert_close(record[2], a2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(record[3], a3, rtol=1e-5, atol=1e-6)
    assert record[3].std(dim=(1, 2)).min() > 1e-3  # per token, not one weight for all


# -- MUDD: the mixes' weights over a validation batch; generate and export-hf of its run -----

@pytest.fixture(scope="module")
def mudd_run(tiny_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("analyze-mudd") / "run"
    done = run(train_cmd(tiny_data, run_dir, "model.n_layers=3", "model.connection=mudd",
                         "train.steps=2", "optim.warmup_steps=1", "optim.lr=0.05",
                         "data.val_batches=0", "checkpoint.every=2",
                         "tracking.enabled=false"))
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.mark.slow  # a training run of its own (the default suite's time budget)
@pytest.mark.timeout(180)
def test_analyze_mudd_writes_mean_and_spread_per_mix_and_stream(mudd_run, tmp_path, capsys):
    from pretrain.cli import main

    step_dir = mudd_run / "checkpoints" / "step-00000002"
    analyze("--checkpoint", step_dir, "--out", tmp_path, "--batch-size", "4")
    stats = json.loads((tmp_path / "mudd_stats.json").read_text())
    assert stats["model"] == {"n_layers": 3, "mudd_streams": "qkvr", "mudd_dynamic": True}
    (entry,) = stats["checkpoints"]
    assert [(r["mix"], r["stream"]) for r in entry["mixes"]] == [
        (1, "q"), (1, "k"), (1, "v"), (1, "r"), (2, "q"), (2, "k"), (2, "v"), (2, "r"),
        (3, "r")]
    assert all(len(r["mean"]) == r["mix"] + 1 for r in entry["mixes"])
    for stream in "qkvr":
        assert (tmp_path / f"step-00000002-{stream}.png").read_bytes()[:8] == PNG_MAGIC
    assert entry["max_std"] > 1e-6  # trained: per-token weights that differ between tokens
    # The same run: generation works, the Hugging Face export is refused by name.
    assert main(["generate", "--run", str(mudd_run), "--prompt", "the", "--max-new-tokens",
                 "4"]) == 0
    assert main(["export-hf", "--run", str(mudd_run), "--out", str(tmp_path / "hf")]) == 2
    assert "model.connection: mudd: export-hf does not support it" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


# -- Hyper-Connections: static weights as they are, dynamic ones over a validation batch -----

@pytest.fixture(scope="module")
def hc_runs(tiny_data, tmp_path_factory):
    """Two 2-step runs of 2 blocks: mHC with 2 streams, static HC with 3."""
    runs = {}
    for name, keys in (("mhc", ("model.connection=mhc", "model.hc_streams=2")),
                       ("static", ("model.connection=hc", "model.hc_dynamic=false",
                                   "model.hc_streams=3"))):
        run_dir = tmp_path_factory.mktemp(f"analyze-{name}") / "run"
        done = run(train_cmd(tiny_data, run_dir, "model.n_layers=2", *keys, "train.steps=2",
                             "optim.warmup_steps=1", "optim.lr=0.05", "data.val_batches=0",
                             "checkpoint.every=2", "tracking.enabled=false"))
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = run_dir
    return runs


@pytest.mark.slow  # two training runs: about 45 s on 2 cores
@pytest.mark.timeout(180)
def test_analyze_hc_draws_static_weights_and_dynamic_mean_and_spread(hc_runs, tmp_path):
    step = "step-00000002"
    analyze("--checkpoint", hc_runs["mhc"] / "checkpoints" / step, "--out", tmp_path / "m",
            "--batch-size", "4")
    assert (tmp_path / "m" / f"{step}.png").read_bytes()[:8] == PNG_MAGIC
    stats = json.loads((tmp_path / "m" / "hc_stats.json").read_text())
    assert stats["model"] == {"n_layers": 2, "connection": "mhc", "hc_streams": 2,
                              "dynamic": True}
    assert stats["batch"] == {"sequences": 4, "tokens": 32}
    (entry,) = stats["checkpoints"]
    mix = torch.tensor(entry["mean"]["mix"])
    assert mix.shape == (4, 2, 2)  # 4 sub-layers, H_res (destination, source)
    torch.testing.assert_close(mix.sum(-2), torch.ones(4, 2))  # doubly stochastic
    assert torch.tensor(entry["std"]["pre"]).max() > 0  # weights differ between tokens

    analyze("--run", hc_runs["static"], "--out", tmp_path / "s")
    stats = json.loads((tmp_path / "s" / "hc_stats.json").read_text())
    assert stats["model"]["dynamic"] is False and "batch" not in stats
    (entry,) = stats["checkpoints"]
    assert (tmp_path / "s" / entry["heatmap"]).read_bytes()[:8] == PNG_MAGIC
    assert torch.tensor(entry["mix"]).shape == (4, 3, 3)
    assert torch.tensor(entry["post"]).shape == (4, 3)
    # Trained two steps away from Ar = I.
    assert (torch.tensor(entry["mix"]) - torch.eye(3)).abs().max() > 1e-4
