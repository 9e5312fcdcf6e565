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

Asynchronous saves (`checkpoint.async`) run steps 2 and 3 in the background: `Checkpointer`.

Resume (`load_run`): the choice of checkpoint and the hashing of its files are made by all
ranks together before (pretrain/run_dir.py); here each rank reads its own slices.
"""

from __future__ import annotations

import os
import shutil
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from pretrain import checkpoint, sharded_checkpoint
from pretrain.run_files import describe_os_error


class SaveFailed(RuntimeError):
    """A checkpoint could not be written (raised on every rank, with the first OS error)."""


def save_run(engine, ckpt_root: Path, step: int, meta: dict[str, Any],
             retention: checkpoint.Retention, rank: int, world: int) -> Path:
    """Write the checkpoint of `step` (collective); its path on every rank, or SaveFailed.
    Rank 0 prunes after the commit as `retention` says."""
    tmp_dir = _new_tmp_dir(ckpt_root, step, rank, world)
    written, error = {}, None
    try:
        written = sharded_checkpoint.save(tmp_dir, engine.sharded_state(), rank)
    except (OSError, RuntimeError, CheckpointException) as err:  # DCP raises on every rank
        error = save_error(err, ckpt_root, step, tmp_dir)
    return commit(tmp_dir, written, error, ckpt_root, step, meta, retention, rank, world)


def _new_tmp_dir(ckpt_root: Path, step: int, rank: int, world: int) -> Path:
    return Path(_agree(lambda: str(checkpoint.new_tmp_dir(ckpt_root, step)),
                       ckpt_root, step, rank, world))


def commit(tmp_dir: Path, written: dict, error: str | None, ckpt_root: Path, step: int,
           meta: dict[str, Any], retention: checkpoint.Retention, rank: int, world: int,
           group=None) -> Path:
    """Step 3 of the module doc, collective over `group` (None: the default one):
    the final path on every rank, or SaveFailed with the first rank's error."""
    reports = [(written, error)]
    if world > 1:
        reports = [None] * world if rank == 0 else None
        dist.gather_object((written, error), reports, dst=0, group=group)

    def finish() -> str:
        try:
            errors = [e for _, e in reports if e is not None]
            if errors:
                raise SaveFailed(errors[0])
            checkpoint.write_meta(tmp_dir, meta)
            return str(checkpoint.finalize_checkpoint(
                tmp_dir, ckpt_root, step, retention,
                hashed={rel: entry for files, _ in reports for rel, entry in files.items()}))
        except BaseException:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise

    return Path(_agree(finish, ckpt_root, step, rank, world, group))


class Checkpointer:
    """The saves of one run, synchronous or asynchronous (`checkpoint.async`).

    Asynchronous: `save` agrees on the temporary directory, copies what this rank writes to
    host memory (`sharded_checkpoint.host_copy`) and returns; DCP's `async_save` writes it
    in a background thread, whose collectives run on a process group of their own (gloo,
    created here, with parallel.timeout_s), so they never interleave with the training
    loop's; a second background thread then hashes the file and commits as `commit` does,
    on that group too (rank 0 writes the manifest, renames, prunes). The trainer calls
    `poll` at every step boundary: one all-reduce of (not done, failed) while a save is in
    flight, so every rank learns at the same step that it committed, or raises SaveFailed
    with the first error. A new save, a stop and the end of training `wait` for the commit
    first; the run-directory lock is released only after it (`close`)."""

    def __init__(self, engine, ckpt_root: Path, layout, asynchronous: bool,
                 timeout_s: float):
        self.engine, self.ckpt_root, self.layout = engine, Path(ckpt_root), layout
        self.asynchronous = asynchronous
        self.group = None
        if asynchronous and dist.is_initialized():
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.pending: tuple[int, Future] | None = None  # (step, future of the final path)
        # The last save's host copy, reused by the next once that one has committed: one
        # share of (pinned) host memory held for the run, as DCP's cache_staged_state_dict.
        self.staged: dict | None = None
        # Called with the path of each checkpoint once complete on disk (on every rank).
        self.on_commit: Callable[[Path], None] = lambda path: None
        self.intact: dict[Path, tuple] = {}  # hash verdicts of pruning (checkpoint.Retention)

    def save(self, step: int, meta: dict[str, Any], keep: int,
             protect: Callable[[], Iterable[Path]] = tuple) -> Path:
        """Write the checkpoint of `step` after the previous one committed; its final path.
        Synchronous: committed on return, or SaveFailed. Asynchronous: on its way; `poll`
        or `wait` tell when it committed. The commit prunes to the newest `keep` intact
        checkpoints, never one that `protect()`, called at the commit, names."""
        self.wait()
        rank, world = self.layout.rank, self.layout.world
        retention = checkpoint.Retention(keep, protect, self.intact)
        if not self.asynchronous:
            path = save_run(self.engine, self.ckpt_root, step, meta, retention, rank, world)
            self.on_commit(path)
            return path

        tmp_dir = _new_tmp_dir(self.ckpt_root, step, rank, world)
        try:
            self.staged = sharded_checkpoint.host_copy(self.engine.sharded_state(),
                                                       self.layout.dp_rank, self.layout.dp,
                                                       reuse=self.staged)
            upload = sharded_checkpoint.save_async(tmp_dir, self.staged, self.group)
        except (OSError, RuntimeError, CheckpointException) as err:
            upload = Future()
            upload.set_exception(err)

        def finish() -> Path:  # in the background
            written, error = {}, None
            try:
                upload.result()
                written = sharded_checkpoint.written_files(tmp_dir, rank)
            except (OSError, RuntimeError, CheckpointException) as err:
                error = save_error(err, self.ckpt_root, step, tmp_dir)
            return commit(tmp_dir, written, error, self.ckpt_root, step, meta, retention,
                          rank, world, self.group)

        committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-commit")
        self.pending = (step, committer.submit(finish))
        committer.shutdown(wait=False)
        return checkpoint.checkpoint_dir(self.ckpt_root, step)

    def poll(self) -> Path | None:
        """At a step boundary (collective while a save is in flight): the path of the
        checkpoint that every rank has now seen commit (after `on_commit`), or None;
        SaveFailed on every rank if its write failed on any."""
        return self._settle(block=False)

    def wait(self) -> Path | None:
        """Block until the save in flight commits (collective); as `poll`."""
        return self._settle(block=True)

    def _settle(self, block: bool) -> Path | None:
        if self.pending is None:
            return None
        step, future = self.pending
        if block:
            futures.wait([future])
        done = future.done()
        failed = done and future.exception() is not None
        flags = torch.tensor([0.0 if done else 1.0, 1.0 if failed else 0.0],
                             device=self.layout.device)
        if self.layout.world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0].item():
            return None
        self.pending = None
        if flags[1].item():
            error = future.exception()
            raise SaveFailed(str(error) if error is not None else
                             f"the checkpoint of step {step} failed on another rank")
        self.on_commit(future.result())
        return future.result()

    def close(self) -> None:
        """Wait for a save in flight, without the other ranks (the run ends on an error)."""
        if self.pending is not None:
            futures.wait([self.pending[1]])
            self.pending = None


def load_run(engine, path: Path, check: Callable[[dict], None] = lambda meta: None
             ) -> dict[str, Any]:
    """Read this rank's slices of checkpoint `path` into `engine` (collective); its meta.
    `check(meta)` runs first, so a run that differs is named before any tensor shape is.
    Sizes are checked here; the hashes were checked when the checkpoint was chosen."""
    manifest = checkpoint.read_manifest(path)
    meta = checkpoint.read_meta(path, manifest=manifest)
    check(meta)
    engine.load_sharded_state(path, manifest)
    return meta


def _agree(fn: Callable[[], str], ckpt_root: Path, step: int, rank: int, world: int,
           group=None) -> str:
    """`fn()` on rank 0; its result on every rank, or SaveFailed with its error on every rank
    (collective over `group`, None: the default one)."""
    outcome = [None, None]  # [result, error message]
    if rank == 0:
        try:
            outcome[0] = fn()
        except SaveFailed as err:
            outcome[1] = str(err)
        except (OSError, RuntimeError) as err:  # torch.save reports I/O as RuntimeError
            outcome[1] = save_error(err, ckpt_root, step)
    if world > 1:
        dist.broadcast_object_list(outcome, src=0, group=group)
    if outcome[1] is not None:
        raise SaveFailed(outcome[1])
    return outcome[0]


def save_error(err: BaseException, ckpt_root: Path, step: int,
               tmp_dir: Path | None = None) -> str:
    """What a failed checkpoint write tells the user: the OS error and its file, what is
    kept. torch's writers report a full disk as their own RuntimeError ("unexpected pos"):
    the OSError is then found in its exception chain, or, failing that, in the free space
    left on the checkpoint's file system."""
    file = None
    if isinstance(err, CheckpointException):  # DCP wraps each rank's error: show an OS one
        failures = sorted(err.failures.items())
        rank, (err, *_) = next(((r, f) for r, f in failures if _os_error_in(f[0])),
                               failures[0])
        if tmp_dir is not None:
            file = Path(tmp_dir) / sharded_checkpoint.TENSOR_DIR / f"__{rank}_0.distcp"
    os_error = _os_error_in(err)
    if os_error is not None:
        what = describe_os_error(os_error, os_error.filename or file or tmp_dir)
    elif _nearly_full(ckpt_root):
        what = (f"No space left on device [ENOSPC] ({file or tmp_dir or ckpt_root}), under "
                f"{LOW_SPACE >> 20} MiB free there (torch's writer said only "
                f"{type(err).__name__}: {err})")
    else:
        what = f"{type(err).__name__}: {err}"
    return (f"cannot write the checkpoint of step {step} into {ckpt_root}: {what}; the "
            f"previous checkpoint {checkpoint.latest_checkpoint(ckpt_root)} is intact")


LOW_SPACE = 1 << 20  # a write that failed with less free than this failed for want of space


def _os_error_in(err: BaseException) -> OSError | None:
    """The first OSError among `err` and the exceptions it was raised from or during."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _nearly_full(directory: Path) -> bool:
    try:
        stat = os.statvfs(directory)
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize < LOW_SPACE
