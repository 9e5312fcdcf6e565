"""Webdataset tar shards of packed token sequences: writing, and a full sequential check.

A shard is a plain (USTAR) tar; sample k of a split is the member `{k:010d}.npy`, a 1-D
array of seq_len + 1 tokens. Members carry mtime 0 and no owner so the same tokens give
the same bytes. Random access for training goes through wids (see loader.py).
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np

from data_pipeline import DataError
from data_pipeline.index import sample_key, shard_name


def npy_bytes(sample: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, sample, allow_pickle=False)
    return buffer.getvalue()


def record_bytes(sample_len: int, dtype: str) -> int:
    """Bytes one sample takes in a tar: a 512-byte header plus the padded .npy payload."""
    payload = len(npy_bytes(np.zeros(sample_len, dtype=dtype)))
    return 512 + (payload + 511) // 512 * 512


class ShardWriter:
    """Writes one split's samples into numbered shards of at most samples_per_shard each."""

    def __init__(self, out_dir: Path, split: str, samples_per_shard: int):
        self.out_dir = out_dir
        self.split = split
        self.samples_per_shard = samples_per_shard
        self.shards: list[dict] = []  # index entries: name, samples, bytes
        self.num_samples = 0
        self._tar: tarfile.TarFile | None = None
        self._in_shard = 0

    def _open_next(self) -> None:
        name = shard_name(self.split, len(self.shards))
        self._tar = tarfile.open(self.out_dir / name, "w", format=tarfile.USTAR_FORMAT)
        self.shards.append({"name": name, "samples": 0, "bytes": 0})
        self._in_shard = 0

    def _close_current(self) -> None:
        if self._tar is not None:
            self._tar.close()
            entry = self.shards[-1]
            entry["bytes"] = (self.out_dir / entry["name"]).stat().st_size
            self._tar = None

    def write(self, sample: np.ndarray) -> None:
        if self._tar is None or self._in_shard == self.samples_per_shard:
            self._close_current()
            self._open_next()
        payload = npy_bytes(sample)
        info = tarfile.TarInfo(f"{sample_key(self.num_samples)}.npy")
        info.size = len(payload)
        info.mode = 0o644
        self._tar.addfile(info, io.BytesIO(payload))
        self._in_shard += 1
        self.shards[-1]["samples"] += 1
        self.num_samples += 1

    def close(self) -> list[dict]:
        """Finish the last shard; returns the index entries of all shards."""
        self._close_current()
        return self.shards


class SequencePacker:
    """Cuts a stream of tokens (documents each followed by EOS) into samples of sample_len.

    Samples do not overlap; the tail shorter than sample_len is dropped at close().
    """

    def __init__(self, sample_len: int, dtype: str, writer: ShardWriter):
        self.sample_len = sample_len
        self.dtype = dtype
        self.writer = writer
        self._pending = np.zeros(0, dtype=dtype)
        self.tokens_written = 0
        self.tokens_dropped = 0

    def add(self, tokens: np.ndarray) -> None:
        stream = np.concatenate([self._pending, tokens.astype(self.dtype, copy=False)])
        full = len(stream) // self.sample_len * self.sample_len
        for start in range(0, full, self.sample_len):
            self.writer.write(stream[start : start + self.sample_len])
        self.tokens_written += full
        self._pending = stream[full:]

    def close(self) -> list[dict]:
        self.tokens_dropped = len(self._pending)
        self._pending = self._pending[:0]
        return self.writer.close()


def read_shard_samples(path: Path, sample_len: int, dtype: str, first_position: int):
    """Yield each sample of a shard in order, checking keys, shape and dtype.

    Reads the tar sequentially with the standard library (independent of wids), so a
    truncated or corrupted file surfaces here as a DataError naming the shard.
    """
    position = first_position
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                expected = f"{sample_key(position)}.npy"
                if member.name != expected or not member.isfile():
                    raise DataError(f"{path}: member {member.name!r}, expected {expected!r}")
                stream = tar.extractfile(member)
                array = np.load(io.BytesIO(stream.read()), allow_pickle=False)
                if array.shape != (sample_len,) or array.dtype != np.dtype(dtype):
                    raise DataError(
                        f"{path}: sample {member.name} has shape {array.shape} dtype "
                        f"{array.dtype}, expected ({sample_len},) {dtype}"
                    )
                yield member.name, array
                position += 1
    except (tarfile.TarError, OSError, ValueError, EOFError) as error:
        raise DataError(f"{path}: unreadable shard ({error})") from error
