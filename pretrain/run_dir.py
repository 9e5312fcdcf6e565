"""The run directory: its lock, the start-time checks, and which checkpoint a run resumes.

Rank 0 alone touches the directory here and broadcasts what it found (a path, or the error
message), so every rank decides the same thing: all resume from one checkpoint, or all
exit 2 with one message.

The lock is an `fcntl` lock on `run_dir/.lock`, held for the run's life. The kernel drops it
when the holding process dies, however it dies, so a requeued Slurm job is never locked out
by a dead holder; the file's text (host, PID, Slurm job id) is only for the message. On
NFSv4 the server arbitrates such locks between clients (a crashed client's lock lapses with
its lease); on Lustre only when mounted with `-o flock` (with `localflock`, two nodes do not
see each other's locks); where the file system refuses locks, the run continues with a
warning that the directory is unprotected.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from data_pipeline import DataError
from data_pipeline.tokenizer import copy_tokenizer, find_tokenizer_file
from pretrain import checkpoint
from pretrain.config import ConfigError
from pretrain.model.config import DenseFormerConfig
from pretrain.run_files import describe_os_error

LOCK_FILE = ".lock"
PROBE_BYTES = 64 << 10  # what the start-up probe writes: room for config.yaml and more


class RunDirLocked(ConfigError):
    """Another live process holds the run directory."""


class RunDirLock:
    """An exclusive, non-blocking lock on a run directory; `release()` or process exit frees it."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise RunDirLocked naming the holder."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)  # less the umask
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _read_holder(self.path)
            os.close(fd)
            if err.errno in (errno.EACCES, errno.EAGAIN):
                raise RunDirLocked("run.dir", f"{self.path.parent} is in use by another run "
                                   f"({holder}); wait for it to end or choose another "
                                   "run.dir") from None
            print(f"warning: cannot lock {self.path} ({os.strerror(err.errno)}): this file "
                  "system does not support fcntl locks, so nothing stops a second run from "
                  "using this run directory", file=sys.stderr, flush=True)
            return
        self._fd = fd
        try:
            os.ftruncate(fd, 0)
            os.write(fd, _holder_text().encode())
        except OSError as err:  # the lock holds; only the holder's description is lost
            print(f"warning: cannot write the lock holder into {self.path}: "
                  f"{describe_os_error(err)}", file=sys.stderr, flush=True)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None


def _holder_text() -> str:
    job = os.environ.get("SLURM_JOB_ID")
    return f"host {socket.gethostname()}, PID {os.getpid()}" + (f", Slurm job {job}" if job
                                                                 else "")


def _read_holder(path: Path) -> str:
    try:
        text = path.read_text().strip()
    except OSError:
        text = ""
    return text or "holder unknown"


def check_writable(directory: Path, key: str) -> None:
    """Create `directory` and write a probe file into it, or raise ConfigError naming it.

    A real write, not os.access: root passes access checks on read-only mounts. Some data,
    fsynced: creating an empty file succeeds on a full disk."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-probe-") as probe:
            probe.write(bytes(PROBE_BYTES))
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as err:
        code = errno.errorcode.get(err.errno, "")
        raise ConfigError(key, f"{directory} is not writable: {err.strerror} ({code})") from None


def _candidates(ckpt_dir: Path, resume: str | None) -> list[str]:
    """The checkpoints a run with `train.resume = resume` may start from, best first
    (rank 0 only; their files are checked next, by every rank)."""
    found = checkpoint.list_checkpoints(ckpt_dir)
    if resume is None:
        if found:
            raise ConfigError("train.resume", f"run.dir {ckpt_dir.parent} already holds "
                              f"checkpoints ({found[-1][1].name}, ...): set train.resume=auto "
                              "to continue that run, or choose another run.dir")
        return []
    if resume != "auto":
        if not Path(resume).is_dir():
            raise ConfigError("train.resume", f"checkpoint {resume} does not exist")
        return [resume]
    return [str(path) for _, path in reversed(found)]


def first_intact(candidates: list[str], resume: str | None, ckpt_dir: Path, rank: int,
                  world: int) -> Path | None:
    """The first candidate whose files all have their sizes and sha256: every rank hashes
    its share of the files (`checkpoint.verify_share`) and all agree on the verdict."""
    rejected = []
    for path in candidates:
        mine = checkpoint.verify_share(Path(path), rank, world)
        problems = [mine]
        if world > 1:
            problems = [None] * world
            dist.all_gather_object(problems, mine)
        problem = next((p for p in problems if p is not None), None)
        if problem is None:
            if rank == 0:
                for reason in rejected:
                    print(f"warning: not resuming from a newer checkpoint: {reason}; using "
                          f"{path}", file=sys.stderr, flush=True)
            return Path(path)
        if resume != "auto":
            raise checkpoint.CheckpointError(problem)
        rejected.append(problem)
    if candidates:
        raise checkpoint.CheckpointError(
            f"train.resume=auto: no intact checkpoint in {ckpt_dir}, refusing to restart from "
            "step 0 over it: " + "; ".join(rejected) + ". Move the directory away to start "
            "afresh, or resume from another checkpoint with train.resume=PATH")
    return None


def agreed_on_rank0(fn: Callable[[], Any], is_main: bool, world: int) -> Any:
    """Run `fn` on rank 0 alone; every rank returns its (picklable) result, or raises the
    ConfigError / CheckpointError it raised, so no rank goes on while another exits 2."""
    outcome = [None, None]  # [result, (error type, message, key)]
    if is_main:
        try:
            outcome[0] = fn()
        except (ConfigError, checkpoint.CheckpointError) as err:
            outcome[1] = (type(err).__name__, str(err), getattr(err, "key", None))
    if world > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is None:
        return outcome[0]
    kind, message, key = outcome[1]
    if kind == "CheckpointError":
        raise checkpoint.CheckpointError(message)
    raise ConfigError(key, message.removeprefix(f"{key}: "))


def prepare_run_dir(run_dir: Path, ckpt_dir: Path, resume: str | None, is_main: bool,
                    world: int, tokenizer: tuple[Path, str]
                    ) -> tuple[RunDirLock | None, Path | None]:
    """Rank 0: create and lock run_dir, check it and ckpt_dir are writable, list the
    checkpoints to resume from, keep a copy of the `tokenizer` (path, sha256) the run trains
    with; then every rank verifies its share of the checkpoints' files (all ranks call this)
    and all get the same choice, or the same error."""
    lock = RunDirLock(run_dir) if is_main else None

    def prepare() -> list[str]:
        check_writable(run_dir, "run.dir")
        lock.acquire()
        try:
            check_writable(ckpt_dir, "run.dir")
            candidates = _candidates(ckpt_dir, resume)
            _keep_tokenizer(run_dir, *tokenizer, fresh=not candidates)
            return candidates
        except BaseException:
            lock.release()
            raise

    candidates = agreed_on_rank0(prepare, is_main, world)
    try:
        path = first_intact(candidates, resume, ckpt_dir, dist.get_rank() if world > 1
                             else 0, world)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock, path


def _keep_tokenizer(run_dir: Path, path: Path, sha256: str, fresh: bool) -> None:
    """Copy the run's tokenizer into run_dir, for `load_model` and `generate`. A fresh run
    replaces any copy there; a resumed one keeps its own (a different tokenizer is then
    named by the checkpoint's fingerprint check) and gains one if it had none."""
    if not fresh and find_tokenizer_file(run_dir) is not None:
        return
    try:
        copy_tokenizer(path, run_dir, sha256, replace=fresh)
    except DataError as err:
        raise ConfigError("data.path", str(err)) from None
    except OSError as err:
        raise ConfigError("run.dir", f"cannot copy the tokenizer {path} into {run_dir}: "
                          f"{describe_os_error(err)}") from None


# Model keys that say how the model or its step is computed, not what the model is: a run
# may resume or start from a checkpoint written with another value (on another device, say).
NOT_FINGERPRINTED = ("loss_chunk_tokens", "dwa_impl")


def fingerprint(model_section: dict[str, Any], tokenizer_sha256: str, seed: int) -> dict:
    """What a checkpoint must agree on with the run that resumes it."""
    model = {k: v for k, v in model_section.items() if k not in NOT_FINGERPRINTED}
    return {"model": model, "tokenizer_sha256": tokenizer_sha256, "seed": seed}


def saved_model_section(section: dict) -> dict:
    """A checkpoint's model section with the model keys added since it was written at their
    defaults, which is what its model had (gpt blocks, a tied head, ...)."""
    defaults = {f.name: f.default for f in dataclasses.fields(DenseFormerConfig)
                if f.default is not dataclasses.MISSING and f.name not in NOT_FINGERPRINTED}
    return {**defaults, **section}


def fingerprint_mismatch(saved: dict, current: dict) -> list[str]:
    """The dotted keys on which two fingerprints differ, as 'key: saved -> now' (model keys
    the checkpoint predates count as their defaults)."""
    if isinstance(saved.get("model"), dict):
        saved = {**saved, "model": saved_model_section(saved["model"])}
    differ = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            differ += [f"{key}.{line}" for line in fingerprint_mismatch(a, b)]
        elif a != b:
            differ.append(f"{key}: {a!r} in the checkpoint, {b!r} now")
    return differ
