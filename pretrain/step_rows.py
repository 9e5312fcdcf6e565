"""The training loop's per-step rows, held on the device until a fetch point.

A step's loss and gradient norm stay device tensors: reading one on the host (`.item()`)
would make the host wait for the device every step. The loop keeps each step's row here
and fetches the rows of all steps since the last fetch point in one transfer, at each
logging step, checkpoint and validation (docs/training.md#the-step-loop-and-its-fetch-points).
"""

from __future__ import annotations

import time

import torch


class PendingRows:
    """Rows ({name: Python value or 0-d tensor}) of the steps since the last fetch."""

    def __init__(self):
        self.rows: list[dict] = []
        self._started: float | None = None  # when the first pending step began

    def __len__(self) -> int:
        return len(self.rows)

    def start_step(self) -> None:
        """Mark the start of a step (the first since a fetch starts the clock)."""
        if self._started is None:
            self._started = time.perf_counter()

    def add(self, row: dict) -> None:
        self.rows.append(row)

    def fetch(self) -> tuple[list[dict], float]:
        """The pending rows with each tensor value as a Python float, read in one transfer
        (it waits for the device), and the seconds from the first row's start to now."""
        tensors = [(row, key) for row in self.rows for key, value in row.items()
                   if isinstance(value, torch.Tensor)]
        if tensors:
            values = torch.stack([row[key].detach().reshape(()).double()
                                  for row, key in tensors]).tolist()
            for (row, key), value in zip(tensors, values, strict=True):
                row[key] = value
        seconds = time.perf_counter() - self._started if self._started is not None else 0.0
        rows, self.rows, self._started = self.rows, [], None
        return rows, seconds


class ProgressClock:
    """Elapsed time and ETA for the "step N/M" lines (and peak memory on CUDA): the ETA is
    the steps left at the mean step time since this job's first step (a resumed job does
    not count the steps it did not run)."""

    def __init__(self, first_step: int, stop_at: int, device: torch.device):
        self.first_step, self.stop_at, self.device = first_step, stop_at, device
        self.started = time.perf_counter()

    def line(self, step: int) -> str:
        elapsed = time.perf_counter() - self.started
        done = step - self.first_step
        eta = elapsed / done * (self.stop_at - step) if done > 0 else float("nan")
        text = f"elapsed {_duration(elapsed)} eta {_duration(eta)}"
        if self.device.type == "cuda":
            text += f" mem {torch.cuda.max_memory_allocated(self.device) / 2**30:.1f} GiB"
        return text


def _duration(seconds: float) -> str:
    """1m05s, 2h03m, 12s: minutes and seconds up to an hour, then hours and minutes."""
    if seconds != seconds:  # NaN: not known yet
        return "?"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
