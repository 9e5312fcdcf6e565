"""`python -m slurm report --experiment NAME [--tracking-uri URI] --out DIR`: a study's report.

Writes DIR/report.html, one self-contained page (tables, PNGs inline), and DIR/report.json
with the same numbers. Sections: runs that failed or did not finish, by name, each with its
one-line cause (and runs of the sweep manifest that never started); final validation loss
and perplexity per configuration over seeds (a dot plot with seed intervals,
slurm/report_plots.py); each architecture at matched parameters and at matched FLOPs for a
sweep with match_flops (slurm/report_arms.py); the best learning rate per architecture;
paired differences against the baseline; the scaling laws and compute multipliers
(slurm/fit.py; only where an architecture has 3+ budgets spanning 4x, else why not);
downstream scores
(`lm_eval/<task>/<metric>`); cost, MFU against one peak for the whole study
(slurm/report_cost.py, slurm/report_mfu.py); the DWA heatmaps at the end of training; every
run's commit and config. The statistics are in slurm/report_stats.py. One number format per
table column (report_html.column), labelled ticks on every plot axis (slurm/plot_ticks.py).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

from pretrain.tracking import bounded_http_requests, mlflow_client
from slurm.fit import (
    MIN_BUDGETS,
    MIN_SPAN,
    UNFINISHED,
    Point,
    compute_figure,
    fit_architectures,
    format_report,
    multipliers,
    why_no_compute_law,
)
from slurm.report_arms import arms_section
from slurm.report_cost import cost_section
from slurm.report_data import ReportError, Study, StudyRun, load_study
from slurm.report_html import (
    Raw,
    column,
    esc,
    page,
    paragraph,
    png_of,
    png_tag,
    section,
    table,
)
from slurm.report_mfu import parse_peak, study_peak
from slurm.report_plots import loss_dot_plot, lr_plot
from slurm.report_stats import (
    Paired,
    SeedStats,
    Tuning,
    best_of,
    config_of,
    label,
    paired_differences,
    seed_stats,
)

LM_EVAL_PREFIX = "lm_eval/"


def failures(study: Study) -> list[tuple[str, str, str]]:
    """(run, status, why) of every run without a usable final validation loss; a failed
    run's why is its one-line cause (tag exit_cause, else the last line of its Slurm log)."""
    rows = []
    for run in study.runs:
        if run.loss is not None:
            continue
        exit_status = run.tags.get("exit_status")
        cause, log = run.tags.get("exit_cause"), study.logs.get(run.name)
        if cause or (log and run.status == "FAILED"):
            why = cause or log
        else:  # still training, killed at a time limit, ...: what MLflow's status means
            why = UNFINISHED.get(run.status, "finished without a final val_loss "
                                 "(data.val_batches 0?)") + (f"; its log ends: {log}"
                                                             if log else "")
        if exit_status not in (None, "0"):
            why += f"; Slurm task exit status {exit_status}"
        rows.append((run.name, run.status, why))
    for name in study.never_started:
        if name in study.logs:  # failed before training opened its MLflow run
            rows.append((name, "FAILED", f"{study.logs[name]}; no MLflow run"))
        else:
            rows.append((name, "NEVER STARTED", "in the sweep manifest, no MLflow run: still "
                         "queued, or cancelled (a dependent run whose parent failed)"))
    return rows


def _loss_rows(stats: list[SeedStats], best: set) -> tuple[list, list[int]]:
    rows, marked = [], []
    ppl = column([s.ppl_mean for s in stats])
    for index, s in enumerate(stats):
        if s.config in best:
            marked.append(index)
        spread = f"± {s.std:.4f}" if s.n > 1 else "(1 seed)"
        per_seed = ", ".join(f"s{r.grid('seed')}: {r.loss:.4f}" for r in s.runs)
        rows.append((label(s.config), s.n, f"{s.mean:.4f} {spread}", ppl[index], per_seed))
    return rows, marked


def losses_section(stats: list[SeedStats], tunings: list[Tuning]) -> str:
    rows, marked = _loss_rows(stats, {t.best.config for t in tunings})
    return section(
        "Final validation loss per configuration",
        paragraph("Mean over seeds with the sample standard deviation; perplexity is "
                  "exp(loss) per run, averaged. Highlighted: the configurations compared "
                  "below (each architecture's best learning rate)."),
        table(["configuration", "seeds", "val loss", "val ppl", "per seed"], rows,
              numeric=(1, 2, 3), marked=marked),
        png_tag(png_of(loss_dot_plot(tunings)), "loss per configuration",
                "final validation loss of the compared configurations: each seed (grey), "
                "the mean (diamond) and its 95% Student-t interval over seeds"))


def tuning_section(tunings: list[Tuning]) -> str:
    tuned = [t for t in tunings if len(t.members) > 1]
    if not tuned:
        return ""
    rows = []
    for t in tuned:
        tried = ", ".join(f"{label(s.config, ('architecture', 'n_layers', 'd_model', 'D', 'from'))}"
                          f": {s.mean:.4f}" for s in sorted(t.members, key=lambda s: s.mean))
        best = dict(t.best.config)
        lrs = sorted({float(dict(s.config)["lr"]) for s in t.members if "lr" in dict(s.config)})
        edge = len(lrs) >= 3 and "lr" in best and float(best["lr"]) in (lrs[0], lrs[-1])
        rows.append((label(t.group), best.get("lr", "—") + (" (edge of the grid)" if edge
                                                             else ""),
                     best.get("warmup", "—"), f"{t.best.mean:.4f}", tried))
    parts = [paragraph("Each architecture (at each shape and budget) is compared at its own "
                       "best learning rate (and warm-up): the lowest mean final validation "
                       "loss over seeds. A best lr at the edge of its grid says: extend the "
                       "grid before trusting the comparison."),
             table(["architecture and shape", "best lr", "best warm-up", "val loss",
                    "tried (best first)"], rows, numeric=(1, 2, 3))]
    if all("lr" in dict(s.config) for t in tuned for s in t.members):
        parts.append(png_tag(png_of(lr_plot(tuned)), "loss vs learning rate",
                             "final validation loss against learning rate (star: best)"))
    return section("Best learning rate per architecture", *parts)


def paired_section(paired: list[Paired], baseline: str) -> str:
    if not paired:
        return section("Paired differences", paragraph(
            f"No pairs: no run of another architecture shares its configuration, seed and "
            f"data order with a run of the baseline {baseline!r}."))
    rows = [(p.architecture, label(p.context), len(p.pairs), f"{p.mean:+.4f}",
             f"{p.std:.4f}" if math.isfinite(p.std) else "—",
             f"[{p.low:+.4f}, {p.high:+.4f}]" if math.isfinite(p.low) else "—",
             f"{p.wins} of {len(p.pairs)}") for p in paired]
    detail = [(p.architecture, a, b, f"{d:+.4f}") for p in paired for a, b, d in p.pairs]
    return section(
        "Paired differences",
        paragraph(f"loss(architecture) - loss({baseline}) over runs that share seed and data "
                  "order (train.seed, data.path, train.batch_size, model.seq_len), each at "
                  "its best learning rate; negative: the architecture is better. Interval: "
                  "95% Student t over the pairs."),
        table(["architecture", "context", "pairs", "mean diff", "std", "95% interval",
               "better in"], rows, numeric=(2, 3, 4)),
        table(["architecture", "run", "baseline run", "difference"], detail, numeric=(3,)))


def scaling_section(tunings: list[Tuning], baseline: str) -> tuple[str, dict]:
    points = [Point(r.run_id, r.name, r.architecture, float(r.tags["N"]), float(r.tags["D"]),
                    float(r.tags["C"]), r.loss)
              for t in tunings if "from" not in dict(t.group)
              for r in t.best.runs if {"N", "D", "C"} <= set(r.tags)]
    fits = fit_architectures(points) if points else {}
    if not fits:
        return "", {}
    mults = multipliers(fits, baseline)
    no_fit = {a: why_no_compute_law([p.compute for p in f.points]) for a, f in fits.items()
              if f.compute_law is None}
    summary = {"laws": {a: f.compute_law and asdict(f.compute_law) for a, f in fits.items()},
               "no_fit": no_fit,
               "multipliers": {a: [asdict(m) for m in ms] for a, ms in mults.items()}}
    title = "Scaling laws and compute multiplier"
    if not any(f.compute_law for f in fits.values()):
        return section(title, paragraph("No scaling law, no compute multiplier."),
                       *[paragraph(f"{a}: {why}.") for a, why in no_fit.items()]), summary

    return section(
        title,
        paragraph(f"Fitted on each architecture's best-learning-rate runs (python -m slurm "
                  f"fit fits every run), only where they hold {MIN_BUDGETS}+ compute budgets "
                  f"spanning {MIN_SPAN:g}x or more. L(C) = A C^-alpha with standard errors, "
                  "drawn over its own runs' range; L(N, D) when the grid allows; the compute "
                  "multiplier over the baseline with its 68% interval, within the compute "
                  "range both laws were fitted on."),
        f"<pre>{esc(format_report(fits, mults, baseline))}</pre>",
        png_tag(png_of(compute_figure(fits)), "loss vs compute",
                "final validation loss against compute C = 6ND")
    ), summary


def downstream_section(stats: list[SeedStats]) -> str:
    keys = sorted({k for s in stats for r in s.runs for k in r.metrics
                   if k.startswith(LM_EVAL_PREFIX)})
    if not keys:
        return ""
    means = [[statistics.fmean(got) if (got := [r.metrics[key] for r in s.runs
                                                  if key in r.metrics]) else None
              for s in stats] for key in keys]
    cells = [column(values) for values in means]
    rows = [(label(s.config), s.n, *[c[i] for c in cells]) for i, s in enumerate(stats)]
    return section("Downstream scores",
                   paragraph("lm-evaluation-harness scores on the final checkpoints (mean over "
                             "seeds), as logged by python -m pretrain lm-eval."),
                   table(["configuration", "seeds", *[k[len(LM_EVAL_PREFIX):] for k in keys]],
                         rows, numeric=range(1, len(keys) + 2)))


def heatmap_section(runs: list[StudyRun]) -> str:
    drawn = [png_tag(r.dwa_png, f"DWA weights of {r.name}", f"{r.name}: {r.dwa_name}")
             for r in runs if r.dwa_png]
    if not drawn:
        return ""
    return section("DWA weights at the end of training",
                   paragraph("The last heatmap each run logged (dwa/step-*.png): row i is the "
                             "DWA after block i, column j weighs X_j; grey: not in the k x p "
                             "pattern."), *drawn)


def runs_section(runs: list[StudyRun]) -> str:
    rows = []
    for run in runs:
        config = (Raw(f"<details><summary>config.yaml</summary><pre>{esc(run.config_text)}"
                      "</pre></details>") if run.config_text else "—")
        rows.append((run.name, run.status, run.tags.get("git_commit", "—")[:12],
                     f"{run.loss:.4f}" if run.loss is not None else "—", config))
    return section("Runs", table(["run", "status", "commit", "val loss", "config"], rows,
                                 numeric=(3,)))


def build_report(study: Study, baseline: str,
                 mfu_peak: float | None = None) -> tuple[str, dict]:
    """The HTML page and the JSON summary of a study; `mfu_peak`: the declared MFU peak
    (FLOP/s), else one chosen for the whole study (slurm/report_mfu.py)."""
    stats = seed_stats(study.runs)
    tunings = best_of(stats)
    paired = paired_differences(tunings, baseline)
    failed = failures(study)
    finished = sum(r.loss is not None for r in study.runs)
    body = [paragraph(f"MLflow experiment {study.experiment} in {study.tracking_uri}: "
                      f"{len(study.runs)} runs, {finished} finished with a final validation "
                      f"loss, {len(failed)} failed, unfinished or never started.")]
    body.append(section("Failed or unfinished runs", table(
        ["run", "status", "why"], [(n, Raw(f'<span class="bad">{esc(s)}</span>'), w)
                                   for n, s, w in failed])) if failed else
                section("Failed or unfinished runs", paragraph("None: every run finished.")))
    scaling, laws = ("", {})
    arms, arm_rows = arms_section(stats, baseline)
    if tunings:
        body += [losses_section(stats, tunings), arms, tuning_section(tunings),
                 paired_section(paired, baseline)]
        scaling, laws = scaling_section(tunings, baseline)
        body.append(scaling)
    cost, costs = cost_section(study.runs, study_peak(study.runs, mfu_peak))
    body += [downstream_section(stats), cost, heatmap_section(study.runs),
             runs_section(study.runs)]
    summary = {
        "experiment": study.experiment, "tracking_uri": study.tracking_uri,
        "baseline": baseline,
        "runs": {r.name: {"status": r.status, "val_loss": r.loss,
                          "commit": r.tags.get("git_commit"),
                          "config": label(config_of(r))} for r in study.runs},
        "failed": [{"run": n, "status": s, "why": w} for n, s, w in failed],
        "configurations": [{"config": label(s.config), "seeds": s.n, "mean": s.mean,
                            "std": s.std, "ppl": s.ppl_mean} for s in stats],
        "best_lr": [{"group": label(t.group), "best": label(t.best.config),
                     "lr": dict(t.best.config).get("lr"), "mean": t.best.mean}
                    for t in tunings],
        "paired": [{"architecture": p.architecture, "context": label(p.context),
                    "pairs": len(p.pairs), "mean": p.mean, "std": p.std, "low": p.low,
                    "high": p.high} for p in paired],
        **({"arms": arm_rows} if arm_rows else {}), **laws, **costs}
    return page(f"Study report: {study.experiment}", body), summary


def _finite(value):
    """The summary with nan and inf as null, so that report.json is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def cmd_report(args) -> int:
    """`python -m slurm report`: read the experiment, write report.html and report.json."""
    # deferred: pulls in MLflow (slow to start, or optional)
    from mlflow.exceptions import MlflowException

    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    try:
        if not uri:
            raise ReportError("--tracking-uri is required (or MLFLOW_TRACKING_URI); a sweep's "
                              "default store is sqlite:///<sweep dir>/mlflow.db")
        mfu_peak = parse_peak(args.mfu_peak) if args.mfu_peak else None
        try:
            with bounded_http_requests():
                study = load_study(mlflow_client(uri), args.experiment, uri, args.sweep)
        except MlflowException as err:
            raise ReportError(f"--tracking-uri {uri}: cannot read the store: {err}") from None
    except ReportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    html_text, summary = build_report(study, args.baseline, mfu_peak)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.html").write_text(html_text)
    (out / "report.json").write_text(json.dumps(_finite(summary), indent=1, default=float)
                                     + "\n")
    for name, status, why in failures(study):
        print(f"not finished: {name}: {status}: {why}", file=sys.stderr)
    print(f"wrote {out / 'report.html'} ({len(study.runs)} runs, "
          f"{len(summary['failed'])} failed or unfinished) and {out / 'report.json'}")
    return 0


def add_arguments(parser) -> None:
    """The options of `python -m slurm report`."""
    parser.add_argument("--experiment", required=True, help="MLflow experiment of the study")
    parser.add_argument("--tracking-uri", help="MLflow store (default: $MLFLOW_TRACKING_URI)")
    parser.add_argument("--out", required=True, help="directory for report.html and "
                        "report.json")
    parser.add_argument("--baseline", default="transformer",
                        help="architecture the paired differences and multipliers compare "
                             "against")
    parser.add_argument("--sweep", help="only runs with this sweep_id tag")
    parser.add_argument("--mfu-peak", help="the one peak every run's MFU is taken against: "
                        "FLOP/s (989e12) or a device of pretrain/mfu.py's table (H100: its "
                        "dense bf16 peak); default: the runs' common datasheet peak, or on a "
                        "CPU the median of their measured matmuls")
