"""pretrain.tracking: metrics.jsonl on resume, the MLflow run across a resume, the loss plot."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from pretrain.config import flat_params, load_config
from pretrain.tracking import (
    MetricsLog,
    Tracker,
    default_tracking_uri,
    git_commit,
    plot_loss_curve,
    read_metrics,
)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_log_appends_flushed_lines(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    log = MetricsLog(path, resume_step=None)
    log.log({"step": 1, "loss": torch.tensor(2.5), "lr": 1e-3})
    assert lines(path) == [{"step": 1, "loss": 2.5, "lr": 1e-3}]  # flushed before close
    log.log({"step": 2, "loss": float("nan"), "note": Path("x")})
    log.close()
    second = lines(path)[1]
    assert second["step"] == 2 and second["loss"] != second["loss"] and second["note"] == "x"


def test_metrics_log_resume_drops_later_steps_and_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [{"step": s, "loss": 10.0 - s} for s in range(1, 8)]
    records.insert(3, {"step": 3, "val_loss": 6.5})
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 8, "lo')
    with MetricsLog(path, resume_step=5) as log:
        assert lines(path) == [r for r in records if r["step"] <= 5]
        log.log({"step": 6, "loss": 0.5})
    assert [r["step"] for r in lines(path)] == [1, 2, 3, 3, 4, 5, 6]
    assert lines(path)[-1] == {"step": 6, "loss": 0.5}
    assert not path.with_name("metrics.jsonl.tmp").exists()


def test_metrics_log_fresh_start_discards_old_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 3.0}\n')
    MetricsLog(path, resume_step=None).close()
    assert path.read_text() == ""
    MetricsLog(tmp_path / "new.jsonl", resume_step=10).close()  # resume without a log: fine
    assert (tmp_path / "new.jsonl").read_text() == ""


def test_plot_loss_curve(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path, resume_step=None) as log:
        for step in range(1, 101):
            loss = None if step == 50 else 5.0 / step ** 0.3  # the trainer logs null for NaN
            log.log({"step": step, "loss": loss, "lr": 1e-3})
            if step % 25 == 0:
                log.log({"step": step, "val_loss": 5.2 / step ** 0.3})
    assert len(read_metrics(path)) == 104
    out = plot_loss_curve(path, tmp_path / "plots" / "loss.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert plot_loss_curve(empty, tmp_path / "empty.png").read_bytes()[:4] == b"\x89PNG"


def test_git_commit(tmp_path):
    assert re.fullmatch(r"[0-9a-f]{40}", git_commit())
    assert git_commit(tmp_path) == "unknown"


def test_default_uri_is_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert default_tracking_uri("run") == f"sqlite:///{tmp_path.resolve()}/run/mlflow.db"
    assert default_tracking_uri("run").startswith("sqlite:////")


def test_disabled_tracker_does_nothing(tmp_path):
    cfg = load_config(None)
    tracker = Tracker(cfg, tmp_path, run_id=None, enabled=False)
    tracker.log_metrics({"loss": 1.0}, step=1)
    tracker.set_tags({"layout": "x"})
    tracker.log_artifact(tmp_path)
    tracker.finish("FAILED")
    assert tracker.run_id is None
    off = Tracker(load_config(None, ["tracking.enabled=false"]), tmp_path, run_id="abc")
    off.log_metrics({"loss": 1.0}, step=1)
    assert off.run_id == "abc"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(120)
def test_mlflow_run_is_continued_on_resume(tmp_path, caplog):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = load_config(None, ["run.name=resume-test", "train.steps=20", "train.stop_at=10"])
    first = Tracker(cfg, run_dir, run_id=None)
    run_id = first.run_id
    first.set_tags({"layout": "tp1-pp1-dp1"})
    for step in (5, 10):
        first.log_metrics({"loss": 10.0 - step, "lr": 1e-3, "phase": "warmup",
                           "skipped": True, "tokens": torch.tensor(128)}, step=step)
    (run_dir / "config.yaml").write_text("x: 1\n")
    first.log_artifact(run_dir / "config.yaml")
    first.finish("KILLED")
    first.finish("FINISHED")  # a second finish is ignored

    client = MlflowClient(tracking_uri=default_tracking_uri(run_dir))
    assert client.get_run(run_id).info.status == "KILLED"

    # The resumed job changes run-control keys and even a logged param: no error, no re-log.
    resumed_cfg = load_config(None, ["run.name=resume-test", "train.steps=20",
                                     "train.stop_at=20", "train.log_every=3"])
    second = Tracker(resumed_cfg, run_dir, run_id=run_id)
    assert second.run_id == run_id
    assert client.get_run(run_id).info.status == "RUNNING"
    for step in (15, 20):
        second.log_metrics({"loss": 10.0 - step}, step=step)
    second.finish()

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "resume-test"
    history = client.get_metric_history(run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [
        (5, 5.0), (10, 0.0), (15, -5.0), (20, -10.0)]
    assert [m.value for m in client.get_metric_history(run_id, "tokens")] == [128.0, 128.0]
    assert "phase" not in run.data.metrics and "skipped" not in run.data.metrics
    expected = {k: str(v) for k, v in flat_params(cfg).items()}
    assert run.data.params == expected
    assert "train.stop_at" not in run.data.params
    assert run.data.tags["layout"] == "tp1-pp1-dp1"
    assert run.data.tags["resume_count"] == "1"
    assert re.fullmatch(r"[0-9a-f]{40}|unknown", run.data.tags["git_commit"])
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.name == "denseformer"
    assert len(client.search_runs([experiment.experiment_id])) == 1
    assert [a.path for a in client.list_artifacts(run_id)] == ["config.yaml"]
    assert (run_dir / "mlartifacts").is_dir()  # next to the db, not ./mlruns

    # A failing MLflow call warns instead of raising; an unknown run id is an error.
    third = Tracker(resumed_cfg, run_dir, run_id=run_id)
    with caplog.at_level(logging.WARNING, logger="pretrain.tracking"):
        third.log_artifact(run_dir / "does-not-exist.txt")
    assert "MLflow log_artifact failed" in caplog.text
    third.finish()
    with pytest.raises(RuntimeError, match="not found"):
        Tracker(resumed_cfg, run_dir, run_id="0" * 32)
