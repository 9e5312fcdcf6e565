"""`python -m pretrain` with a real full disk at one checkpoint save of rank 0.

    ENOSPC_AT_SAVE=2 python tests/enospc_train.py train --config ... (or under torchrun)

The ENOSPC_AT_SAVE-th save gets rank 0's (ENOSPC_RANK's, if set) tensor file in its temporary
directory as a symlink to /dev/full, so the write fails in the kernel with ENOSPC exactly as on
a full file system (root ignores permission bits, so an unwritable directory cannot stand in
for it)."""

import os
import sys

from pretrain import checkpoint
from pretrain.cli import main

_saves = 0
_new_tmp_dir = checkpoint.new_tmp_dir


def _new_tmp_dir_on_a_full_disk(ckpt_root, step):
    global _saves
    tmp_dir = _new_tmp_dir(ckpt_root, step)
    _saves += 1
    if _saves == int(os.environ["ENOSPC_AT_SAVE"]):  # rank 0 creates the directory
        (tmp_dir / "tensors").mkdir()
        rank = os.environ.get("ENOSPC_RANK", "0")
        os.symlink("/dev/full", tmp_dir / f"tensors/__{rank}_0.distcp")
    return tmp_dir


checkpoint.new_tmp_dir = _new_tmp_dir_on_a_full_disk

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
