"""`python -m pretrain` whose checkpoint commits each take COMMIT_DELAY_S seconds longer.

    COMMIT_DELAY_S=1.5 python tests/slow_commit_train.py train --config ...

Rank 0 sleeps before writing each manifest: with checkpoint.async the commit then ends after
the next steps have run, as a slow file system makes it on a GPU."""

import os
import sys
import time

from pretrain import checkpoint
from pretrain.cli import main

_finalize_checkpoint = checkpoint.finalize_checkpoint


def _slow_finalize_checkpoint(*args, **kwargs):
    time.sleep(float(os.environ["COMMIT_DELAY_S"]))
    return _finalize_checkpoint(*args, **kwargs)


checkpoint.finalize_checkpoint = _slow_finalize_checkpoint

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
