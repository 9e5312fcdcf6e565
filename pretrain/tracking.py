"""Run tracking: the metrics.jsonl log, the MLflow run, and the loss-curve plot.

metrics.jsonl is the authoritative per-run log (one JSON object per line, written by global
rank 0); on resume it is cut back to the checkpoint's step. MLflow mirrors it: params once
per run, metrics, tags, artifacts; a resumed job continues the same MLflow run (its id is
kept in the checkpoint meta). MLflow is imported lazily: it costs seconds.

MLflow is a mirror, so it fails fast and quietly: every request is bounded (HTTP_BOUNDS), a
store that cannot be reached at start-up stops the run with exit status 2 (or, with
tracking.required=false, costs one warning), and a write that fails later warns once and is
counted at the end.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pretrain.config import Config, ConfigError, flat_params
from pretrain.run_files import AppendLog, write_atomic

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
    """Appends one JSON object per line to `path`; on resume, cut back to `resume_step`.
    Every write is whole or nothing (pretrain/run_files.py): RunFileError if it fails."""

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
        write_atomic(self.path, "".join(line + "\n" for line in kept))
        self._file = AppendLog(self.path)

    def log(self, record: dict[str, Any]) -> None:
        """Write `record` as one JSON line."""
        self._file.append(json.dumps(record, default=_json_default))

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


# MLflow's own defaults retry a failed HTTP request 7 times with back-off up to 120 s: an
# unreachable server is reported after about 265 s. These bound every request the Tracker
# makes to 3 attempts of at most 5 s each (about 20 s in all), so a server that is down
# fails the run at start-up, and one that dies mid-run costs seconds, not minutes.
HTTP_BOUNDS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
# After a failed write to a tracking server, later writes are skipped (and counted) for this
# long instead of each waiting out the bounds above: a dead server must not stall training.
RETRY_AFTER_FAILURE_S = 60.0
# The most metrics one MLflow log_batch request may carry (MLflow's limit).
MAX_METRICS_PER_REQUEST = 1000
# The launcher (slurm/launch.py) hands a sweep run's tags to training in this variable, a
# JSON object; the Tracker sets them when it creates the MLflow run.
RUN_TAGS_ENV = "DENSEFORMER_MLFLOW_TAGS"


class _NoRetryChatter(logging.Filter):
    """Drops urllib3's "Retrying (...) after connection broken" lines: one failed MLflow
    call would print one per attempt; the Tracker says once what failed."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Retrying (")


_NO_RETRY_CHATTER = _NoRetryChatter()


@contextlib.contextmanager
def bounded_http_requests() -> Iterator[None]:
    """Apply HTTP_BOUNDS to the MLflow calls inside; a variable the user set wins.

    MLflow reads these variables at each request, and offers no per-client setting, so they
    are set in os.environ for the duration of the block only and removed after it: nothing
    else in the process (or started by it later) sees them."""
    added = [name for name in HTTP_BOUNDS if name not in os.environ]
    for name in added:
        os.environ[name] = HTTP_BOUNDS[name]
    urllib3_log = logging.getLogger("urllib3.connectionpool")
    urllib3_log.addFilter(_NO_RETRY_CHATTER)
    try:
        yield
    finally:
        urllib3_log.removeFilter(_NO_RETRY_CHATTER)
        for name in added:
            os.environ.pop(name, None)


def mlflow_client(uri: str):
    """An MlflowClient for `uri`, without MLflow's INFO lines ("Creating initial MLflow
    database tables", alembic's migrations) unless MLFLOW_LOGGING_LEVEL asks for them."""
    # deferred: pulls in MLflow (slow to start, or optional)
    from mlflow.tracking import MlflowClient

    # The first `import mlflow` sets the "mlflow" logger to INFO with its own handler
    # (mlflow.utils.logging_utils._configure_mlflow_loggers), overriding any level set before
    # the import; so the level is set here, after it. MLflow already keeps alembic at WARNING.
    if not os.environ.get("MLFLOW_LOGGING_LEVEL"):
        logging.getLogger("mlflow").setLevel(logging.WARNING)
    return MlflowClient(tracking_uri=uri)


def ensure_experiment(client: Any, uri: str, name: str,
                      tags: Mapping[str, str] | None = None) -> str:
    """The id of MLflow experiment `name` in the store `uri`, created (with `tags`) if
    missing. With a sqlite store its artifacts go next to the database, not into ./mlruns of
    whatever directory the process runs in."""
    # deferred: pulls in MLflow (slow to start, or optional)
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    artifact_location = None
    if uri.startswith("sqlite:///"):
        db = Path(uri.removeprefix("sqlite:///")).resolve()
        artifact_location = (db.parent / "mlartifacts").as_uri()
    try:
        return client.create_experiment(name, artifact_location=artifact_location,
                                        tags=dict(tags) if tags else None)
    except MlflowException:  # created meanwhile by another process (a job array's task)
        return client.get_experiment_by_name(name).experiment_id


def run_tags_from_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The run tags in $DENSEFORMER_MLFLOW_TAGS (a JSON object), {} when it is unset."""
    text = (os.environ if environ is None else environ).get(RUN_TAGS_ENV, "")
    if not text:
        return {}
    try:
        tags = json.loads(text)
    except ValueError as err:
        raise ConfigError("tracking", f"${RUN_TAGS_ENV} is not valid JSON ({err}): "
                          f"{text[:200]!r}") from None
    if not isinstance(tags, dict):
        raise ConfigError("tracking", f"${RUN_TAGS_ENV} must be a JSON object of tags, got "
                          f"{text[:200]!r}")
    return {str(k): str(v) for k, v in tags.items()}


def _is_remote(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def _reason(err: BaseException) -> str:
    """Why an MLflow call failed, in a few words (MLflow's messages run to a paragraph)."""
    text = str(err)
    lowered = text.lower()
    if "refused" in lowered:
        return "connection refused"
    if "timed out" in lowered or "timeout" in lowered:
        timeout = os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT",
                                 HTTP_BOUNDS["MLFLOW_HTTP_REQUEST_TIMEOUT"])
        return f"no answer within {timeout} s"
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(err).__name__}: {first[:300]}"


class Tracker:
    """One MLflow run: created, or continued when `run_id` is given; no-op when disabled.

    A store that cannot be used at start-up is a ConfigError naming tracking.uri (exit 2),
    or, with tracking.required=false, one warning and no MLflow for this run. A failed write
    later warns once; finish() reports how many failed. metrics.jsonl has every record."""

    def __init__(self, cfg: Config, run_dir: str | Path, run_id: str | None = None,
                 enabled: bool = True, tags: Mapping[str, Any] | None = None):
        """Open the store, get or create the experiment, start or continue the run.

        `tags`: set on the run when it is created (and again on resume); None takes them
        from $DENSEFORMER_MLFLOW_TAGS, which the Slurm launcher sets for sweep runs."""
        self.enabled = enabled and cfg.tracking.enabled
        self.run_id: str | None = run_id
        self._finished = False
        self.failed_writes = 0
        self._skip_until = 0.0
        if not self.enabled:
            return
        run_tags = run_tags_from_env() if tags is None else {k: str(v)
                                                             for k, v in tags.items()}
        self.uri = cfg.tracking.uri or default_tracking_uri(run_dir)
        self.run_name = Path(run_dir).name  # the directory, where run.name only names new ones
        started = time.monotonic()
        try:
            with bounded_http_requests():
                _create_with_umask(self.uri)
                self._client = mlflow_client(self.uri)
                self._open(cfg, run_tags)
        except Exception as err:
            if isinstance(err, _RunNotFound):
                problem = str(err)
            else:
                problem = (f"cannot reach the MLflow tracking store {self.uri} "
                           f"({_reason(err)}; gave up after "
                           f"{time.monotonic() - started:.0f} s)")
            if cfg.tracking.required:
                raise ConfigError("tracking.uri", f"{problem}: start the server or fix "
                                  "tracking.uri, or set tracking.required=false to train "
                                  "with metrics.jsonl only") from None
            log.warning("warning: %s; training continues without MLflow "
                        "(tracking.required=false): metrics.jsonl has every record", problem)
            self.enabled = False

    def _open(self, cfg: Config, run_tags: dict[str, str]) -> None:
        # deferred: pulls in MLflow (slow to start, or optional)
        from mlflow.entities import Param, RunTag
        from mlflow.exceptions import MlflowException

        if self.run_id is None:
            experiment_id = ensure_experiment(self._client, self.uri, cfg.tracking.experiment)
            commit = git_commit()
            tags = {"git_commit": commit, "mlflow.source.git.commit": commit,
                    "host": socket.gethostname(), **run_tags}
            run = self._client.create_run(experiment_id, run_name=self.run_name, tags=tags)
            self.run_id = run.info.run_id
            params = [Param(k, str(v)) for k, v in flat_params(cfg).items()]
            self._client.log_batch(self.run_id, params=params)
            return
        try:
            run = self._client.get_run(self.run_id)
        except MlflowException as err:
            if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            raise _RunNotFound(f"MLflow run {self.run_id} (named in the checkpoint) not "
                               f"found in {self.uri}") from None
        self._client.update_run(self.run_id, status="RUNNING")
        resumes = int(run.data.tags.get("resume_count", "0")) + 1
        tags = {**run_tags, "resume_count": str(resumes)}
        self._client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])

    def _guard(self, what: str, fn: Any, *args: Any, always: bool = False) -> None:
        """Run an MLflow write; a failure warns (the first time) instead of killing a long
        training run, and is counted."""
        if not always and time.monotonic() < self._skip_until:
            self.failed_writes += 1  # the server failed moments ago: don't wait on it again
            return
        try:
            with bounded_http_requests():
                fn(*args)
        except Exception as err:
            self.failed_writes += 1
            if _is_remote(self.uri):
                self._skip_until = time.monotonic() + RETRY_AFTER_FAILURE_S
            if self.failed_writes == 1:
                log.warning("warning: MLflow %s failed (%s); training continues, metrics.jsonl "
                            "has every record; later failures are only counted", what,
                            _reason(err))

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        """Log the numeric values of `metrics` at `step` (others are skipped)."""
        self.log_rows([{**metrics, "step": step}])

    def log_rows(self, rows: list[dict[str, Any]]) -> None:
        """Log the numeric values of each row (but "step") at the row's "step", in as few
        requests as MLflow takes (the training loop's rows of a fetch point at once)."""
        if not self.enabled:
            return
        # deferred: pulls in MLflow (slow to start, or optional)
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, row["step"]) for row in rows
                 for k, v in ((k, _as_metric(v)) for k, v in row.items() if k != "step")
                 if v is not None]
        for start in range(0, len(batch), MAX_METRICS_PER_REQUEST):
            self._guard("log_metrics", self._client.log_batch, self.run_id,
                        batch[start: start + MAX_METRICS_PER_REQUEST])

    def log_params(self, params: dict[str, Any]) -> None:
        """Log run params (values as strings) beyond the config's, e.g. the MFU peak; a None
        value is no param."""
        if not self.enabled:
            return
        # deferred: pulls in MLflow (slow to start, or optional)
        from mlflow.entities import Param

        batch = [Param(k, str(v)) for k, v in params.items() if v is not None]
        self._guard("log_params", self._client.log_batch, self.run_id, (), batch)

    def set_tags(self, tags: dict[str, Any]) -> None:
        """Set run tags (values as strings), e.g. {"layout": "tp1-pp1-dp1"}; a None value
        is no tag (not the string 'None')."""
        if not self.enabled:
            return
        # deferred: pulls in MLflow (slow to start, or optional)
        from mlflow.entities import RunTag

        batch = [RunTag(k, str(v)) for k, v in tags.items() if v is not None]
        self._guard("set_tags", self._client.log_batch, self.run_id, (), (), batch)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file (or directory) to the run's artifacts."""
        if not self.enabled:
            return
        self._guard("log_artifact", self._client.log_artifact, self.run_id, str(path),
                    artifact_path)

    def finish(self, status: str = "FINISHED") -> None:
        """End the run with FINISHED, FAILED or KILLED (once; later calls do nothing), and
        say how many MLflow writes failed, if any."""
        if status not in RUN_STATUSES:
            raise ValueError(f"status must be one of {RUN_STATUSES}, got {status!r}")
        if not self.enabled or self._finished:
            return
        self._finished = True
        self._guard("finish", self._client.set_terminated, self.run_id, status, always=True)
        if self.failed_writes:
            log.warning("warning: %d MLflow writes failed; metrics.jsonl has everything",
                        self.failed_writes)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: type | None, *rest: object) -> None:
        if exc_type is None:
            self.finish("FINISHED")
        else:
            self.finish("KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")


def _create_with_umask(uri: str) -> None:
    """Create a sqlite store's file as a plain open would (0o666 less the umask), before
    sqlite does: it creates files 0o644 whatever the umask, which keeps a group on a shared
    cluster from writing the run's MLflow store (its journals take the file's mode)."""
    if not uri.startswith("sqlite:///"):
        return
    path = Path(uri.removeprefix("sqlite:///"))
    if path.parent.is_dir() and not path.exists():
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o666))


class _RunNotFound(RuntimeError):
    """The MLflow run a resumed job continues is not in the store."""


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
    # deferred: pulls in matplotlib (slow to start, or optional)
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
