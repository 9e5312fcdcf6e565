"""The byte layout of a shard: how many bytes a sample and a shard of n samples take.

Byte layout (what lets a trainer check sample counts with one stat per shard): each sample
is a 512-byte header plus its .npy payload padded to 512 bytes, R bytes for every sample
of a dataset (record_bytes); after the last sample come the two 512-byte zero blocks
that end a tar, and nothing else. So a shard of n samples has exactly n * R + 1024 bytes
and its size gives n back. tarfile would also pad the archive to a multiple of its
10240-byte record; the writer cuts that padding off, because with it the size only pins n
down to within 10240 / R samples.
"""

from __future__ import annotations

import io
import tarfile

import numpy as np

END_OF_ARCHIVE = 2 * tarfile.BLOCKSIZE  # the two zero blocks that close a tar


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


def shard_bytes(num_samples: int, record: int) -> int:
    """Exact file size of a shard of num_samples records of `record` bytes each."""
    return num_samples * record + END_OF_ARCHIVE


def samples_for_bytes(size: int, record: int) -> range:
    """The sample counts whose shard has exactly `size` bytes (one, or none)."""
    body = size - END_OF_ARCHIVE
    if body < 0 or body % record:
        return range(0)
    return range(body // record, body // record + 1)
