"""`python -m slurm fit --experiment NAME [--tracking-uri URI]`: scaling laws from a sweep.

Pulls every finished run of the experiment that carries the sweep tags (architecture, N, D,
C; set when a sweep task's training creates its run) and its final validation loss
(`val_loss`, logged at the last step); an unfinished run (killed at its time limit, failed,
still training) is reported and left out, never fitted from its last metrics. It fits per
architecture L(C) = A * C^(-alpha) and, when the grid allows, L(N, D) = E + A/N^a + B/D^b
(slurm/scaling.py), prints the coefficients with standard errors and the compute multiplier
of each architecture over the baseline (default `transformer`) at the given budgets, writes
PNG plots and fit.json into --out, and logs them to MLflow as a run named `scaling-fit` (tag
kind=scaling_fit) in the same experiment.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pretrain.tracking import bounded_http_requests, mlflow_client
from slurm.plot_ticks import label_ticks
from slurm.scaling import (
    ComputeFit,
    Multiplier,
    ParamsTokensFit,
    can_fit_params_tokens,
    compute_multiplier,
    distinct_count,
    fit_compute_law,
    fit_params_tokens,
)

FIT_KIND = "scaling_fit"
# What an L(C) fit needs: a power law through fewer budgets, or over a narrower range, says
# more than the runs do (two budgets 3% apart once gave alpha = 2.2).
MIN_BUDGETS = 3
MIN_SPAN = 4.0
# What an unfinished run's MLflow status says about its task. Its last logged metrics are
# not used: a loss from part-way through a run is not the loss of its planned D tokens.
UNFINISHED = {
    "RUNNING": "still training, or killed without warning: time limit, node failure",
    "KILLED": "stopped on a signal after a checkpoint, not yet resumed",
    "FAILED": "training failed; see its Slurm log",
    "SCHEDULED": "not started",
}


class FitError(ValueError):
    """Nothing to fit, or a bad option (exit status 2)."""


@dataclass
class Point:
    run_id: str
    name: str
    architecture: str
    n_params: float
    tokens: float
    compute: float
    loss: float


@dataclass
class ArchitectureFit:
    points: list[Point]
    compute_law: ComputeFit | None
    params_tokens: ParamsTokensFit | None
    note: str = ""


def load_points(client, experiment: str, metric: str = "val_loss",
                sweep: str | None = None) -> tuple[list[Point], list[str]]:
    """Finished, tagged runs of `experiment` as points; and why others were skipped."""
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise FitError(f"--experiment: no experiment named {experiment!r} in this store")
    points, skipped, token = [], [], None
    while True:
        page = client.search_runs([found.experiment_id], max_results=1000, page_token=token)
        for run in page:
            tags, name = run.data.tags, run.data.tags.get("mlflow.runName", run.info.run_id)
            if tags.get("kind") == FIT_KIND or (sweep and tags.get("sweep_id") != sweep):
                continue
            missing = [k for k in ("architecture", "N", "D", "C") if k not in tags]
            if missing:
                skipped.append(f"{name}: no sweep tags {missing}")
            elif run.info.status != "FINISHED":
                skipped.append(f"{name}: unfinished, status {run.info.status} "
                               f"({UNFINISHED.get(run.info.status, 'not finished')}): left "
                               "out of the fit")
            elif metric not in run.data.metrics:
                skipped.append(f"{name}: no {metric} metric")
            else:
                points.append(Point(run.info.run_id, name, tags["architecture"],
                                    float(tags["N"]), float(tags["D"]), float(tags["C"]),
                                    float(run.data.metrics[metric])))
        token = page.token
        if not token:
            break
    return points, skipped


def why_no_compute_law(compute: list[float]) -> str | None:
    """Why these compute budgets cannot carry an L(C) fit (fewer than MIN_BUDGETS distinct
    budgets, or spanning less than MIN_SPAN); None when they can."""
    budgets, span = distinct_count(compute), max(compute) / min(compute)
    if budgets >= MIN_BUDGETS and span >= MIN_SPAN:
        return None
    return (f"no L(C) fit: {budgets} distinct compute budget(s) spanning {span:.3g}x; a "
            f"law needs {MIN_BUDGETS}+ budgets spanning {MIN_SPAN:g}x or more")


def fit_architectures(points: list[Point]) -> dict[str, ArchitectureFit]:
    """Per architecture: the compute law (MIN_BUDGETS+ budgets spanning MIN_SPAN x, else a
    note saying why not) and L(N, D) if the grid allows."""
    fits = {}
    for arch in sorted({p.architecture for p in points}):
        own = [p for p in points if p.architecture == arch]
        compute = [p.compute for p in own]
        loss = [p.loss for p in own]
        law, note = None, why_no_compute_law(compute)
        if note is None:
            law, note = fit_compute_law(compute, loss), ""
        else:
            note += ". "
        nd = None
        n, d = [p.n_params for p in own], [p.tokens for p in own]
        if can_fit_params_tokens(n, d):
            nd = fit_params_tokens(n, d, loss)
        else:
            note += "L(N, D) needs 3+ distinct N, 3+ distinct D and 6+ runs."
        fits[arch] = ArchitectureFit(own, law, nd, note.strip())
    return fits


def shared_budgets(fit: ArchitectureFit, base: ArchitectureFit) -> list[float]:
    """Low end, geometric middle and high end of the compute range both laws were fitted
    on (no extrapolation); [] when the ranges do not overlap."""
    low = max(min(p.compute for p in fit.points), min(p.compute for p in base.points))
    high = min(max(p.compute for p in fit.points), max(p.compute for p in base.points))
    return [low, math.sqrt(low * high), high] if low <= high else []


def multipliers(fits: dict[str, ArchitectureFit], baseline: str,
                budgets: list[float] | None = None) -> dict[str, list[Multiplier]]:
    """Compute multipliers of every other architecture with a law over `baseline` at
    `budgets` (default: `shared_budgets` of each pair)."""
    base = fits.get(baseline)
    if base is None or base.compute_law is None:
        return {}
    return {arch: compute_multiplier(fit.compute_law, base.compute_law,
                                     budgets or shared_budgets(fit, base))
            for arch, fit in fits.items() if arch != baseline and fit.compute_law is not None
            and (budgets or shared_budgets(fit, base))}


def _pm(value: float, error: float) -> str:
    return f"{value:.4g} ± {error:.2g}" if math.isfinite(error) else f"{value:.4g}"


def format_report(fits: dict[str, ArchitectureFit], mults: dict[str, list[Multiplier]],
                  baseline: str) -> str:
    """The printed report: coefficients with standard errors, then the multipliers."""
    lines = []
    for arch, fit in fits.items():
        lines.append(f"{arch} ({len(fit.points)} runs)")
        law = fit.compute_law
        if law is not None:
            lines.append(f"  L(C) = A * C^-alpha: A = {_pm(law.a, law.a * law.log_a_err)}, "
                         f"alpha = {_pm(law.alpha, law.alpha_err)} "
                         f"(rms residual of ln L {law.rmse_log:.2g})")
        nd = fit.params_tokens
        if nd is not None:
            e = nd.errors
            lines.append(f"  L(N, D) = E + A/N^a + B/D^b: E = {_pm(nd.E, e['E'])}, "
                         f"A = {_pm(nd.A, e['A'])}, a = {_pm(nd.a, e['a'])}, "
                         f"B = {_pm(nd.B, e['B'])}, b = {_pm(nd.b, e['b'])}")
        if fit.note:
            lines.append(f"  note: {fit.note}")
    if mults:
        lines.append(f"compute multiplier over {baseline} (compute {baseline} needs for the "
                     "same loss / compute used; 68% interval):")
        for arch, values in mults.items():
            for m in values:
                interval = f" [{m.low:.3g}, {m.high:.3g}]" if math.isfinite(m.low) else ""
                lines.append(f"  {arch} at C = {m.compute:.3g}: {m.value:.3g}x{interval}")
    else:
        lines.append(f"compute multiplier: none: it needs an L(C) fit of the baseline "
                     f"{baseline!r} and of another architecture over a shared compute range")
    return "\n".join(lines)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def compute_figure(fits: dict[str, ArchitectureFit], only: str | None = None,
                   baseline: str | None = None):
    """Loss against compute (log-log): the runs, and each fitted law over the range of its
    own runs only (no extrapolation); labelled ticks on both axes."""
    # deferred: pulls in matplotlib (slow to start, or optional)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for index, (arch, fit) in enumerate(fits.items()):
        color, law = f"C{index}", fit.compute_law
        compute = [p.compute for p in fit.points]
        grid = np.geomspace(min(compute), max(compute), 50)
        if only is not None and arch != only:
            if arch == baseline and law is not None:
                ax.plot(grid, law.loss(grid), "--", color="0.5", lw=1,
                        label=f"{arch} fit (baseline)")
            continue
        ax.plot(compute, [p.loss for p in fit.points], "o", color=color,
                label=f"{arch} runs" + ("" if law else " (no L(C) fit)"))
        if law is not None:
            ax.plot(grid, law.loss(grid), "-", color=color,
                    label=f"{arch}: {law.a:.3g} C^-{law.alpha:.3g}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("compute C = 6 N D (FLOPs)")
    ax.set_ylabel("final validation loss")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(f"loss vs compute: {only}" if only else "loss vs compute")
    label_ticks(ax)
    return fig


def plot_compute(fits: dict[str, ArchitectureFit], out_png: Path, only: str | None = None,
                 baseline: str | None = None) -> Path:
    """`compute_figure` written as a PNG."""
    out_png.parent.mkdir(parents=True, exist_ok=True)
    compute_figure(fits, only, baseline).savefig(out_png)
    return out_png


def cmd_fit(args) -> int:
    """`python -m slurm fit`: pull, fit, print, plot, log to MLflow."""
    # deferred: pulls in MLflow (slow to start, or optional)
    from mlflow.exceptions import MlflowException

    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    try:
        if not uri:
            raise FitError("--tracking-uri is required (or MLFLOW_TRACKING_URI); a sweep's "
                           "default store is sqlite:///<sweep dir>/mlflow.db")
        budgets = [float(b) for b in args.budgets.split(",")] if args.budgets else None
        client = mlflow_client(uri)
        try:
            with bounded_http_requests():
                points, skipped = load_points(client, args.experiment, args.metric,
                                              args.sweep)
        except MlflowException as err:
            raise FitError(f"--tracking-uri {uri}: cannot read the store: {err}") from None
        for reason in skipped:
            print(f"skipped {reason}", file=sys.stderr)
        unfinished = sum(": unfinished, status " in reason for reason in skipped)
        if unfinished:
            print(f"warning: {unfinished} run(s) with sweep tags are unfinished and left out "
                  "of the fit; submitting the sweep again resumes them", file=sys.stderr)
        if not points:
            raise FitError(f"no finished runs with sweep tags and {args.metric} in "
                           f"{args.experiment!r}")
    except (FitError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    fits = fit_architectures(points)
    mults = multipliers(fits, args.baseline, budgets)
    print(format_report(fits, mults, args.baseline))

    out = Path(args.out or f"fits/{_safe(args.experiment)}")
    pngs = [plot_compute(fits, out / "loss_vs_compute.png")]
    pngs += [plot_compute(fits, out / f"loss_vs_compute_{_safe(arch)}.png", only=arch,
                          baseline=args.baseline) for arch in fits]
    summary = {"experiment": args.experiment, "tracking_uri": uri, "metric": args.metric,
               "baseline": args.baseline, "skipped": skipped,
               "architectures": {a: {"runs": [asdict(p) for p in f.points],
                                     "compute_law": f.compute_law and asdict(f.compute_law),
                                     "params_tokens": f.params_tokens
                                     and asdict(f.params_tokens), "note": f.note}
                                 for a, f in fits.items()},
               "multipliers": {a: [asdict(m) for m in ms] for a, ms in mults.items()}}
    (out / "fit.json").write_text(json.dumps(summary, indent=1, default=float) + "\n")
    print(f"wrote {out / 'fit.json'} and {len(pngs)} plots in {out}")
    run_id = log_fit(client, args.experiment, out, fits, mults)
    print(f"logged to MLflow run {run_id} (scaling-fit) in experiment {args.experiment}")
    return 0


def log_fit(client, experiment: str, out: Path, fits: dict[str, ArchitectureFit],
            mults: dict[str, list[Multiplier]]) -> str:
    """A `scaling-fit` run in the experiment with the coefficients and the plots."""
    # deferred: pulls in MLflow (slow to start, or optional)
    from mlflow.entities import Metric, RunTag

    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    run = client.create_run(experiment_id, run_name="scaling-fit",
                            tags={"kind": FIT_KIND})
    metrics = []
    for arch, fit in fits.items():
        key = _safe(arch)
        if fit.compute_law is not None:
            metrics += [Metric(f"alpha.{key}", fit.compute_law.alpha, 0, 0),
                        Metric(f"A.{key}", fit.compute_law.a, 0, 0)]
        if fit.params_tokens is not None:
            nd = fit.params_tokens
            metrics += [Metric(f"{k}.{key}", getattr(nd, k), 0, 0) for k in "EABab"]
    for arch, values in mults.items():
        metrics += [Metric(f"multiplier.{_safe(arch)}.C{m.compute:.3g}".replace("+", ""),
                           m.value, 0, 0)
                    for m in values]
    metrics = [m for m in metrics if math.isfinite(m.value)]
    client.log_batch(run.info.run_id, metrics=metrics,
                     tags=[RunTag("architectures", ",".join(fits))])
    client.log_artifacts(run.info.run_id, str(out), "scaling_fit")
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def add_arguments(parser) -> None:
    """The options of `python -m slurm fit`."""
    parser.add_argument("--experiment", required=True, help="MLflow experiment of the sweep")
    parser.add_argument("--tracking-uri", help="MLflow store (default: $MLFLOW_TRACKING_URI)")
    parser.add_argument("--baseline", default="transformer",
                        help="architecture the compute multipliers compare against")
    parser.add_argument("--budgets", help="comma-separated compute budgets for the "
                        "multiplier (default: smallest, geometric middle, largest run)")
    parser.add_argument("--metric", default="val_loss", help="final loss metric")
    parser.add_argument("--sweep", help="only runs with this sweep_id tag")
    parser.add_argument("--out", help="directory for plots and fit.json "
                        "(default: fits/<experiment>)")
