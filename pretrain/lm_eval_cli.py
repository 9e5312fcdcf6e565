"""`python -m pretrain lm-eval [lm-eval options]`: downstream tasks through lm-evaluation-harness.

    python -m pretrain lm-eval --model_args checkpoint=runs/tiny --tasks hellaswag,piqa

Registers `DenseFormerLM` as lm-eval's model `denseformer` (`--model denseformer` is added
unless given), then runs lm-eval's own command line with every option as given. Afterwards each
score is logged to the checkpoint's MLflow run as `lm_eval/<task>/<metric>` at the
checkpoint's step. lm-eval is the optional extra `eval` (pip install -e ".[eval]"); see
docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from pretrain import checkpoint
from pretrain.config import ConfigError, load_config
from pretrain.lm_eval_compat import captured_results
from pretrain.tracking import bounded_http_requests, default_tracking_uri, mlflow_client

SUBCOMMANDS = ("run", "ls", "validate")  # lm-eval's own; anything else is `run`'s options


def add_parser(subparsers) -> None:
    """The `lm-eval` subcommand: every argument after it goes to lm-eval untouched."""
    # No option of ours: prefix_chars "\0" makes argparse take "--tasks" etc. as plain words.
    parser = subparsers.add_parser(
        "lm-eval", add_help=False, prefix_chars="\0",
        help="run lm-evaluation-harness tasks on a checkpoint (`lm-eval -h`: its options)")
    parser.add_argument("lm_eval_args", nargs=argparse.REMAINDER)


def cmd_lm_eval(args: argparse.Namespace) -> int:
    """Run lm-eval's command line on our model class; log the scores to MLflow."""
    try:
        # deferred: pulls in lm-eval (slow to start, or optional)
        import lm_eval.__main__ as lm_eval_main
    except ImportError as error:
        raise ConfigError("lm-eval", f"lm-evaluation-harness is not installed ({error}): "
                          'pip install -e ".[eval]"') from None
    # deferred: pulls in lm-eval, torch (slow to start, or optional)
    from pretrain import lm_eval_adapter  # noqa: F401  (registers `denseformer`)

    argv = lm_eval_argv(args.lm_eval_args)
    saved_argv = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        with captured_results() as results:
            lm_eval_main.cli_evaluate()
    except SystemExit as stop:  # argparse's -h and usage errors
        return stop.code if isinstance(stop.code, int) else 1
    finally:
        sys.argv = saved_argv
    for result in results:
        log_scores(result)
    return 0


def lm_eval_argv(args: list[str]) -> list[str]:
    """lm-eval's argv: `run` unless another of its subcommands is named, and
    `--model denseformer` unless a model is named."""
    if args and args[0] in SUBCOMMANDS:
        return list(args)
    if not args or args[0] in ("-h", "--help"):
        return ["run", *args] if args else ["run", "-h"]
    named = any(a == "--model" or a.startswith("--model=") for a in args)
    return ["run", *([] if named else ["--model", "denseformer"]), *args]


def numeric_scores(results: dict) -> Iterator[tuple[str, str, float]]:
    """(task, metric, value) of every number in an lm-eval results dict; lm-eval keys them
    "metric,filter": the filter "none" is dropped, another becomes `metric.filter`."""
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue  # "alias", and stderr "N/A"
            metric, filter_name = key.split(",", 1)
            yield task, metric if filter_name == "none" else f"{metric}.{filter_name}", \
                float(value)


def log_scores(results: dict) -> str | None:
    """Log `results` to the MLflow run of the checkpoint lm-eval evaluated, as
    lm_eval/<task>/<metric> at its step; the run id, or None (said why) when there is none."""
    model_args = results.get("config", {}).get("model_args") or {}
    if isinstance(model_args, str):
        # deferred: pulls in lm-eval (slow to start, or optional)
        from lm_eval.utils import simple_parse_args_string

        model_args = simple_parse_args_string(model_args)
    if results.get("config", {}).get("model") != "denseformer" or "checkpoint" not in model_args:
        return None
    found = checkpoint_run(Path(str(model_args["checkpoint"])))
    if isinstance(found, str):
        print(f"lm-eval scores not logged to MLflow: {found}", file=sys.stderr)
        return None
    uri, run_id, step = found
    metrics = {f"lm_eval/{task}/{metric}": value
               for task, metric, value in numeric_scores(results)}
    _log_metrics(uri, run_id, metrics, step)
    print(f"logged {len(metrics)} lm-eval scores to MLflow run {run_id} ({uri}) at step "
          f"{step}", file=sys.stderr)
    return run_id


def checkpoint_run(path: Path) -> tuple[str, str, int] | str:
    """(tracking URI, MLflow run id, step) of the checkpoint `path` names (a run directory
    stands for its newest complete checkpoint), or the reason there is none."""
    if (path / checkpoint.MANIFEST).is_file():
        step_dir = path
    elif (path / "checkpoints").is_dir():
        step_dir = checkpoint.newest_intact(path / "checkpoints")
        if step_dir is None:
            return f"{path} holds no complete checkpoint"
    else:
        return f"{path} is not a checkpoint of a run (an exported directory has no MLflow run)"
    meta = checkpoint.read_meta(step_dir, verify_hashes=False)
    run_dir = step_dir.resolve().parent.parent
    cfg = load_config(run_dir / "config.yaml", [f"run.dir={run_dir}"], check=False)
    if not cfg.tracking.enabled or not meta.get("mlflow_run_id"):
        return f"the run {run_dir} was trained without MLflow tracking"
    return (cfg.tracking.uri or default_tracking_uri(run_dir), meta["mlflow_run_id"],
            int(meta["step"]))


def _log_metrics(uri: str, run_id: str, metrics: dict[str, float], step: int) -> None:
    # deferred: pulls in MLflow (slow to start, or optional)
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    with bounded_http_requests():
        mlflow_client(uri).log_batch(run_id, [Metric(k, v, now, step)
                                              for k, v in metrics.items()])
