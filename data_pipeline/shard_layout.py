"""The byte layout of a shard: how many bytes a sample and a shard of n samples take.

Byte layout (what lets a trainer check sample counts with one stat per shard): each sample
is a 512-byte header plus its .npy payload padded to 512 bytes, R bytes for every sample
of a dataset (record_bytes); after the last sample come the two 512-byte zero blocks
that end a tar, and nothing else. So a shard of n samples has exactly n * R + 1024 bytes
and its size gives n back. tarfile would also pad the archive to a multiple of its
10240-byte record; the writer cuts that padding off, because with it the size only pins n
down to within 10240 / R samples. Shards of version-1 indexes (older `prepare`) still
carry the padding (legacy=True below).
"""

from __future__ import annotations

import io
import tarfile

import numpy as np

END_OF_ARCHIVE = 2 * tarfile.BLOCKSIZE  # the two zero blocks that close a tar
LEGACY_RECORD = tarfile.RECORDSIZE  # version-1 shards are padded to a multiple of this


def npy_bytes(sample: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, sample, allow_pickle=False)
    return buffer.getvalue()


def padded(size: int, block: int) -> int:
    return -(-size // block) * block


def record_of(payload_bytes: int) -> int:
    """Bytes a member with `payload_bytes` takes in a tar: a 512-byte header plus the payload
    padded to 512 bytes."""
    return tarfile.BLOCKSIZE + padded(payload_bytes, tarfile.BLOCKSIZE)


def record_bytes(sample_len: int, dtype: str) -> int:
    """Bytes one sample of `sample_len` tokens takes in a tar."""
    return record_of(len(npy_bytes(np.zeros(sample_len, dtype=dtype))))


def shard_bytes(num_samples: int, record: int, legacy: bool = False) -> int:
    """Exact file size of a shard of num_samples records of `record` bytes each."""
    size = num_samples * record + END_OF_ARCHIVE
    return padded(size, LEGACY_RECORD) if legacy else size


def samples_for_bytes(size: int, record: int, legacy: bool = False) -> range:
    """The sample counts whose shard has exactly `size` bytes; empty if none has.

    One count for current shards; for legacy ones every n with
    size - 10240 < n * R + 1024 <= size, which is up to 10240 / R counts.
    """
    if legacy:
        if size <= 0 or size % LEGACY_RECORD:
            return range(0)
        low = max(0, (size - LEGACY_RECORD - END_OF_ARCHIVE) // record + 1)
        return range(low, (size - END_OF_ARCHIVE) // record + 1)
    body = size - END_OF_ARCHIVE
    if body < 0 or body % record:
        return range(0)
    return range(body // record, body // record + 1)
