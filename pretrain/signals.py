"""Stop requests (SIGINT, SIGTERM, SIGUSR1) that every rank agrees on at a fetch point.

A handler only sets a flag, so a second signal while a checkpoint is being written changes
nothing; at each of the training loop's fetch points (a logging, checkpoint or validation
step, docs/training.md#the-step-loop-and-its-fetch-points) the ranks all-reduce the flag (as
Megatron's dist_signal_handler does) so that all of them save and exit together.
"""

from __future__ import annotations

import signal
import sys

import torch
import torch.distributed as dist

from pretrain.exit_codes import EXIT_PREEMPTED  # noqa: F401  (the status of a stop)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Installs the handlers on enter and restores the previous ones on exit."""

    def __init__(self, signals=STOP_SIGNALS):
        self.signals = signals
        self.received: int | None = None
        self._previous = {}

    def _handle(self, signum, _frame) -> None:
        if self.received is None:
            print(f"\nreceived {signal.Signals(signum).name}: saving a checkpoint at the next "
                  "logging step, then exiting", file=sys.stderr, flush=True)
        self.received = signum

    def __enter__(self) -> "StopRequest":
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def agreed(self, device: torch.device) -> bool:
        """True on every rank if any rank received a stop signal (a collective)."""
        flag = torch.tensor([1.0 if self.received is not None else 0.0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
