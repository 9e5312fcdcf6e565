"""Run tracking: the metrics.jsonl log, the MLflow run, and the loss-curve plot.

metrics.jsonl is the authoritative per-run log (one JSON object per line, written by global
rank 0); on resume it is cut back to the checkpoint's step. MLflow mirrors it: params once
per run, metrics, tags, artifacts; a resumed job continues the same MLflow run (its id is
kept in the checkpoint meta). MLflow is imported lazily: it costs seconds.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from pretrain.config import Config, flat_params

log = logging.getLogger(__name__)

RUN_STATUSES = ("FINISHED", "FAILED", "KILLED")


def _json_default(value: Any) -> Any:
    """Tensors and numpy scalars as Python numbers; anything else as its str."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


class MetricsLog:
    """Appends one JSON object per line to `path`; on resume, cut back to `resume_step`."""

    def __init__(self, path: str | Path, resume_step: int | None):
        """Start a new log (resume_step None) or keep the records with step <= resume_step."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step is not None and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # the torn last line of a killed job
                if isinstance(record, dict) and record.get("step", 0) <= resume_step:
                    kept.append(line)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            f.writelines(line + "\n" for line in kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._file = open(self.path, "a")

    def log(self, record: dict[str, Any]) -> None:
        """Write `record` as one JSON line and flush it."""
        self._file.write(json.dumps(record, default=_json_default) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file, skipping unparsable lines."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def git_commit(cwd: str | Path | None = None) -> str:
    """`git rev-parse HEAD` of the code (or of `cwd`), "unknown" outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd or Path(__file__).parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def default_tracking_uri(run_dir: str | Path) -> str:
    """sqlite:///<absolute run_dir>/mlflow.db (four slashes in all for an absolute path)."""
    return f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"


def _quiet_mlflow() -> None:
    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)


class Tracker:
    """One MLflow run: created, or continued when `run_id` is given; no-op when disabled."""

    def __init__(self, cfg: Config, run_dir: str | Path, run_id: str | None = None,
                 enabled: bool = True):
        """Open the store, get or create the experiment, start or continue the run."""
        self.enabled = enabled and cfg.tracking.enabled
        self.run_id: str | None = run_id
        self._finished = False
        self._warned = 0
        if not self.enabled:
            return
        _quiet_mlflow()
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.uri = cfg.tracking.uri or default_tracking_uri(run_dir)
        self._client = MlflowClient(tracking_uri=self.uri)
        if run_id is None:
            experiment_id = self._experiment_id(cfg.tracking.experiment)
            tags = {"git_commit": git_commit(), "mlflow.source.git.commit": git_commit(),
                    "host": socket.gethostname()}
            run = self._client.create_run(experiment_id, run_name=cfg.run.name, tags=tags)
            self.run_id = run.info.run_id
            params = [Param(k, str(v)) for k, v in flat_params(cfg).items()]
            self._client.log_batch(self.run_id, params=params)
        else:
            from mlflow.exceptions import MlflowException

            try:
                run = self._client.get_run(run_id)
            except MlflowException as err:
                raise RuntimeError(f"MLflow run {run_id} not found in {self.uri}: {err}") from None
            self._client.update_run(run_id, status="RUNNING")
            resumes = int(run.data.tags.get("resume_count", "0")) + 1
            self._client.set_tag(run_id, "resume_count", str(resumes))

    def _experiment_id(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        experiment = self._client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        artifact_location = None
        if self.uri.startswith("sqlite:///"):
            # Next to the database, not in ./mlruns of whatever directory we run from.
            db = Path(self.uri.removeprefix("sqlite:///")).resolve()
            artifact_location = (db.parent / "mlartifacts").as_uri()
        try:
            return self._client.create_experiment(name, artifact_location=artifact_location)
        except MlflowException:  # created meanwhile by another job of the array
            return self._client.get_experiment_by_name(name).experiment_id

    def _guard(self, what: str, fn: Any, *args: Any) -> None:
        """Run an MLflow call; a failure warns instead of killing a long training run."""
        try:
            fn(*args)
        except Exception as err:
            self._warned += 1
            if self._warned <= 5:
                log.warning("MLflow %s failed (%s: %s); training continues",
                            what, type(err).__name__, err)

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        """Log the numeric values of `metrics` at `step` (others are skipped)."""
        if not self.enabled:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        values = {k: _as_metric(v) for k, v in metrics.items()}
        batch = [Metric(k, v, now, step) for k, v in values.items() if v is not None]
        if batch:
            self._guard("log_metrics", self._client.log_batch, self.run_id, batch)

    def set_tags(self, tags: dict[str, Any]) -> None:
        """Set run tags (values as strings), e.g. {"layout": "tp1-pp1-dp1"}."""
        if not self.enabled:
            return
        from mlflow.entities import RunTag

        batch = [RunTag(k, str(v)) for k, v in tags.items()]
        self._guard("set_tags", self._client.log_batch, self.run_id, (), (), batch)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file (or directory) to the run's artifacts."""
        if not self.enabled:
            return
        self._guard("log_artifact", self._client.log_artifact, self.run_id, str(path),
                    artifact_path)

    def finish(self, status: str = "FINISHED") -> None:
        """End the run with FINISHED, FAILED or KILLED (once; later calls do nothing)."""
        if status not in RUN_STATUSES:
            raise ValueError(f"status must be one of {RUN_STATUSES}, got {status!r}")
        if not self.enabled or self._finished:
            return
        self._finished = True
        self._guard("finish", self._client.set_terminated, self.run_id, status)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: type | None, *rest: object) -> None:
        if exc_type is None:
            self.finish("FINISHED")
        else:
            self.finish("KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")


def _as_metric(value: Any) -> float | None:
    """A number (or 0-d tensor / numpy scalar) as a float; None for anything else, bools too."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return _as_metric(value.item())
    return None


def plot_loss_curve(metrics_jsonl: str | Path, out_png: str | Path, train_key: str = "loss",
                    val_key: str = "val_loss", title: str | None = None) -> Path:
    """Plot train loss (line) and validation loss (points) against step into a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_metrics(metrics_jsonl)

    def points(key: str) -> list[tuple[float, float]]:
        # A null loss (non-finite step) becomes NaN: a gap in the line.
        return [(r["step"], math.nan if r[key] is None else r[key])
                for r in records if "step" in r and key in r]

    train, val = points(train_key), points(val_key)
    fig = Figure(figsize=(7, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train, strict=True), lw=1, label=f"train ({train_key})")
    if val:
        ax.plot(*zip(*val, strict=True), "o-", ms=4, label=f"validation ({val_key})")
    if not train and not val:
        ax.text(0.5, 0.5, "no loss records yet", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if train or val:
        ax.legend()
    ax.set_title(title or Path(metrics_jsonl).parent.name)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    return out_png
