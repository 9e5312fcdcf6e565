"""`python -m pretrain` whose STALL_AT_SAVE-th checkpoint stalls in its background write.

    STALL_AT_SAVE=2 STALL_MARKER=FILE python tests/stalled_save_train.py train --config ...

With checkpoint.async, that save's tensor file is written (by DCP, in the background) and
then, before the file is hashed and the checkpoint committed, the writer thread writes the
temporary directory's path into STALL_MARKER and sleeps: the save stays in flight, and a
test can SIGKILL the run there."""

import os
import sys
import time
from pathlib import Path

from pretrain import sharded_checkpoint
from pretrain.cli import main

_saves = 0
_written_files = sharded_checkpoint.written_files


def _stalling_written_files(directory, rank):
    global _saves
    _saves += 1
    if _saves == int(os.environ["STALL_AT_SAVE"]):
        Path(os.environ["STALL_MARKER"]).write_text(str(directory))
        time.sleep(3600)
    return _written_files(directory, rank)


sharded_checkpoint.written_files = _stalling_written_files

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
