"""One training process under the Slurm launcher: `python -m slurm.worker train --config ...`.

A thin shell around `python -m pretrain` that lets the node launcher (slurm/launch.py) see
what its ranks did:

- it writes `rank-<RANK>.pid` into $DENSEFORMER_LAUNCH_DIR at start, so the launcher can
  forward a stop signal to it, and `rank-<RANK>.status` with the exit status at the end
  (torchrun reports any non-zero status of a worker as a plain failure; the launcher needs to
  tell a preemption, status 75, from a crash);
- a stop signal (SIGINT, SIGTERM, SIGUSR1) that arrives while the trainer is still starting
  up, before it installs its own handlers, is remembered and delivered again as soon as
  they are installed, instead of killing the process or being lost;
- a failed rank writes its one-line cause into `rank-<RANK>.cause`: the last line it wrote
  to stderr that starts with `error` (the trainer's convention: `error: <key>: ...`,
  `error (rank N): ...`), or the exception it died of. The launcher ends its log with it.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from pretrain.cli import main as pretrain_main
from pretrain.exit_codes import EXIT_PREEMPTED  # torch-free

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
LAUNCH_DIR_ENV = "DENSEFORMER_LAUNCH_DIR"
TRAINER_HANDLER_MODULE = "pretrain.signals"  # where the trainer's StopRequest handler lives


class EarlySignals:
    """Remembers stop signals until another handler takes over, then re-sends them."""

    def __init__(self) -> None:
        self.pending: list[int] = []
        self._lock = threading.Lock()

    def _handle(self, signum: int, _frame: object) -> None:
        with self._lock:
            if signum not in self.pending:
                self.pending.append(signum)

    def install(self) -> None:
        """Handle the stop signals now; a thread re-sends them once the trainer listens."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        threading.Thread(target=self._redeliver, name="early-signals", daemon=True).start()

    def _redeliver(self) -> None:
        # The trainer installs its handlers (pretrain.signals.StopRequest) once the model and
        # data are ready; a signal received before that is sent again once they are in place.
        # When the trainer restores ours at the end, late signals are just recorded here.
        while True:
            time.sleep(0.1)
            with self._lock:
                for sig in list(self.pending):
                    handler = signal.getsignal(sig)
                    if getattr(handler, "__module__", None) == TRAINER_HANDLER_MODULE:
                        self.pending.remove(sig)
                        os.kill(os.getpid(), sig)


class ErrorLines:
    """A stderr that passes everything through and keeps the last line starting with
    `error`, without its `error: ` prefix (`error (rank N): x` becomes `rank N: x`)."""

    PATTERN = re.compile(r"error(?: \((rank \d+)\))?: (.*)")
    KEEP = 4096  # of a line without its end yet (a progress bar redraws with \r only)

    def __init__(self, stream) -> None:
        self.stream = stream
        self.partial = ""
        self.cause: str | None = None

    def write(self, text: str) -> int:
        written = self.stream.write(text)
        *lines, rest = (self.partial + text).split("\n")
        self.partial = rest[-self.KEEP:]
        for line in lines:
            found = self.PATTERN.match(line.strip())
            if found:
                rank, message = found.groups()
                self.cause = f"{rank}: {message}" if rank else message
        return written

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """Run `python -m pretrain` with `argv`; record the PID and the exit status."""
    early = EarlySignals()
    early.install()
    launch_dir = os.environ.get(LAUNCH_DIR_ENV)
    rank = os.environ.get("RANK", "0")
    if launch_dir:
        _write(Path(launch_dir) / f"rank-{rank}.pid", f"{os.getpid()}\n")
    errors = sys.stderr = ErrorLines(sys.stderr)

    try:
        status = pretrain_main(sys.argv[1:] if argv is None else argv)
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException as err:
        traceback.print_exc()
        errors.cause = (f"{type(err).__name__}: {err}".splitlines() or ["?"])[0]
        status = 1
    status = 0 if status is None else int(status)
    if launch_dir:
        if status not in (0, EXIT_PREEMPTED) and errors.cause:
            _write(Path(launch_dir) / f"rank-{rank}.cause", errors.cause[:1000] + "\n")
        _write(Path(launch_dir) / f"rank-{rank}.status", f"{status}\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
