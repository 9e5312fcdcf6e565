"""The loop without per-step host syncs: rows fetched at fetch points equal the per-step
values, NaN handling and stop requests at the fetch points, MLflow rows batched and none lost
(docs/training.md#the-step-loop-and-its-fetch-points)."""

import json
import signal
import subprocess
import time

import pytest
import torch

from tests.conftest import ROOT, cli_env
from tests.test_train import losses, run, train_cmd

QUICK = ["data.val_batches=0", "checkpoint.every=0"]
DIVERGES = ["optim.lr=1e30", "optim.min_lr=0", "optim.warmup_steps=0"]  # NaN from step 2


def rows(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_pending_rows_are_fetched_as_floats_in_order():
    from pretrain.step_rows import PendingRows

    pending = PendingRows()
    values = torch.tensor([2.5, 1.0 / 3.0, float("nan")], dtype=torch.float64)
    for step, value in enumerate(values, start=1):
        pending.start_step()
        pending.add({"step": step, "loss": value, "lr": 0.1 * step, "grad_norm": 4.0})
    fetched, seconds = pending.fetch()
    assert seconds >= 0 and len(pending) == 0
    assert [r["step"] for r in fetched] == [1, 2, 3]
    assert [r["loss"] for r in fetched[:2]] == [2.5, 1.0 / 3.0]  # exactly the float64 values
    assert fetched[2]["loss"] != fetched[2]["loss"]  # nan
    assert all(type(r["loss"]) is float and r["grad_norm"] == 4.0 for r in fetched)
    assert pending.fetch() == ([], 0.0)


@pytest.mark.timeout(400)
def test_rows_fetched_at_logging_steps_equal_the_per_step_rows(tiny_data, tmp_path):
    """Every step has its row, with the loss a run fetching every step has, bitwise; MLflow
    has the same row for every step."""
    from mlflow.tracking import MlflowClient

    from pretrain.tracking import default_tracking_uri

    every = run(train_cmd(tiny_data, tmp_path / "every", "train.steps=7", "train.log_every=1",
                          "tracking.enabled=false", *QUICK))
    assert every.returncode == 0, every.stderr
    batched = run(train_cmd(tiny_data, tmp_path / "batched", "train.steps=7",
                            "train.log_every=3", *QUICK))
    assert batched.returncode == 0, batched.stderr
    assert losses(tmp_path / "batched") == losses(tmp_path / "every")
    assert sorted(losses(tmp_path / "batched")) == list(range(1, 8))
    assert [line.split(" loss")[0] for line in batched.stderr.splitlines()
            if line.startswith("step ")] == ["step 3/7", "step 6/7", "step 7/7"]
    records = rows(tmp_path / "batched")
    assert all(r["tokens_per_s"] > 0 and r["grad_norm"] > 0 for r in records)

    client = MlflowClient(tracking_uri=default_tracking_uri(tmp_path / "batched"))
    (found,) = client.search_runs(client.get_experiment_by_name("denseformer").experiment_id)
    history = client.get_metric_history(found.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == sorted(
        losses(tmp_path / "batched").items())


@pytest.mark.timeout(400)
def test_non_finite_steps_are_judged_in_order_at_the_fetch_point(tiny_data, tmp_path):
    """on_nan=stop: the run stops at the fetch point after the first non-finite step, with
    the rows before it written and no checkpoint after it; on_nan=skip: the streak is
    counted row by row, and the step that breaks max_consecutive_skips stops the run."""
    stop = run(train_cmd(tiny_data, tmp_path / "stop", "train.steps=10", "train.log_every=5",
                         "tracking.enabled=false", *QUICK, *DIVERGES))
    assert stop.returncode == 3, stop.stderr
    assert "non-finite training loss at step 2:" in stop.stderr
    assert [r["step"] for r in rows(tmp_path / "stop")] == [1]
    assert not list((tmp_path / "stop" / "checkpoints").glob("step-*"))

    skip = run(train_cmd(tiny_data, tmp_path / "skip", "train.steps=10", "train.log_every=10",
                         "tracking.enabled=false", "train.on_nan=skip",
                         "train.max_consecutive_skips=2", *QUICK, *DIVERGES))
    assert skip.returncode == 3, skip.stderr
    assert "step 4: 3 steps in a row skipped" in skip.stderr
    records = rows(tmp_path / "skip")
    assert [(r["step"], r.get("skipped", False)) for r in records] == [
        (1, False), (2, True), (3, True)]
    assert records[1]["loss"] is None and records[1]["grad_norm"] is None


@pytest.mark.timeout(300)
def test_a_stop_request_is_acted_on_at_the_next_logging_step(tiny_data, tmp_path):
    from pretrain.checkpoint import latest_checkpoint, read_meta

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(train_cmd(tiny_data, run_dir, "train.steps=100000",
                                      "train.log_every=4", "tracking.enabled=false", *QUICK),
                            cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 4):
        assert time.time() < deadline and proc.poll() is None, "training did not start"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr
    step = read_meta(latest_checkpoint(run_dir / "checkpoints"))["step"]
    assert step % 4 == 0 and step >= 4, step
    assert [r["step"] for r in rows(run_dir)] == list(range(1, step + 1))


def test_tracker_logs_many_rows_in_requests_mlflow_accepts(tmp_path):
    from mlflow.tracking import MlflowClient

    from pretrain.config import load_config
    from pretrain.tracking import MAX_METRICS_PER_REQUEST, Tracker, default_tracking_uri

    tracker = Tracker(load_config(None, []), tmp_path)
    steps = MAX_METRICS_PER_REQUEST // 2 + 3  # two metrics a row: more than one request
    tracker.log_rows([{"step": s, "loss": 1.0 / s, "lr": 0.5, "skipped": True}
                      for s in range(1, steps + 1)])
    tracker.finish()
    client = MlflowClient(tracking_uri=default_tracking_uri(tmp_path))
    loss = client.get_metric_history(tracker.run_id, "loss")
    assert sorted((m.step, m.value) for m in loss) == [(s, 1.0 / s) for s in range(1, steps + 1)]
    assert len(client.get_metric_history(tracker.run_id, "lr")) == steps
    assert client.get_metric_history(tracker.run_id, "skipped") == []
    assert tracker.failed_writes == 0
