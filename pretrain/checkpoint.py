"""Atomic, self-verifying checkpoints.

Layout of one checkpoint (`ckpt_root/step-00001000/`), format 2, written by the trainer at
any layout and by one process (`sharded_checkpoint.write_checkpoint`) alike:

    manifest.json    written last: {"format", "step", "created", "parts": {name: file},
                     "files": {relative path: {"bytes", "sha256"}}}
    meta.json        the part named "meta": JSON (step, loader, MLflow run id, fingerprint,
                     the layout it was written at)
    tensors/         the part named "tensors": model and AdamW tensors written by every rank
                     through torch.distributed.checkpoint (pretrain/sharded_checkpoint.py):
                     `.metadata` (DCP's index) and `__<rank>_0.distcp` (what that rank owned)

Any other format is refused by every reader, naming its version: format 1 (`model.pt`,
`optimizer.pt`: full tensors written with torch.save, before sharded checkpoints) is no
longer read; `python -m pretrain checkpoint convert` at commit 8c1caaa or earlier turns one
into format 2.

A checkpoint is written into `ckpt_root/.tmp-step-XXXXXXXX-<random>/`, every file fsynced,
the manifest written last, then the directory is renamed to its final name: a reader sees
either no checkpoint or a complete one. A directory without a readable manifest, or whose
files disagree with it, is not a checkpoint. Every rank writes its tensors into one shared
temporary directory (`new_tmp_dir`); after a barrier one rank writes the meta (`write_meta`)
and commits it (`finalize_checkpoint`); the manifest covers the files of subdirectories
(DCP's) too, each rank hashing the files it wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from pretrain.run_files import umask_dir_mode

MANIFEST = "manifest.json"
FORMAT_VERSION = 2  # a "meta" part (JSON) and a "tensors" part (DCP)
META_FILE = "meta.json"
LAST_CONVERTER = "8c1caaa"  # the last commit with `checkpoint convert` (format 1 -> 2)
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the file."""


def checkpoint_dir(ckpt_root: Path, step: int) -> Path:
    """Final directory of the checkpoint taken after `step`."""
    return Path(ckpt_root) / f"step-{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            digest.update(chunk)
    return digest.hexdigest()


def new_tmp_dir(ckpt_root: Path, step: int) -> Path:
    """A fresh temporary directory in `ckpt_root` to write the checkpoint of `step` into."""
    ckpt_root = Path(ckpt_root)
    ckpt_root.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".tmp-step-{step:08d}-", dir=ckpt_root))
    umask_dir_mode(tmp_dir)  # the checkpoint's mode as mkdir gives, not mkdtemp's 0o700
    return tmp_dir


def write_meta(directory: Path, meta: dict[str, Any]) -> None:
    """Write (and fsync) the part "meta", `meta` as JSON, into `directory`."""
    try:
        data = json.dumps(meta, indent=1).encode()
    except (TypeError, ValueError) as err:
        raise TypeError(f"checkpoint part 'meta' is not JSON-serialisable: {err}") from err
    with open(Path(directory) / META_FILE, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_manifest(tmp_dir: Path, step: int,
                   hashed: dict[str, dict] | None = None) -> dict[str, Any]:
    """Write (and fsync) the manifest of every file in `tmp_dir`, last; the manifest.
    `hashed`: {relative path: {"bytes", "sha256"}} the ranks computed for the files they
    wrote (the rest are hashed here)."""
    tmp_dir = Path(tmp_dir)
    files, parts = {}, {}
    hashed = hashed or {}
    for path in sorted(p for p in tmp_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(tmp_dir).as_posix()
        size = path.stat().st_size
        if rel in hashed and hashed[rel]["bytes"] != size:
            raise OSError(f"{path}: {size} bytes on disk, its writer reported "
                          f"{hashed[rel]['bytes']}")
        files[rel] = hashed.get(rel) or {"bytes": size, "sha256": sha256_file(path)}
        if rel == META_FILE:
            parts["meta"] = rel
        elif path.name == ".metadata" and path.parent.parent == tmp_dir:  # a DCP directory
            parts[path.parent.name] = path.parent.name
    if sorted(parts) != ["meta", "tensors"]:
        raise CheckpointError(f"{tmp_dir}: parts {sorted(parts)}, a checkpoint of format "
                              f"{FORMAT_VERSION} has meta and tensors")
    manifest = {"format": FORMAT_VERSION, "step": step,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "parts": parts, "files": files}
    with open(tmp_dir / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    for directory in sorted({p.parent for p in tmp_dir.rglob("*")} | {tmp_dir}):
        _fsync_dir(directory)
    return manifest


def finalize_checkpoint(tmp_dir: Path, ckpt_root: Path, step: int, retention: Retention,
                        hashed: dict[str, dict] | None = None) -> Path:
    """Write the manifest into `tmp_dir`, rename it to step-XXXXXXXX, prune as `retention`
    says (never this checkpoint); the final path. `hashed`: {relative path: {"bytes",
    "sha256"}} other ranks computed for the files they wrote (the rest are hashed here)."""
    tmp_dir, ckpt_root = Path(tmp_dir), Path(ckpt_root)
    write_manifest(tmp_dir, step, hashed)
    final = checkpoint_dir(ckpt_root, step)
    old = None
    if final.exists():  # the same step saved again (e.g. after a resume): replace it
        old = Path(tempfile.mkdtemp(prefix=f".trash-{final.name}-", dir=ckpt_root))
        os.rename(final, old / final.name)
    os.rename(tmp_dir, final)
    _fsync_dir(ckpt_root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    retention.prune(ckpt_root, written=final)
    return final


def read_manifest(path: Path, verify_hashes: bool = False) -> dict[str, Any]:
    """The manifest of checkpoint `path`, after checking that every file exists with its size
    (and sha256 if `verify_hashes`); raises CheckpointError naming the offending file."""
    path = Path(path)
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{manifest_path}: missing (incomplete checkpoint)") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({err})") from None
    if not (isinstance(manifest, dict) and isinstance(manifest.get("files"), dict)
            and isinstance(manifest.get("parts"), dict)):
        raise CheckpointError(f"{manifest_path}: not a checkpoint manifest")
    for rel, info in manifest["files"].items():
        file = path / rel
        if not (isinstance(info, dict) and "bytes" in info and "sha256" in info):
            raise CheckpointError(f"{manifest_path}: bad entry for {rel!r}")
        try:
            size = file.stat().st_size
        except OSError:
            raise CheckpointError(f"{file}: listed in the manifest but missing") from None
        if size != info["bytes"]:
            raise CheckpointError(f"{file}: {size} bytes, the manifest says {info['bytes']}")
        if verify_hashes and sha256_file(file) != info["sha256"]:
            raise CheckpointError(f"{file}: sha256 differs from the manifest (corrupt)")
    _check_listed(path, manifest)
    return manifest


def _check_listed(path: Path, manifest: dict[str, Any]) -> None:
    """CheckpointError unless the manifest vouches for every file a reader of its parts
    opens: a part's file, and all the files of a DCP directory (its `.metadata`, a pickle,
    above all)."""
    for name, rel in manifest["parts"].items():
        if not isinstance(rel, str):
            raise CheckpointError(f"{path / MANIFEST}: bad entry for part {name!r}")
        if (path / rel).is_dir():
            on_disk = [p.relative_to(path).as_posix() for p in (path / rel).rglob("*")
                       if p.is_file()]
            wanted = sorted({f"{rel}/.metadata", *on_disk})
        else:
            wanted = [rel]
        for file in wanted:
            if file not in manifest["files"]:
                raise CheckpointError(f"{path / MANIFEST}: does not list {file} (part "
                                      f"{name!r}), so nothing vouches for its contents")


def list_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    """(step, path) of the step-XXXXXXXX directories in `ckpt_root`, complete or not, by step."""
    ckpt_root = Path(ckpt_root)
    if not ckpt_root.is_dir():
        return []
    found = []
    for path in ckpt_root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def _is_complete(path: Path, verify_hashes: bool) -> bool:
    try:
        read_manifest(path, verify_hashes)
    except CheckpointError:
        return False
    return True


def latest_checkpoint(ckpt_root: Path, verify_hashes: bool = False) -> Path | None:
    """The newest complete checkpoint in `ckpt_root` (sizes checked; hashes if asked), or None."""
    for _, path in reversed(list_checkpoints(ckpt_root)):
        if _is_complete(path, verify_hashes):
            return path
    return None


def newest_intact(ckpt_root: Path) -> Path | None:
    """The newest checkpoint in `ckpt_root` whose files all have their sizes and sha256, as
    `train.resume=auto` picks it, for the commands that read a run (eval, generate, export);
    a warning on stderr names each newer one passed over and why. None if there is no step
    directory; CheckpointError naming each if none is intact."""
    rejected = []
    for _, path in reversed(list_checkpoints(ckpt_root)):
        try:
            read_manifest(path, verify_hashes=True)
        except CheckpointError as err:
            rejected.append(str(err))
            continue
        for reason in rejected:
            print(f"warning: not reading a newer checkpoint: {reason}; using {path}",
                  file=sys.stderr, flush=True)
        return path
    if rejected:
        raise CheckpointError(f"no intact checkpoint in {ckpt_root}: " + "; ".join(rejected))
    return None


class Retention:
    """Which checkpoints a run's commits delete: those older than `keep` newer checkpoints
    (0: none is deleted) that are each verified intact by their sha256, as a resume verifies
    them. Never the newest intact one, the one just written, nor one `protect()` names, asked
    at commit time (the checkpoint resumed from, the last one before a streak of skipped
    steps); a directory that is not a complete checkpoint is left for a person to look at.
    Hash verdicts are remembered for the run (`intact`), so each checkpoint is read once."""

    def __init__(self, keep: int, protect: Callable[[], Iterable[Path]] = tuple,
                 intact: dict[Path, tuple] | None = None):
        self.keep, self.protect = keep, protect
        self.intact = {} if intact is None else intact  # path -> identity of its manifest

    def prune(self, ckpt_root: Path, written: Path | None = None) -> list[Path]:
        """Delete stale temporary directories and the checkpoints that may go; those."""
        ckpt_root = Path(ckpt_root)
        for path in ckpt_root.iterdir():
            # One writer per run directory (the run-directory lock, pretrain/run_dir.py): any
            # temp dir still here was left by a killed save.
            if path.is_dir() and path.name.startswith((".tmp-step-", ".trash-step-")):
                shutil.rmtree(path, ignore_errors=True)
        if self.keep <= 0:
            return []
        protected = {Path(p).resolve() for p in (*self.protect(), *([written] if written
                                                                      else []))}
        deleted, verified_newer = [], 0
        for _, path in reversed(list_checkpoints(ckpt_root)):
            if verified_newer < self.keep:
                verified_newer += self._verified(path)
            elif path.resolve() not in protected and _is_complete(path, False):
                shutil.rmtree(path, ignore_errors=True)
                deleted.append(path)
        return deleted

    def _verified(self, path: Path) -> bool:
        """Whether checkpoint `path` is intact, hashes checked (once while unchanged)."""
        try:
            stat = (path / MANIFEST).stat()
        except OSError:
            return False
        identity = (stat.st_dev, stat.st_ino, stat.st_mtime_ns, stat.st_size)
        key = path.resolve()
        if self.intact.get(key) == identity:
            return True
        if not _is_complete(path, verify_hashes=True):
            return False
        self.intact[key] = identity
        return True


def read_meta(path: Path, verify_hashes: bool = True,
              manifest: dict[str, Any] | None = None) -> dict[str, Any]:
    """The part "meta" of checkpoint `path` (its `manifest` if already read); CheckpointError
    if it is incomplete or of another format. Its tensors are read by
    `pretrain.sharded_checkpoint`."""
    path = Path(path)
    manifest = read_manifest(path, verify_hashes) if manifest is None else manifest
    require_current_format(path, manifest)
    file = path / manifest["parts"]["meta"]
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{file}: cannot be loaded ({err})") from err


def require_current_format(path: Path, manifest: dict[str, Any]) -> None:
    """CheckpointError, naming the version, unless `manifest` (of `path`) is of format 2."""
    version = manifest.get("format", 1)  # the first manifests had no "format" key
    if version != FORMAT_VERSION or sorted(manifest["parts"]) != ["meta", "tensors"]:
        old = version == 1 and "tensors" not in manifest["parts"]
        raise CheckpointError(
            f"{path} is a checkpoint of format {version} (parts "
            f"{', '.join(sorted(manifest['parts']))}); this version reads format "
            f"{FORMAT_VERSION} only" + (
                f". Format 1 was written before sharded checkpoints: convert it with "
                f"`python -m pretrain checkpoint convert {path} --out NEW` at commit "
                f"{LAST_CONVERTER} or earlier" if old else ""))


def hash_share(files: dict[str, dict], rank: int, world: int) -> list[str]:
    """The files (relative paths) rank `rank` of `world` hashes: bytes balanced greedily,
    largest first, the same assignment on every rank."""
    loads = [0] * world
    mine = []
    for rel in sorted(files, key=lambda r: (-files[r]["bytes"], r)):
        owner = loads.index(min(loads))
        loads[owner] += files[rel]["bytes"]
        if owner == rank:
            mine.append(rel)
    return mine


def verify_share(path: Path, rank: int, world: int) -> str | None:
    """Check sizes of all files of checkpoint `path` and the sha256 of this rank's share;
    the first problem as a message, or None if intact."""
    try:
        manifest = read_manifest(path, verify_hashes=False)
        for rel in hash_share(manifest["files"], rank, world):
            if sha256_file(Path(path) / rel) != manifest["files"][rel]["sha256"]:
                raise CheckpointError(f"{Path(path) / rel}: sha256 differs from the manifest "
                                      "(corrupt)")
    except (CheckpointError, OSError) as err:
        return str(err)
    return None
