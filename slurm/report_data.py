"""What `python -m slurm report` reads: every run of a study's MLflow experiment, and the
sweep manifest (the experiment's `sweep_manifest` tag) to name runs that never started.

One StudyRun per MLflow run (the `scaling-fit` runs of `slurm fit` left out): its status,
tags, params, last value of each metric, the median training speed, its resolved config
(the `config.yaml` artifact) and its last DWA heatmap (the newest `dwa/step-*.png`).
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm.fit import FIT_KIND

SPEED_METRICS = ("tokens_per_s", "mfu")
WARMUP_STEPS_SKIPPED = 2  # the first steps include start-up work: left out of the speed


class ReportError(ValueError):
    """No such experiment or store, or nothing in it (exit status 2)."""


@dataclass
class StudyRun:
    run_id: str
    name: str
    status: str
    tags: dict[str, str]
    params: dict[str, str]
    metrics: dict[str, float]  # the last value of each metric
    speed: dict[str, float] = field(default_factory=dict)  # medians over the steps (_speed)
    config_text: str | None = None
    dwa_png: bytes | None = None
    dwa_name: str | None = None

    @property
    def architecture(self) -> str:
        return self.tags.get("architecture", "?")

    @property
    def loss(self) -> float | None:
        """The final validation loss, for a finished run only."""
        value = self.metrics.get("val_loss")
        ok = self.status == "FINISHED" and value is not None and math.isfinite(value)
        return value if ok else None

    def grid(self, key: str) -> str | None:
        return self.tags.get(f"grid.{key}")


@dataclass
class Study:
    experiment: str
    tracking_uri: str
    runs: list[StudyRun]
    never_started: list[str]  # manifest runs without an MLflow run
    manifest: dict[str, Any] | None
    logs: dict[str, str] = field(default_factory=dict)  # failed run -> its log's last line


LOG_PREFIXES = (re.compile(r"\[train\.sbatch [^\]]*\] "), re.compile(r"launcher: error: "))


def last_log_line(sweep_dir: Path, index: int) -> str | None:
    """The last line of the newest Slurm log of manifest run `index`
    (<sweep dir>/logs/<sweep>-<job>_<index>.out), naming the log; None without one. A failed
    task ends its log with its one-line cause (slurm/train.sbatch, slurm/launch.py)."""
    logs = sorted((sweep_dir / "logs").glob(f"*_{index}.out"), key=lambda p: p.stat().st_mtime)
    for log in reversed(logs):
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines()
                 if line.strip()]
        if lines:
            line = lines[-1]
            for prefix in LOG_PREFIXES:
                line = prefix.sub("", line, count=1)
            return f"{line} ({log})"
    return None


def _history(client, run_id: str, key: str) -> dict[int, float]:
    """{step: value} of a metric, the first steps (start-up work) left out."""
    return {m.step: m.value for m in client.get_metric_history(run_id, key)
            if m.step > WARMUP_STEPS_SKIPPED and math.isfinite(m.value)}


def _speed(client, run_id: str, metrics: dict, params: dict) -> dict[str, float]:
    """Medians over the steps: tokens/s, the run's own MFU and its peak, and the model
    FLOP/s per device it achieved (its MFU times the peak it was measured against, step by
    step), from which the report takes MFU against one peak for the whole study
    (slurm/report_mfu.py)."""
    speed, histories = {}, {}
    for key in (*SPEED_METRICS, "mfu_peak_flops"):
        if key in metrics:
            histories[key] = _history(client, run_id, key)
            if histories[key]:
                speed[key] = statistics.median(histories[key].values())
    mfu = histories.get("mfu", {})
    peaks = histories.get("mfu_peak_flops") or {
        step: float(params["mfu_peak_flops"]) for step in mfu if "mfu_peak_flops" in params}
    achieved = [mfu[step] * peaks[step] for step in mfu if step in peaks]
    if achieved:
        speed["flops_per_device"] = statistics.median(achieved)
    return speed


def _artifact(client, run_id: str, path: str, tmp: Path) -> bytes | None:
    try:
        return Path(client.download_artifacts(run_id, path, str(tmp))).read_bytes()
    except Exception:  # noqa: BLE001 (a missing artifact, an unreachable artifact store)
        return None


def _read_run(client, run, tmp: Path) -> StudyRun:
    data, run_id = run.data, run.info.run_id
    study_run = StudyRun(run_id=run_id, name=data.tags.get("mlflow.runName", run_id),
                         status=run.info.status, tags=dict(data.tags),
                         params=dict(data.params), metrics=dict(data.metrics))
    study_run.speed = _speed(client, run_id, data.metrics, data.params)
    text = _artifact(client, run_id, "config.yaml", tmp / run_id)
    study_run.config_text = text.decode() if text is not None else None
    try:
        heatmaps = sorted(a.path for a in client.list_artifacts(run_id, "dwa")
                          if a.path.endswith(".png"))
    except Exception:  # noqa: BLE001
        heatmaps = []
    if heatmaps:
        study_run.dwa_name = heatmaps[-1]
        study_run.dwa_png = _artifact(client, run_id, heatmaps[-1], tmp / run_id)
    return study_run


def load_study(client, experiment: str, uri: str, sweep: str | None = None) -> Study:
    """Every run of `experiment` (only those tagged sweep_id=`sweep` if given)."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one per file
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise ReportError(f"--experiment: no experiment named {experiment!r} in {uri}")
    runs, token = [], None
    with tempfile.TemporaryDirectory() as tmp:
        while True:
            page = client.search_runs([found.experiment_id], max_results=1000,
                                      page_token=token, order_by=["attributes.start_time ASC"])
            for run in page:
                if run.data.tags.get("kind") == FIT_KIND:
                    continue
                if sweep and run.data.tags.get("sweep_id") != sweep:
                    continue
                runs.append(_read_run(client, run, Path(tmp)))
            token = page.token
            if not token:
                break
    manifest = None
    path = found.tags.get("sweep_manifest")
    if path and Path(path).is_file():
        manifest = json.loads(Path(path).read_text())
    seen = {r.name for r in runs}
    never = [entry for entry in (manifest or {}).get("runs", []) if entry["name"] not in seen]
    if not runs and not never:
        raise ReportError(f"experiment {experiment!r} in {uri} holds no runs")
    logs = {}
    unfinished = {r.name for r in runs if r.loss is None and "exit_cause" not in r.tags}
    for entry in (manifest or {}).get("runs", []):
        if entry["name"] in unfinished or entry["name"] not in seen:
            line = last_log_line(Path(path).parent, entry.get("index", -1))
            if line:
                logs[entry["name"]] = line
    return Study(experiment, uri, runs, [e["name"] for e in never], manifest, logs)
