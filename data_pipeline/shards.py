"""Webdataset tar shards of packed token sequences: writing, and a full sequential check.

A shard is a plain (USTAR) tar; sample k of a split is the member `{k:010d}.npy`, a 1-D
array of seq_len + 1 tokens. Members carry mtime 0 and no owner so the same tokens give
the same bytes. Random access for training goes through wids (see loader.py).

Byte layout: data_pipeline/shard_layout.py (each shard's size gives its sample count).

Members are written by webdataset's TarWriter into a file this module opens, so that
after the writer closes, the record padding can be cut off (TarWriter has no option for
it). TarWriter ignores its `format` argument and lets tarfile use its default PAX format,
which writes plain USTAR headers for members like ours (ASCII names under 100 bytes,
integer mtime, sizes under 8 GiB); the size check at close and the golden-bytes test in
tests/test_data_prepare.py catch any change there.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import BinaryIO

import numpy as np
from webdataset.writer import TarWriter

from data_pipeline import DataError
from data_pipeline.index import sample_key, sha256_file, shard_name
from data_pipeline.shard_layout import npy_bytes, record_of, shard_bytes


class ShardWriter:
    """Writes one split's samples into numbered shards of at most samples_per_shard each."""

    def __init__(self, out_dir: Path, split: str, samples_per_shard: int):
        self.out_dir = out_dir
        self.split = split
        self.samples_per_shard = samples_per_shard
        self.shards: list[dict] = []  # index entries: name, samples, bytes, sha256
        self.num_samples = 0
        self._file: BinaryIO | None = None  # ours, so the padding can be cut after close
        self._tar: TarWriter | None = None
        self._in_shard = 0
        self._record = 0  # bytes per sample in the tar, fixed by the first sample

    def _open_next(self) -> None:
        name = shard_name(self.split, len(self.shards))
        self._file = open(self.out_dir / name, "wb")
        # Fixed owner, mode and mtime: the same tokens give the same bytes. encoder=False:
        # the payload is already .npy bytes (record_bytes measures the same encoding).
        self._tar = TarWriter(self._file, user="", group="", mode=0o644, mtime=0, encoder=False)
        self.shards.append({"name": name, "samples": 0, "bytes": 0})
        self._in_shard = 0

    def _close_current(self) -> None:
        if self._tar is None:
            return
        self._tar.close()  # leaves self._file open: TarWriter closes only files it opened
        # offset: just past the two end-of-archive blocks, before tarfile's record padding
        end = self._tar.tarstream.offset
        self._file.truncate(end)  # drop the record padding (see the module docstring)
        self._file.close()
        self._tar = self._file = None
        entry = self.shards[-1]
        path = self.out_dir / entry["name"]
        entry["bytes"] = path.stat().st_size
        entry["sha256"] = sha256_file(path)
        expected = shard_bytes(entry["samples"], self._record)
        if entry["bytes"] != expected:  # the size check at training start relies on this
            raise RuntimeError(
                f"{path}: wrote {entry['bytes']} bytes for {entry['samples']} samples, "
                f"the documented shard layout gives {expected}"
            )

    def write(self, sample: np.ndarray) -> None:
        """Append one sample (a 1-D token array) as the next `{k:010d}.npy` member."""
        if self._tar is None or self._in_shard == self.samples_per_shard:
            self._close_current()
            self._open_next()
        payload = npy_bytes(sample)
        if not self._record:  # any later sample of another size fails the check at close
            self._record = record_of(len(payload))
        self._tar.write({"__key__": sample_key(self.num_samples), "npy": payload})
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
