"""How a training run saves and resumes: the collective protocol around one checkpoint.

Save (every rank calls `save_run`):

1. rank 0 creates `ckpt_root/.tmp-step-XXXXXXXX-*` and tells every rank its name;
2. every rank writes the tensors it owns into `tensors/` through DCP
   (pretrain/sharded_checkpoint.py) and hashes the file it wrote;
3. rank 0 gathers the ranks' (files, error) reports; with no error it writes `meta.json`
   (step, loader position, MLflow run id, fingerprint, layout: JSON, never a pickle), the
   manifest (last), renames the directory to `step-XXXXXXXX` and prunes; its verdict is
   broadcast, which is also the barrier, so every rank returns the path or raises SaveFailed
   with the first error at once.

Resume (`load_run`): the choice of checkpoint and the hashing of its files are made by all
ranks together before (pretrain/run_dir.py); here each rank reads its own slices.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from pretrain import checkpoint, sharded_checkpoint


class SaveFailed(RuntimeError):
    """A checkpoint could not be written (raised on every rank, with the first OS error)."""


def save_run(engine, ckpt_root: Path, step: int, meta: dict[str, Any], keep: int,
             protect: Path | None, rank: int, world: int) -> Path:
    """Write the checkpoint of `step` (collective); its path on every rank, or SaveFailed."""
    from torch.distributed.checkpoint.api import CheckpointException

    tmp_dir = Path(_agree(lambda: str(checkpoint.new_tmp_dir(ckpt_root, step)),
                          ckpt_root, step, rank, world))
    written, error = {}, None
    try:
        written = sharded_checkpoint.save(tmp_dir, engine.sharded_state(), rank)
    except (OSError, RuntimeError, CheckpointException) as err:  # DCP raises on every rank
        error = save_error(err, ckpt_root, step)
    reports = [(written, error)]
    if world > 1:
        reports = [None] * world if rank == 0 else None
        dist.gather_object((written, error), reports, dst=0)

    def commit() -> str:
        try:
            errors = [e for _, e in reports if e is not None]
            if errors:
                raise SaveFailed(errors[0])
            checkpoint.write_parts(tmp_dir, {"meta": meta})
            return str(checkpoint.finalize_checkpoint(
                tmp_dir, ckpt_root, step, keep=keep, protect=protect,
                hashed={rel: entry for files, _ in reports for rel, entry in files.items()}))
        except BaseException:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise

    return Path(_agree(commit, ckpt_root, step, rank, world))


def load_run(engine, path: Path, check: Callable[[dict], None] = lambda meta: None
             ) -> dict[str, Any]:
    """Read this rank's slices of checkpoint `path` into `engine` (collective); its meta.
    `check(meta)` runs first, so a run that differs is named before any tensor shape is.
    Sizes are checked here; the hashes were checked when the checkpoint was chosen."""
    manifest = checkpoint.read_manifest(path)
    checkpoint.require_current_format(path, manifest)
    meta = checkpoint.load_checkpoint(path, parts=["meta"], verify_hashes=False)["meta"]
    check(meta)
    engine.load_sharded_state(path, manifest)
    return meta


def _agree(fn: Callable[[], str], ckpt_root: Path, step: int, rank: int, world: int) -> str:
    """`fn()` on rank 0; its result on every rank, or SaveFailed with its error on every rank."""
    outcome = [None, None]  # [result, error message]
    if rank == 0:
        try:
            outcome[0] = fn()
        except SaveFailed as err:
            outcome[1] = str(err)
        except (OSError, RuntimeError) as err:  # torch.save reports I/O as RuntimeError
            outcome[1] = save_error(err, ckpt_root, step)
    if world > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise SaveFailed(outcome[1])
    return outcome[0]


def save_error(err: BaseException, ckpt_root: Path, step: int) -> str:
    """What a failed checkpoint write tells the user: the path, the OS error, what is kept."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(err, CheckpointException):  # DCP wraps each rank's error: show an OS one
        failures = sorted(err.failures.items())
        err = next((e for _, (e, *_) in failures if isinstance(e, OSError)), failures[0][1][0])
    if isinstance(err, OSError):
        name = errno.errorcode.get(err.errno, "")
        where = f" ({err.filename})" if err.filename else ""
        what = f"{err.strerror or err} [{name}]{where}"
    else:
        what = f"{type(err).__name__}: {err}"
    return (f"cannot write the checkpoint of step {step} into {ckpt_root}: {what}; the "
            f"previous checkpoint {checkpoint.latest_checkpoint(ckpt_root)} is intact")
