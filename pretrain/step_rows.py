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
