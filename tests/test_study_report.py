"""`python -m slurm report` on synthetic MLflow runs with known answers: best-of-learning-rate
selection, paired differences, seed statistics, and failed, unfinished and never-started
runs listed by name. (Real MLflow runs in a temporary sqlite store, not mocks.)"""

from __future__ import annotations

import json
import math
import statistics

import pytest

from slurm.__main__ import main

SEEDS = (0, 1, 2)
# Known final losses: transformer is best at lr 1e-3, denseformer-1x1 at 3e-3.
LOSS = {("transformer", 1e-3): 3.00, ("transformer", 3e-3): 3.10,
        ("denseformer-1x1", 1e-3): 3.05, ("denseformer-1x1", 3e-3): 2.90}
SEED_SHIFT = {0: 0.0, 1: 0.02, 2: -0.01}  # shared by both architectures: cancels in pairs
NOISE = {("denseformer-1x1", 0): 0.004, ("denseformer-1x1", 1): -0.002,
         ("denseformer-1x1", 2): 0.001}


def _run(client, experiment, name, arch, lr, seed, status="FINISHED", loss=None,
         batch="8"):
    tags = {"sweep_id": "syn", "sweep_run": name, "architecture": arch, "N": "1000",
            "D": "5120", "C": str(6 * 1000 * 5120), "grid.n_layers": "2", "grid.d_model": "32",
            "grid.seed": str(seed), "grid.lr": f"{lr:g}", "git_commit": "abc123def456"}
    run = client.create_run(experiment, run_name=name, tags=tags)
    for key, value in {"train.seed": seed, "data.path": "/data/x", "train.batch_size": batch,
                       "model.seq_len": 32}.items():
        client.log_param(run.info.run_id, key, str(value))
    for step in range(1, 6):
        client.log_metric(run.info.run_id, "tokens_per_s", 1000.0 + step, step=step)
    if loss is not None:
        client.log_metric(run.info.run_id, "val_loss", loss, step=5)
        client.log_metric(run.info.run_id, "lm_eval/tiny_mc/acc", 0.5, step=5)
    if status != "RUNNING":
        client.set_terminated(run.info.run_id, status)
    return run


@pytest.fixture
def store(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    manifest = tmp_path / "sweep.json"
    experiment = client.create_experiment(
        "study", artifact_location=(tmp_path / "art").as_uri(),
        tags={"sweep_manifest": str(manifest)})
    names = []
    for (arch, lr), loss in LOSS.items():
        for seed in SEEDS:
            name = f"syn-{arch}-s{seed}-lr{lr:g}"
            _run(client, experiment, name, arch, lr, seed,
                 loss=loss + SEED_SHIFT[seed] + NOISE.get((arch, seed), 0.0))
            names.append(name)
    _run(client, experiment, "syn-crashed", "transformer", 1e-2, 0, status="FAILED")
    client.set_tag(client.search_runs([experiment], "tags.sweep_run = 'syn-crashed'")[0]
                   .info.run_id, "exit_status", "1")
    _run(client, experiment, "syn-killed-at-time-limit", "transformer", 1e-2, 1,
         status="RUNNING")
    names += ["syn-crashed", "syn-killed-at-time-limit", "syn-never-started"]
    manifest.write_text(json.dumps({"runs": [{"name": n} for n in names]}))
    return uri, tmp_path


def test_report_picks_best_lr_and_pairs_by_seed(store, capsys):
    uri, tmp_path = store
    assert main(["report", "--experiment", "study", "--tracking-uri", uri,
                 "--out", str(tmp_path / "report")]) == 0
    summary = json.loads((tmp_path / "report" / "report.json").read_text())
    best = {b["group"].split()[0]: b["lr"] for b in summary["best_lr"]}
    assert best == {"transformer": "0.001", "denseformer-1x1": "0.003"}

    (paired,) = summary["paired"]
    assert paired["architecture"] == "denseformer-1x1" and paired["pairs"] == 3
    diffs = [2.90 - 3.00 + NOISE[("denseformer-1x1", s)] for s in SEEDS]
    assert paired["mean"] == pytest.approx(statistics.fmean(diffs), abs=1e-9)
    assert paired["std"] == pytest.approx(statistics.stdev(diffs), abs=1e-9)
    half = 4.302652729911275 * statistics.stdev(diffs) / math.sqrt(3)  # t(0.975, 2 dof)
    assert paired["low"] == pytest.approx(paired["mean"] - half, rel=1e-6)
    assert paired["high"] == pytest.approx(paired["mean"] + half, rel=1e-6)

    config = {c["config"]: c for c in summary["configurations"]}
    transformer = config["transformer L2 W32 D5.12k lr=0.001"]
    losses = [3.00 + SEED_SHIFT[s] for s in SEEDS]
    assert transformer["seeds"] == 3
    assert transformer["mean"] == pytest.approx(statistics.fmean(losses))
    assert transformer["std"] == pytest.approx(statistics.stdev(losses))
    assert transformer["ppl"] == pytest.approx(statistics.fmean(math.exp(x) for x in losses))

    failed = {f["run"]: f for f in summary["failed"]}
    assert set(failed) == {"syn-crashed", "syn-killed-at-time-limit", "syn-never-started"}
    assert "exit status 1" in failed["syn-crashed"]["why"]
    assert failed["syn-never-started"]["status"] == "NEVER STARTED"
    assert len(summary["runs"]) == 14  # every MLflow run is accounted for

    page = (tmp_path / "report" / "report.html").read_text()
    for name in failed:
        assert name in page
    assert page.count("data:image/png;base64,") >= 2  # loss bars, loss vs lr
    assert "tiny_mc/acc" in page and "abc123def456" in page
    assert "syn-never-started" in capsys.readouterr().err

    assert main(["report", "--experiment", "nope", "--tracking-uri", uri,
                 "--out", str(tmp_path / "r")]) == 2
    assert "no experiment named 'nope'" in capsys.readouterr().err


def test_report_fits_laws_and_the_multiplier_of_the_best_lr_runs():
    """Runs on exact power laws, DenseFormer as good as the Transformer with 1.5x the
    compute; a worse learning rate per size must not enter the fit."""
    from slurm.report import build_report
    from slurm.report_data import Study, StudyRun

    runs = []
    for arch, gain in (("transformer", 1.0), ("denseformer-1x1", 1.5)):
        for width, compute in ((16, 1e9), (32, 1e10), (64, 1e11)):
            for lr, worse in ((1e-3, 0.0), (1e-2, 0.3)):
                loss = 40 * (gain * compute) ** -0.05 + worse
                runs.append(StudyRun(
                    run_id=f"{arch}{width}{lr}", name=f"{arch}-W{width}-lr{lr:g}",
                    status="FINISHED", params={"train.seed": "0"}, metrics={"val_loss": loss},
                    tags={"architecture": arch, "N": str(compute / 6e6), "D": "1e6",
                          "C": str(compute), "grid.n_layers": "2", "grid.d_model": str(width),
                          "grid.seed": "0", "grid.lr": f"{lr:g}"}))
    page, summary = build_report(Study("s", "sqlite://", runs, [], None), "transformer")
    assert summary["laws"]["transformer"]["alpha"] == pytest.approx(0.05, rel=1e-6)
    (middle,) = [m for m in summary["multipliers"]["denseformer-1x1"]
                 if m["compute"] == pytest.approx(1e10)]
    assert middle["value"] == pytest.approx(1.5, rel=1e-6)
    assert {b["lr"] for b in summary["best_lr"]} == {"0.001"}
    assert "Scaling laws and compute multiplier" in page
