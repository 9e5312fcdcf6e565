"""A sweep's matched-FLOPs arm: every architecture trained on the baseline's training FLOPs.

    match_flops: transformer        # top-level key of a sweep file: the baseline architecture

The runs of the grid form the *params* arm: one shape and one token budget D for every
architecture, so their parameter counts N differ only by the connections' own parameters.
The *flops* arm gives each run r of another architecture a twin with the baseline's FLOPs:
with f = `DenseFormerConfig.flops_per_token()` (training FLOPs per token, the connection's
own cost included) and b the baseline run of the same shape, seed, learning rate, warm-up
and D,

    D_r' = F_b / f_r,     F_b = f_b * D_b,

rounded to whole steps like every budget (slurm/sweep_spec.py), so that |f_r D_r' - F_b| is
at most half a step's FLOPs, f_r * batch * seq_len / 2. When the rounding gives r's own
steps, r is the twin (tagged arms=params,flops, trained once); so are the baseline's runs.
A twin is named `<sweep>-<architecture>-flops-...` (its D may differ from r's below the
3 digits a run name shows).
Every run carries the tag `arms` ("params", "flops" or "params,flops"), which the report's
matched-budget section reads (slurm/report_arms.py).
"""

from __future__ import annotations

from typing import Any

from slurm.sweep_axes import Architecture
from slurm.sweep_errors import SweepError

ARMS_TAG = "arms"


def matched_tokens(baseline_flops: float, flops_per_token: float) -> float:
    """The tokens D' with D' * flops_per_token = baseline_flops (before rounding to steps)."""
    if not (baseline_flops > 0 and flops_per_token > 0):
        raise SweepError(f"match_flops: FLOPs must be positive, got {baseline_flops!r} and "
                         f"{flops_per_token!r} per token")
    return baseline_flops / flops_per_token


def _key(run) -> tuple:
    """What a run shares with its baseline: shape, seed, lr, warm-up and tokens."""
    return (tuple(sorted(run.shape.items())), run.config.train.seed, run.values.get("lr"),
            run.values.get("warmup"), run.tokens)


def flops_matched_runs(baseline: Any, runs: list, archs: list[Architecture], context,
                       has_tokens: bool) -> list:
    """Tag the grid's `runs` with their arms and return the flops arm's new runs (RunSpecs
    indexed after `runs`). `archs`: the grid's architectures; `context`: the RunContext."""
    names = [a.name for a in archs]
    if not isinstance(baseline, str) or baseline not in names:
        raise SweepError(f"match_flops: {baseline!r} must name an architecture of the grid "
                         f"({', '.join(names)})")
    if not has_tokens:
        raise SweepError("match_flops: needs grid.tokens, so that the params arm trains every "
                         "architecture on the same tokens (not tokens_per_param or compute)")
    budgets = {_key(r): r.model_flops for r in runs if r.architecture == baseline}
    by_name = {a.name: a for a in archs}
    added = []
    for run in runs:
        run.stage_tags[ARMS_TAG] = "params"
        if run.architecture == baseline:
            run.stage_tags[ARMS_TAG] = "params,flops"
            continue
        if _key(run) not in budgets:
            raise SweepError(f"match_flops: run {run.name} has no {baseline} run with its "
                             "shape, seed, lr, warm-up and tokens (does its architecture set "
                             "its own train.batch_size or lr grid?)")
        target = matched_tokens(budgets[_key(run)], run.model_flops / run.tokens)
        cfg, model, vocab = context.resolve(by_name[run.architecture], run.shape,
                                            run.values.get("lr"),
                                            f"{run.architecture} {run.shape} (match_flops)")
        axes = {k: run.values[k] for k in ("lr", "warmup") if k in run.values}
        twin = context.finish(len(runs) + len(added),
                              f"{context.name}-{run.architecture}-flops", run.architecture,
                              cfg, model, vocab, target, run.config.train.seed, axes,
                              run.shape)
        if twin.config.train.steps == run.config.train.steps:
            run.stage_tags[ARMS_TAG] = "params,flops"
        else:
            twin.stage_tags[ARMS_TAG] = "flops"
            added.append(twin)
    return added
