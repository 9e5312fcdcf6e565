"""A study end to end on a private local Slurm cluster: the CPU-tiny continuation study
(a Transformer, then continued from its weights as a DenseFormer, submitted with an afterok
dependency), with a second continuation that diverges instead of the continued Transformer,
so that the study partly fails: `python -m slurm report` must account for every run and name
the failure. (Three runs, the two continuations side by side: the smallest study that shows
dependencies, init_from, a failure and the report; the pairing itself is checked on
synthetic runs in tests/test_study_report.py.) Each finished run's generation speed is
measured after training (the sweep's `inference:`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from tests.conftest import ROOT, cli_env
from tests.test_slurm import cluster, slurm_env, wait_for_job  # noqa: F401  (fixture)


@pytest.mark.timeout(400)
def test_continuation_study_on_slurm_reports_every_run(cluster, tiny_data, tmp_path):  # noqa: F811
    spec = yaml.safe_load((ROOT / "configs/studies/continuation-tiny.yaml").read_text())
    spec["base"] = str(ROOT / "configs/tiny.yaml")
    spec["continue"]["grid"]["architecture"] = [
        "denseformer-1x1",
        {"name": "diverges", "set": {"model.dwa": False, "optim.lr": 1.0e6,
                                     "optim.min_lr": 1.0e5, "train.on_nan": "stop"}}]
    spec["inference"] = {"prompt": 8, "new_tokens": 8, "rounds": 1}  # speed after training
    study = tmp_path / "study.yaml"
    study.write_text(yaml.safe_dump(spec))
    out = tmp_path / "sweep"
    submitted = subprocess.run(
        [sys.executable, "-m", "slurm", "sweep", str(study), "--submit", "--out", str(out),
         "--set", f"data.path={tiny_data}"],
        env=slurm_env(cluster), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert submitted.returncode == 0, submitted.stderr
    assert "and 2 dependent job(s)" in submitted.stdout
    jobs = submitted.stdout.split("submitted job array ")[1].split(" (")[0:1]
    jobs += submitted.stdout.split("dependent job(s) ")[1].split(";")[0].split()
    for job in jobs:
        wait_for_job(cluster, job, 300)
    manifest = json.loads((out / "sweep.json").read_text())
    names = [r["name"] for r in manifest["runs"]]
    assert len(names) == 3 and all(r["depends_on"] == 0 for r in manifest["runs"][1:])

    reported = subprocess.run(
        [sys.executable, "-m", "slurm", "report", "--experiment", manifest["experiment"],
         "--tracking-uri", manifest["tracking_uri"], "--out", str(tmp_path / "report")],
        env=cli_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert reported.returncode == 0, reported.stderr
    summary = json.loads((tmp_path / "report" / "report.json").read_text())
    failed = {f["run"]: f for f in summary["failed"]}
    diverged = next(n for n in names if n.endswith("then-diverges-L2-W32-D5.12k-s0"))
    assert set(failed) == {diverged}, summary["failed"]
    assert "exit status 3" in failed[diverged]["why"]
    assert set(summary["runs"]) == set(names)  # every run accounted for
    assert all(summary["runs"][n]["status"] == "FINISHED" for n in names if n != diverged)
    dense = next(n for n in names if "then-denseformer-1x1" in n)
    assert summary["runs"][dense]["val_loss"] is not None
    from mlflow.tracking import MlflowClient  # the launcher measured generation speed

    client = MlflowClient(manifest["tracking_uri"])
    experiment = client.get_experiment_by_name(manifest["experiment"])
    (run,) = client.search_runs([experiment.experiment_id], f"tags.sweep_run = '{dense}'")
    assert run.data.metrics["inference/decode_tokens_per_s"] > 0
    assert run.data.tags["inference_status"] == "0"
    page = (tmp_path / "report" / "report.html").read_text()
    assert diverged in page and "DWA weights of" in page
    assert page.count("data:image/png;base64,") >= 2
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    assert commit[:12] in page
