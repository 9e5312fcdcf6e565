"""Run files (config.yaml, metrics.jsonl) written whole or not at all, and disk errors named.

`write_atomic` writes a temporary file beside the target, fsyncs it and renames it over the
target: a reader sees the old file or the new one, never a cut-off one, and a full disk
leaves the old file and no temporary behind. Files get the permissions the process umask
gives (0o666 masked), as a plain `open` would, not `mkstemp`'s 0o600; `umask_dir_mode`
does the same for directories made by `mkdtemp` (0o700).

`AppendLog` appends whole lines: a line that cannot be written completely is cut back off,
so the file never ends in a torn line that this process wrote.

A failed write raises `RunFileError` naming the file and the OS error (`[ENOSPC]`); the
command line exits 74 on it (pretrain/exit_codes.py).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

_UMASK = os.umask(0)
os.umask(_UMASK)


class RunFileError(OSError):
    """A run file could not be written; the message names it and the OS error."""


def describe_os_error(err: OSError, path: Path | str | None = None) -> str:
    """'No space left on device [ENOSPC] (path)': the OS error, its errno name, the file."""
    name = errno.errorcode.get(err.errno, "") if err.errno is not None else ""
    where = path if path is not None else err.filename
    return f"{err.strerror or err}" + (f" [{name}]" if name else "") + \
        (f" ({where})" if where else "")


def umask_dir_mode(path: Path) -> None:
    """Give directory `path` the permissions a plain mkdir would (0o777 less the umask)."""
    os.chmod(path, 0o777 & ~_UMASK)


def write_atomic(path: Path | str, data: bytes | str) -> None:
    """Replace `path` with `data` (text as UTF-8) atomically; RunFileError if it fails."""
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            _write_all(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        _fsync_parent(path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise RunFileError(err.errno, f"cannot write {path}: "
                           f"{describe_os_error(err, path)}") from err


def _write_all(fd: int, payload: bytes) -> None:
    view = memoryview(payload)
    while view:
        view = view[os.write(fd, view):]


def _fsync_parent(path: Path) -> None:
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AppendLog:
    """Appends whole lines to `path` (created if missing); a failed append is cut back off."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        except OSError as err:
            raise RunFileError(err.errno, f"cannot open {self.path}: "
                               f"{describe_os_error(err, self.path)}") from err
        self._size = os.fstat(self._fd).st_size

    def append(self, line: str) -> None:
        """Write `line` (a newline added) whole, or raise RunFileError leaving the file as
        it was."""
        payload = (line + "\n").encode()
        try:
            _write_all(self._fd, payload)
        except OSError as err:
            try:
                os.ftruncate(self._fd, self._size)
            except OSError:
                pass  # the torn line stays; readers skip unparsable lines
            raise RunFileError(err.errno, f"cannot write {self.path}: "
                               f"{describe_os_error(err, self.path)}") from err
        self._size += len(payload)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
