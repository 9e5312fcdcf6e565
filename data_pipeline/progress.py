"""Progress on stderr for people and for log files.

A person at a terminal gets a tqdm bar, redrawn in place with carriage returns. A log file
(Slurm's job log, `2> train.log`) gets no bar: every redraw would be one more line-less
frame in it. There the caller's own periodic lines are the log (the trainer's "step N/M
loss ..." every train.log_every steps), or, with `log_interval_s`, one plain line of the
bar's counts that often and once at the end. Every bar in the project comes from
`progress_bar`, and lines written while one may be drawn go through `write_line`.

This lives in data_pipeline, the lowest layer that shows progress (the trainer imports
data_pipeline; data_pipeline imports nothing of pretrain).
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from tqdm import tqdm

# What the plain line shows: the counts, time and rate, without the bar's block characters.
LINE_FORMAT = "{desc}: {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


def is_terminal(stream: IO) -> bool:
    """Whether `stream` is a terminal (false for files, pipes and closed streams)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class LineProgress:
    """The bar's stand-in where stderr is not a terminal: the same update/set_postfix/close
    calls, printing one plain line every `log_interval_s` seconds and at close, or nothing
    when `log_interval_s` is None. It never writes a carriage return."""

    def __init__(self, file: IO, log_interval_s: float | None, total: float | None = None,
                 initial: float = 0, desc: str = "", unit: str = "it",
                 unit_scale: bool = False):
        self.file, self.log_interval_s = file, log_interval_s
        self.total, self.n, self.desc, self.unit, self.unit_scale = (
            total, initial, desc, unit, unit_scale)
        self.postfix = ""
        self._start = self._last_line = time.monotonic()
        self._printed_n: float | None = None

    def update(self, n: float = 1) -> None:
        """Count `n` more units; print a line if `log_interval_s` has passed since the last."""
        self.n += n
        if self.log_interval_s is not None \
                and time.monotonic() - self._last_line >= self.log_interval_s:
            self._print_line()

    def set_postfix(self, **values: Any) -> None:
        """Values shown after the counts, as tqdm's set_postfix."""
        self.postfix = ", ".join(f"{key}={value}" for key, value in values.items())

    def close(self) -> None:
        """Print the final counts (unless just printed, or silent)."""
        if self.log_interval_s is not None and self._printed_n != self.n:
            self._print_line()

    def _print_line(self) -> None:
        elapsed = time.monotonic() - self._start
        line = tqdm.format_meter(self.n, self.total, elapsed, prefix=self.desc, unit=self.unit,
                                 unit_scale=self.unit_scale, bar_format=LINE_FORMAT,
                                 postfix=self.postfix)
        self.file.write(line + "\n")
        self.file.flush()
        self._last_line, self._printed_n = time.monotonic(), self.n

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


Progress = tqdm | LineProgress  # what progress_bar returns; callers treat both alike


def progress_bar(enabled: bool = True, *, total: float | None = None, initial: float = 0,
                 desc: str = "", unit: str = "it", unit_scale: bool = False,
                 log_interval_s: float | None = None,
                 file: IO | None = None) -> Progress:
    """A tqdm bar on stderr (or `file`) when `enabled` and it is a terminal; otherwise a
    LineProgress (plain lines every `log_interval_s` seconds, or silent when None or when
    not `enabled`)."""
    file = sys.stderr if file is None else file
    if enabled and is_terminal(file):
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, unit_scale=unit_scale,
                    file=file, dynamic_ncols=True)
    return LineProgress(file, log_interval_s if enabled else None, total=total,
                        initial=initial, desc=desc, unit=unit, unit_scale=unit_scale)


def write_line(line: str, file: IO | None = None) -> None:
    """Print `line` on stderr (or `file`) without tearing a bar being drawn there."""
    tqdm.write(line, file=sys.stderr if file is None else file)
