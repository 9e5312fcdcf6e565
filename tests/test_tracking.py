"""pretrain.tracking: metrics.jsonl on resume, the MLflow run across a resume, the loss plot,
and what happens when the tracking store is unreachable or dies mid-run."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from parallel.primitives.groups import free_port
from pretrain.config import ConfigError, flat_params, load_config
from pretrain.tracking import (
    HTTP_BOUNDS,
    RUN_TAGS_ENV,
    MetricsLog,
    Tracker,
    default_tracking_uri,
    git_commit,
    plot_loss_curve,
    read_metrics,
)
from tests.conftest import ROOT, cli_env


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
    assert run.info.status == "FINISHED" and run.info.run_name == run_dir.name  # not run.name
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
    with pytest.raises(ConfigError, match="tracking.uri: MLflow run 0+ .*not found"):
        Tracker(resumed_cfg, run_dir, run_id="0" * 32)


# ---------------------------------------------------------------------------------------
# An unreachable or failing tracking store (loopback addresses only)


def closed_port_uri() -> str:
    """An http URI on a loopback port that nothing listens on (connection refused)."""
    return f"http://127.0.0.1:{free_port()}"


@contextlib.contextmanager
def silent_server(lifetime_s: float = 120) -> Iterator[str]:
    """A loopback socket that accepts connections and never answers; it closes itself after
    `lifetime_s` (or when the block ends)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        held = []
        deadline = time.monotonic() + lifetime_s
        while not stop.is_set() and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                held.append(listener.accept()[0])  # and never read from it nor answer
        for conn in held:
            conn.close()
        listener.close()

    thread = threading.Thread(target=serve, name="silent-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)


@contextlib.contextmanager
def unreachable(kind: str) -> Iterator[str]:
    if kind == "closed-port":
        yield closed_port_uri()
    else:
        with silent_server() as uri:
            yield uri


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", [
    "closed-port",
    # Slow: a server that never answers is also the CLI test below, in the default suite.
    pytest.param("never-answers", marks=pytest.mark.slow)])
def test_unreachable_server_is_a_config_error_within_30s(tmp_path, kind, caplog):
    with unreachable(kind) as uri:
        cfg = load_config(None, [f"tracking.uri={uri}"])
        start = time.monotonic()
        with pytest.raises(ConfigError) as err:
            Tracker(cfg, tmp_path)
        elapsed = time.monotonic() - start
        assert elapsed < 30, f"{kind}: took {elapsed:.0f}s"
        assert err.value.key == "tracking.uri" and uri in str(err.value)
        assert "tracking.required=false" in str(err.value)

        optional = load_config(None, [f"tracking.uri={uri}", "tracking.required=false"])
        with caplog.at_level(logging.WARNING, logger="pretrain.tracking"):
            tracker = Tracker(optional, tmp_path)
            tracker.log_metrics({"loss": 1.0}, step=1)
            tracker.finish()
    assert not tracker.enabled and tracker.run_id is None
    assert len(caplog.records) == 1 and uri in caplog.text
    assert "continues without MLflow" in caplog.text
    # The bounds applied to the calls only: nothing leaks into the rest of the process.
    assert not set(HTTP_BOUNDS) & set(os.environ)


def tiny_train(data: Path, run_dir: Path, *extra: str) -> list[str]:
    sets = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=32",
            "model.dwa_dilation=1", "model.dwa_period=1", "train.batch_size=8",
            "optim.warmup_steps=1", "data.val_batches=1", "train.steps=3",
            "train.eval_every=0", f"data.path={data}", f"run.dir={run_dir}", *extra]
    return [sys.executable, "-m", "pretrain", "train", "--config",
            str(ROOT / "configs/tiny.yaml"), *[a for s in sets for a in ("--set", s)]]


def run_cli(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env=env or cli_env())


@pytest.mark.timeout(300)
def test_cli_exits_2_when_the_tracking_server_never_answers(tiny_data, tmp_path):
    with silent_server() as uri:
        done = run_cli(tiny_train(tiny_data, tmp_path / "run", f"tracking.uri={uri}"))
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"error: tracking.uri: cannot reach the MLflow tracking store {uri}" in done.stderr
    waited = int(re.search(r"gave up after (\d+) s", done.stderr).group(1))
    assert waited < 30
    assert "Traceback" not in done.stderr
    from pretrain.checkpoint import latest_checkpoint

    assert latest_checkpoint(tmp_path / "run" / "checkpoints") is None  # nothing trained


@pytest.mark.timeout(300)
def test_cli_trains_with_one_warning_when_tracking_is_not_required(tiny_data, tmp_path):
    uri = closed_port_uri()
    run_dir = tmp_path / "run"
    done = run_cli(tiny_train(tiny_data, run_dir, f"tracking.uri={uri}",
                              "tracking.required=false"))
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if "warning" in line.lower()]
    assert len(warnings) == 1 and uri in warnings[0], warnings
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r] \
        == [1, 2, 3]
    assert (run_dir / "loss_curve.png").exists()


@pytest.mark.timeout(300)
def test_cli_run_carries_env_tags_and_prints_no_mlflow_info(tiny_data, tmp_path):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "group-run"
    tags = {"sweep_id": "s1", "architecture": "transformer", "N": "1234", "D": "768"}
    # A shared cluster's umask: every file and directory of the run is group-writable.
    done = subprocess.run(tiny_train(tiny_data, run_dir, "train.log_every=1"),
                          capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env={**cli_env(), RUN_TAGS_ENV: json.dumps(tags)},
                          preexec_fn=lambda: os.umask(0o002))
    assert done.returncode == 0, done.stderr[-3000:]
    for path in [run_dir, *run_dir.rglob("*")]:
        mode = path.stat().st_mode & 0o777
        assert mode == (0o775 if path.is_dir() else 0o664), (path, oct(mode))
    # Progress lines: elapsed time and ETA; on a CPU the MFU says what it is measured against.
    progress = [line for line in (done.stdout + done.stderr).splitlines()
                if line.startswith("step 3/3 ")]
    assert re.search(r"MFU \S+% vs measured CPU matmul elapsed \d+s eta 0s$", progress[0]), \
        progress
    assert "Creating initial MLflow database tables" not in done.stderr
    assert " INFO " not in done.stderr and "INFO mlflow" not in done.stderr
    client = MlflowClient(default_tracking_uri(run_dir))
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert tags.items() <= run.data.tags.items()
    # MFU keeps its key; the peak it divides by is a param, named for what it is.
    assert run.data.params["mfu_peak_source"].startswith("measured: fp32 matmul on cpu")
    assert float(run.data.params["mfu_peak_flops"]) > 0
    assert {"mfu", "mfu_peak_flops"} <= run.data.metrics.keys()
    # Named after its directory; the model's size; no tag for a value it does not have.
    assert run.info.run_name == "group-run"
    model = load_config(run_dir / "config.yaml").model
    assert run.data.params["n_params"] == str(model.num_params())
    assert run.data.params["n_params_non_embedding"] == str(model.num_params(non_embedding=True))
    assert "resumed_from_step" not in run.data.tags
    assert "None" not in run.data.tags.values()
    seen = client.get_metric_history(run.info.run_id, "tokens_seen")
    assert [(m.step, m.value) for m in seen] == [(s, s * 8 * 32.0) for s in (1, 2, 3)]
    times = client.get_metric_history(run.info.run_id, "step_time_s")
    assert len(times) == 3 and all(0 < m.value < 60 for m in times)


@contextlib.contextmanager
def mlflow_server(store: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """A real `mlflow server` on a free loopback port, with a sqlite backend in `store`."""
    port = free_port()
    store.mkdir(parents=True, exist_ok=True)
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}",
         "--artifacts-destination", str(store / "artifacts")],
        env=cli_env(), stdout=subprocess.DEVNULL, stderr=open(store / "server.log", "w"),
        start_new_session=True)  # its own process group: uvicorn runs in a child
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 150
        while True:
            assert server.poll() is None, (store / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "mlflow server did not start"
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            time.sleep(0.5)
        yield uri, server
    finally:
        stop_server(server)


def stop_server(server: subprocess.Popen) -> None:
    """Kill the server and its workers at once, as a crashed host would."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)
    server.wait(timeout=30)


@pytest.mark.timeout(300)
def test_writes_failing_mid_run_warn_once_and_are_counted(tmp_path, caplog):
    from mlflow.tracking import MlflowClient

    with mlflow_server(tmp_path / "server") as (uri, server):
        cfg = load_config(None, [f"tracking.uri={uri}", "run.name=server-dies"])
        with caplog.at_level(logging.WARNING, logger="pretrain.tracking"):
            tracker = Tracker(cfg, tmp_path / "run")
            for step in (1, 2, 3):
                tracker.log_metrics({"loss": 5.0 - step}, step=step)
            assert caplog.records == []
            stop_server(server)  # the tracking server dies mid-run
            start = time.monotonic()
            for step in range(4, 11):
                tracker.log_metrics({"loss": 5.0 - step}, step=step)
            tracker.set_tags({"layout": "tp1-pp1-dp1"})
            tracker.finish()
            elapsed = time.monotonic() - start
    failed = [r.getMessage() for r in caplog.records if "failed (" in r.getMessage()]
    assert len(failed) == 1 and "MLflow log_metrics failed" in failed[0], caplog.text
    assert caplog.records[-1].getMessage() == (
        "warning: 9 MLflow writes failed; metrics.jsonl has everything")
    assert len(caplog.records) == 2
    assert elapsed < 30, f"a dead server stalled training for {elapsed:.0f}s"
    client = MlflowClient(f"sqlite:///{tmp_path / 'server' / 'mlflow.db'}")
    history = client.get_metric_history(tracker.run_id, "loss")
    assert sorted(m.step for m in history) == [1, 2, 3]
