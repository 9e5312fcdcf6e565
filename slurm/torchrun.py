"""torchrun as the node launcher runs it: `python -m slurm.torchrun <torchrun arguments>`.

torch.distributed.run itself, except that a failed rank ends it with one line per failed rank
instead of a ~30-line `ChildFailedError` traceback: the rank has already said why it failed,
and that cause must stay the last thing in the job's log (slurm/launch.py prints it again at
the end). A rank killed by a signal (no line of its own: the OOM killer, SIGKILL) gets its
cause written here, into $DENSEFORMER_LAUNCH_DIR/rank-<rank>.cause. Exit status 1, as
torchrun's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from slurm.worker import LAUNCH_DIR_ENV


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with `argv`; 0, or 1 after one line per failed rank."""
    # deferred: pulls in torch (slow to start, or optional)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as err:
        launch_dir = os.environ.get(LAUNCH_DIR_ENV)
        for rank, failure in sorted(err.failures.items()):
            if failure.exitcode < 0:
                cause = (f"rank {rank} was killed by {failure.signal_name()} (out of memory, "
                         "or killed by hand?)")
                if launch_dir and not (Path(launch_dir) / f"rank-{rank}.cause").exists():
                    (Path(launch_dir) / f"rank-{rank}.cause").write_text(cause + "\n")
            else:
                cause = f"rank {rank} exited with status {failure.exitcode}"
            print(f"torchrun: {cause} (pid {failure.pid})", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
