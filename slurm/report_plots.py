"""The study report's plots of losses: a dot plot of the compared configurations (each seed,
the mean, and a 95% Student-t interval over seeds; a dot plot, so its axis need not start
at zero), and loss against learning rate. Each returns a matplotlib Figure with labelled
ticks on every axis (slurm/plot_ticks.py)."""

from __future__ import annotations

import math
import statistics

from slurm.plot_ticks import label_ticks
from slurm.report_html import figure
from slurm.report_stats import Tuning, label


def seed_interval(losses: list[float]) -> tuple[float, float] | None:
    """The 95% Student-t interval of the mean of `losses` over seeds; None with one seed."""
    # deferred: pulls in scipy (slow to start, or optional)
    from scipy import stats

    if len(losses) < 2:
        return None
    mean = statistics.fmean(losses)
    half = stats.t.ppf(0.975, len(losses) - 1) * statistics.stdev(losses) / math.sqrt(
        len(losses))
    return mean - half, mean + half


def loss_dot_plot(tunings: list[Tuning]):
    """Final validation loss of each compared configuration: one dot per seed, the mean, and
    its 95% interval over seeds."""
    fig, ax = figure(7, 1.2 + 0.4 * len(tunings))
    for row, tuning in enumerate(tunings):
        best = tuning.best
        losses = [r.loss for r in best.runs]
        ax.plot(losses, [row] * len(losses), "o", color="0.6", ms=4,
                label="a seed" if row == 0 else None)
        interval = seed_interval(losses)
        if interval is not None:
            ax.hlines(row, *interval, color="C0", lw=2,
                      label="95% t interval over seeds" if row == 0 else None)
        ax.plot([best.mean], [row], "D", color="C0", ms=7,
                label="mean over seeds" if row == 0 else None)
    ax.set_yticks(range(len(tunings)), [label(t.best.config) for t in tunings], fontsize=8)
    ax.set_ylim(-0.7, len(tunings) - 0.3)
    ax.set_xlabel("final validation loss")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    label_ticks(ax)
    return fig


def lr_plot(tunings: list[Tuning]):
    """Mean final validation loss against learning rate per tuning group (star: best)."""
    fig, ax = figure()
    for index, t in enumerate(tunings):
        points = sorted((float(dict(s.config)["lr"]), s.mean) for s in t.members)
        ax.plot(*zip(*points, strict=True), "o-", color=f"C{index % 10}", label=label(t.group))
        ax.plot([float(dict(t.best.config)["lr"])], [t.best.mean], "*", ms=14,
                color=f"C{index % 10}")
    ax.set_xscale("log")
    lrs = sorted({float(dict(s.config)["lr"]) for t in tunings for s in t.members})
    ax.set_xticks(lrs, [f"{lr:g}" for lr in lrs])  # the grid's values, labelled as given
    ax.set_xticks([], minor=True)
    ax.set_xlabel("learning rate")
    ax.set_ylabel("final validation loss (mean over seeds)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    label_ticks(ax)
    return fig
