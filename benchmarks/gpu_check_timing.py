"""How the GPU check times things and what it may conclude from the times.

- Step times come from CUDA events recorded around each step on the device's stream, read
  only after the round (no host sync between steps); on the CPU from `time.perf_counter`.
  `TIMER` names which, and every section's JSON says it.
- Configurations run interleaved: round r runs `steps` steps of every configuration, in an
  order rotated by r (so each configuration meets each position and each neighbour alike).
- A ratio of configuration A to B is taken within each round (the mean step of A over that
  of B in the same round) and reported as the median of those per-round ratios with a
  distribution-free 95% confidence interval for the median: the order statistics
  [x_(l), x_(n+1-l)] of the n per-round ratios, l the largest rank with
  2 * P(Binomial(n, 1/2) <= l - 1) <= 0.05 (coverage >= 95%, no assumption on the
  distribution, no random resampling; it needs n >= 6 rounds, else the interval is null).
- A goal "<= g" counts as met only when the interval's upper end is below g, ">= g" only
  when its lower end is above g: "met" is true then, false otherwise (an interval that
  straddles g is not met), and null when there is no interval (too few rounds, a skipped
  row) or the figure cannot speak to the goal (the CPU fallback; a clean-room stand-in for
  the official code); "reason" then says which.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from itertools import pairwise

import torch


def timer_name(device: torch.device) -> str:
    """What the times of `device` are measured with (for the JSON)."""
    return "cuda_events" if device.type == "cuda" else "perf_counter"


class _Marks:
    """Time marks of one run of consecutive steps: CUDA events, or perf_counter values."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Seconds between consecutive marks (CUDA: after the events completed)."""
        if self.cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in pairwise(self.marks)]
        return [b - a for a, b in pairwise(self.marks)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(runs: dict[str, Callable[[], object]], device: torch.device, *, rounds: int,
                steps: int, warmup: int) -> dict[str, list[list[float]]]:
    """{name: [[seconds of each step] for each round]}: `warmup` untimed steps of each run,
    then `rounds` rounds of `steps` timed steps of every run, the order rotated each round."""
    for fn in runs.values():
        for _ in range(warmup):
            fn()
    sync(device)
    names = list(runs)
    times: dict[str, list[list[float]]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        marks = {}
        for name in order:
            marks[name] = _Marks(device)
            marks[name].mark()
            for _ in range(steps):
                runs[name]()
                marks[name].mark()
        sync(device)
        for name in order:
            times[name].append(marks[name].seconds())
    return times


def round_means(times: list[list[float]]) -> list[float]:
    """The mean step of each round."""
    return [statistics.fmean(steps) for steps in times]


def median_interval_ranks(n: int, level: float = 0.95) -> int | None:
    """l such that [x_(l), x_(n+1-l)] (1-based order statistics of n values) covers the
    median with probability >= level; None when no l does (n < 6 at 95%)."""
    best = None
    for rank in range(1, n // 2 + 1):
        tail = sum(math.comb(n, i) for i in range(rank)) / 2**n  # P(B <= rank - 1)
        if 2 * tail <= 1 - level:
            best = rank
    return best


# What every "median", "low", "high", "n" of the JSON means (said once, in each section).
INTERVAL = ("median of n per-round values (ratios of round means, or differences); low, high: "
            "its distribution-free 95% interval (order statistics, binomial), null for n < 6")


def median_ci(values: list[float], level: float = 0.95) -> dict:
    """{"median", "low", "high", "n"}: the median of `values` and its distribution-free
    interval (module docstring); low/high null for too few values."""
    ordered = sorted(values)
    n = len(ordered)
    rank = median_interval_ranks(n, level)
    return {"median": statistics.median(ordered) if ordered else None,
            "low": ordered[rank - 1] if rank else None,
            "high": ordered[n - rank] if rank else None, "n": n}


def ratio_ci(numerator: list[list[float]], denominator: list[list[float]]) -> dict:
    """median_ci of the per-round ratios of mean step times (numerator / denominator)."""
    return median_ci([a / b for a, b in zip(round_means(numerator), round_means(denominator),
                                            strict=True)])


def verdict(ci: dict | None, goal: float, sense: str, reason: str | None = None) -> dict:
    """{"goal", "met", ...} for the interval `ci` (module docstring); `reason` makes it null."""
    if sense not in ("<=", ">="):
        raise ValueError(f"goal sense {sense!r} is neither '<=' nor '>='")
    row = {"goal": f"{sense} {goal}", **(ci or {})}
    if reason is not None or ci is None or ci.get("low") is None:
        return {**row, "met": None,
                "reason": reason or "no interval (too few rounds, or the row did not run)"}
    return {**row, "met": ci["high"] < goal if sense == "<=" else ci["low"] > goal}


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> dict:
    """Bytes/s of a large device-to-device copy (a read and a write of every byte): the
    median and best of `repeats` copies, timed like the steps."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    marks = _Marks(device)
    marks.mark()
    for _ in range(repeats):
        dst.copy_(src)
        marks.mark()
    sync(device)
    rates = [2 * nbytes / s for s in marks.seconds()]
    return {"bytes": nbytes, "repeats": repeats, "median_bytes_per_s": statistics.median(rates),
            "best_bytes_per_s": max(rates), "timer": timer_name(device)}
