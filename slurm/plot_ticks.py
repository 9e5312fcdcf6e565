"""Labelled ticks on every axis of the study plots.

A log axis over less than a decade or two (1.16e9 to 1.19e9 FLOPs, learning rates 1e-3 to
3e-3) gets no labelled major tick from matplotlib, or one: the reader sees a scale without
numbers, or "7.65 x 10^0" on its minor ticks. `label_ticks` fixes the view and gives a log
axis round ticks inside it, labelled plainly to 3 significant digits (unlabelled minor
ticks); a linear axis with fewer than MIN_LABELS labelled ticks gets round ones too.
`tick_labels` is what a reader sees (tests/test_study_report.py checks every plot with it).
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


def _log_ticks(low: float, high: float) -> list[float]:
    """Round values inside [low, high] for a log axis: over a decade or more 1-2-5 (or 1 to
    9) times powers of ten; over less, evenly spaced round numbers."""
    # deferred: pulls in matplotlib (slow to start, or optional)
    from matplotlib.ticker import LogLocator, MaxNLocator

    if high / low < 10:
        candidates = [MaxNLocator(MIN_LABELS + 1).tick_values(low, high)]
    else:
        candidates = [LogLocator(subs=subs).tick_values(low, high)
                      for subs in ((1.0,), (1.0, 2.0, 5.0), tuple(range(1, 10)))]
    for ticks in candidates:
        inside = [float(t) for t in ticks if low <= t <= high]
        if len(inside) >= MIN_LABELS:
            return inside
    return [float(f"{t:.3g}") for t in np.geomspace(low, high, MIN_LABELS + 2)[1:-1]]


def _fix(axis) -> None:
    """Round, plainly labelled ticks on a log axis; a linear axis keeps matplotlib's unless
    it has fewer than MIN_LABELS inside the view."""
    # deferred: pulls in matplotlib (slow to start, or optional)
    from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullFormatter

    low, high = sorted(axis.get_view_interval())
    if axis.get_scale() == "log":
        ticks = _log_ticks(low, high)
    elif len(tick_labels(axis)) < MIN_LABELS:
        ticks = MaxNLocator(MIN_LABELS + 1).tick_values(low, high)
    else:
        return
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(_label))
    axis.set_minor_formatter(NullFormatter())


def label_ticks(ax) -> None:
    """Give both axes of `ax` at least MIN_LABELS labelled ticks inside the current view
    (an axis with ticks set by hand, such as category names, is left as it is)."""
    # deferred: pulls in matplotlib (slow to start, or optional)
    from matplotlib.ticker import FixedLocator

    ax.autoscale_view()
    ax.set_xlim(ax.get_xlim())  # fixed: ticks placed below must not move the view
    ax.set_ylim(ax.get_ylim())
    for axis in (ax.xaxis, ax.yaxis):
        if not isinstance(axis.get_major_locator(), FixedLocator):
            _fix(axis)
