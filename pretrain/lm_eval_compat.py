"""The one workaround lm-evaluation-harness 0.4.13 needs, each tested in tests/test_lm_eval.py.

lm-eval's command line (`lm_eval.__main__.cli_evaluate`) prints its scores and returns
nothing, so `python -m pretrain lm-eval` could not log them to MLflow. `captured_results`
records the dict `simple_evaluate` returns while the command line runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def captured_results() -> Iterator[list[dict]]:
    """A list that receives each results dict lm-eval's `simple_evaluate` returns inside
    the block (lm-eval's command line calls it once)."""
    # deferred: pulls in lm-eval (slow to start, or optional)
    import lm_eval.evaluator as evaluator

    original = evaluator.simple_evaluate
    results: list[dict] = []

    def recording(*args, **kwargs):
        result = original(*args, **kwargs)
        if result is not None:  # None on ranks other than 0
            results.append(result)
        return result

    # Patch: the command line looks the function up at each run (`from lm_eval import
    # simple_evaluate` inside Run._execute, which lm_eval.__getattr__ answers from
    # lm_eval.evaluator), so replacing the module attribute is enough; tests/test_lm_eval.py's
    # `test_cli_runs_lm_eval_and_logs_scores_to_mlflow` fails if that lookup changes (no
    # score reaches MLflow).
    evaluator.simple_evaluate = recording
    try:
        yield results
    finally:
        evaluator.simple_evaluate = original
