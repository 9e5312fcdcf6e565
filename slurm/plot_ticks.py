"""Labelled ticks on every axis of the study plots.

A log axis over less than a decade or two (1.16e9 to 1.19e9 FLOPs, learning rates 1e-3 to
3e-3) gets no labelled major tick from matplotlib, or one: the reader sees a scale without
numbers. `label_ticks` fixes the view, and where fewer than MIN_LABELS labelled ticks fall
inside it, places MIN_LABELS + 1 ticks spread over it (geometrically on a log axis), labelled
to 3 significant digits, with unlabelled minor ticks. `tick_labels` is what a reader sees
(tests/test_study_report.py checks every plot with it).
"""

from __future__ import annotations

import numpy as np

MIN_LABELS = 3


def _label(value: float, _position=None) -> str:
    return f"{value:.3g}"


def tick_labels(axis) -> list[str]:
    """The non-empty tick labels of a matplotlib Axis inside its view, as drawn."""
    axis.figure.canvas.draw()
    low, high = sorted(axis.get_view_interval())
    ticks = [*axis.get_major_ticks(), *axis.get_minor_ticks()]
    return [t.label1.get_text() for t in ticks
            if t.label1.get_visible() and t.label1.get_text().strip()
            and low * (1 - 1e-9) <= t.get_loc() <= high * (1 + 1e-9)]


def _fix(axis) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    if len(tick_labels(axis)) >= MIN_LABELS:
        return
    low, high = sorted(axis.get_view_interval())
    inner = (low + 0.05 * (high - low), high - 0.05 * (high - low))
    if axis.get_scale() == "log":
        inner = tuple(np.exp(np.log(low) + f * np.log(high / low)) for f in (0.05, 0.95))
        ticks = np.geomspace(*inner, MIN_LABELS + 1)
    else:
        ticks = np.linspace(*inner, MIN_LABELS + 1)
    ticks = [float(f"{t:.3g}") for t in ticks]
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(_label))
    axis.set_minor_formatter(NullFormatter())


def label_ticks(ax) -> None:
    """Give both axes of `ax` at least MIN_LABELS labelled ticks inside the current view
    (categorical axes with fixed tick labels are left as they are)."""
    ax.autoscale_view()
    ax.set_xlim(ax.get_xlim())  # fixed: ticks placed below must not move the view
    ax.set_ylim(ax.get_ylim())
    for axis in (ax.xaxis, ax.yaxis):
        from matplotlib.ticker import FixedFormatter

        if not isinstance(axis.get_major_formatter(), FixedFormatter):
            _fix(axis)
