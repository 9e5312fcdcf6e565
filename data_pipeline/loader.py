"""Training and validation batches, by global sample index, independent of the DP size.

Sample order (the contract the trainer and its checkpoints rely on):
  N = samples in the split; global position g = 0, 1, 2, ... (forever);
  g lies in epoch e = g // N and names stored sample perm_e[g % N], where perm_e is a
  permutation of range(N) that depends only on (seed, e) (see shuffle.py);
  the batch of step t is positions [t*G, (t+1)*G); rank r of n takes the contiguous
  slice [t*G + r*G/n, t*G + (r+1)*G/n).
The loader's state is the number of global positions consumed (samples_consumed), so a
resume continues exactly, whatever the DP size or number of DataLoader workers.

Samples are read with wids (random access into webdataset tar shards). wids resolves a
shard url to cache_dir/<basename>, copies the file there if it is missing, and takes a
lock file next to it. The cache dir used here is local (the temp dir, one per user and
dataset path, or the cache_dir argument) and holds one symlink per shard: nothing is
copied and nothing is written into the dataset directory (which may be read-only or on a
network file system). wids knows each shard by its file name only (a url without the
directory, which wids would otherwise parse as a URL); the symlink supplies the path.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import signal
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import wids
from torch.utils.data import DataLoader, Dataset, Sampler

from data_pipeline import DataError
from data_pipeline.index import DatasetIndex, read_index, sample_key
from data_pipeline.shuffle import PURPOSE_EPOCH_ORDER, seeded_permutation
from data_pipeline.tokenizer import check_index_vocabulary

# wids refuses more than 100 simultaneously open shards per process (wids_dl); keep its
# LRU below that, with room for a validation reader next to the training one.
MAX_OPEN_SHARDS = 64


def default_cache_dir(data_dir: Path) -> Path:
    """$TMPDIR/wids-cache-<uid>-<hash of the dataset path>: local, private, stable."""
    digest = hashlib.sha256(str(data_dir).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"wids-cache-{os.getuid()}-{digest}"


def _link_shards(cache_dir: Path, index: DatasetIndex, split: str) -> None:
    """One symlink per shard in cache_dir (atomic replace; safe with concurrent ranks)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    for shard in index.shards(split):
        link = cache_dir / shard.name
        target = str(shard.path)
        if link.is_symlink() and os.readlink(link) == target:
            continue
        temporary = cache_dir / f".{shard.name}.{os.getpid()}.link"
        temporary.unlink(missing_ok=True)
        os.symlink(target, temporary)
        os.replace(temporary, link)


class ShardSampleDataset(Dataset):
    """Map-style view of one split: stored position -> sample array of seq_len + 1 tokens.

    The wids reader is opened lazily in each process (DataLoader workers included).
    """

    def __init__(self, index: DatasetIndex, split: str, cache_dir: str | Path | None = None):
        self.index = index
        self.split = split
        self.shards = index.shards(split)
        self.shard_starts = np.cumsum([0] + [shard.num_samples for shard in self.shards])
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir(index.data_dir)
        self._reader = None
        self._reader_pid = None

    def __len__(self) -> int:
        return int(self.shard_starts[-1])

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_reader"] = state["_reader_pid"] = None  # open mmaps do not pickle
        return state

    def _open(self):
        if self._reader is not None and self._reader_pid == os.getpid():
            return self._reader
        _link_shards(self.cache_dir, self.index, self.split)
        if len(self.shards) > MAX_OPEN_SHARDS:
            warnings.warn(
                f"{self.index.data_dir}: split {self.split!r} has {len(self.shards)} shards, "
                f"more than the {MAX_OPEN_SHARDS} kept open; shuffled reads will re-open "
                "shards often (prepare with a larger --shard-mb)",
                stacklevel=2,
            )
        descriptors = [{"url": shard.name, "nsamples": shard.num_samples} for shard in self.shards]
        # wids prints a one-line summary to stderr on construction; keep logs clean.
        with contextlib.redirect_stderr(io.StringIO()):
            self._reader = wids.ShardListDataset(
                descriptors,
                cache_dir=str(self.cache_dir),
                lru_size=min(len(self.shards), MAX_OPEN_SHARDS),
                transformations=[],
            )
        self._reader_pid = os.getpid()
        return self._reader

    def _shard_of(self, position: int):
        return self.shards[int(np.searchsorted(self.shard_starts, position, side="right")) - 1]

    def __getitem__(self, position: int) -> np.ndarray:
        position = int(position)
        if not 0 <= position < len(self):
            raise IndexError(f"sample {position} outside the {self.split} split of {len(self)}")
        key = sample_key(position)
        try:
            sample = self._open()[position]
            array = np.load(sample[".npy"], allow_pickle=False)
        except Exception as error:  # wids raises assorted errors on a damaged tar
            shard = self._shard_of(position)
            raise DataError(
                f"{shard.path}: cannot read sample {key} ({type(error).__name__}: {error})"
            ) from error
        if sample["__key__"] != key:
            raise DataError(
                f"{self._shard_of(position).path}: found sample {sample['__key__']!r} where "
                f"the index puts {key!r} (index and shards disagree)"
            )
        if array.shape != (self.index.sample_len,) or array.dtype != self.index.token_dtype:
            raise DataError(
                f"{self._shard_of(position).path}: sample {key} has shape {array.shape} dtype "
                f"{array.dtype}, index says ({self.index.sample_len},) {self.index.token_dtype}"
            )
        if array.max() >= self.index.vocab_size or array.min() < 0:
            raise DataError(
                f"{self._shard_of(position).path}: sample {key} holds token ids outside "
                f"[0, {self.index.vocab_size})"
            )
        return array

    def __getitems__(self, positions) -> torch.Tensor:
        """A batch as a LongTensor (len(positions), seq_len + 1)."""
        stacked = np.stack([self[position] for position in positions])
        return torch.from_numpy(stacked.astype(np.int64))

    def close(self) -> None:
        if self._reader is not None and self._reader_pid == os.getpid():
            self._reader.close()
        self._reader = self._reader_pid = None


class SampleOrder:
    """Maps global positions to stored sample indices (one seeded permutation per epoch)."""

    def __init__(self, num_samples: int, seed: int):
        self.num_samples = num_samples
        self.seed = seed
        self._perms: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # batches straddle at most two epochs
                self._perms.pop(min(self._perms))
            self._perms[epoch] = seeded_permutation(
                self.num_samples, self.seed, PURPOSE_EPOCH_ORDER, epoch
            )
        return self._perms[epoch]

    def samples(self, start: int, count: int) -> np.ndarray:
        """Stored indices of global positions [start, start + count)."""
        positions = np.arange(start, start + count, dtype=np.int64)
        epochs, offsets = np.divmod(positions, self.num_samples)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            out[chosen] = self.permutation(int(epoch))[offsets[chosen]]
        return out


class RankBatchSampler(Sampler):
    """Infinite batch sampler: this rank's slice of each global batch, from position `start`."""

    def __init__(self, order: SampleOrder, start: int, global_batch: int, rank: int, size: int):
        self.order = order
        self.start = start
        self.global_batch = global_batch
        self.local_batch = global_batch // size
        self.offset = rank * self.local_batch

    def __iter__(self) -> Iterator[list[int]]:
        batch_start = self.start
        while True:
            yield self.order.samples(batch_start + self.offset, self.local_batch).tolist()
            batch_start += self.global_batch


def _batch_as_is(batch: torch.Tensor) -> torch.Tensor:
    """collate_fn: ShardSampleDataset.__getitems__ already returns the batch tensor."""
    return batch


# Stop signals belong to the trainer (pretrain/signals.py). Slurm sends SIGTERM to the whole
# process group; a worker killed by it makes the DataLoader raise in the trainer before the
# trainer can checkpoint. Workers start with these signals blocked (inherited from the
# trainer, which blocks them only while it starts workers) and ignore them before unblocking,
# so no signal reaches a worker in a window before it is ignored.
WORKER_IGNORED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def _ignore_stop_signals(_worker_id: int) -> None:
    """worker_init_fn: leave SIGINT, SIGTERM and SIGUSR1 to the trainer."""
    for sig in WORKER_IGNORED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, WORKER_IGNORED_SIGNALS)


@contextlib.contextmanager
def _stop_signals_blocked():
    """Hold stop signals pending in this thread (delivered on exit) while workers start."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread receives Python signals; nothing to hold
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, WORKER_IGNORED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class TrainLoader:
    """Endless stream of this rank's LongTensor batches (G // n, seq_len + 1); see module doc.

    state_dict() counts the global samples of the batches already yielded to the caller
    (not those prefetched by workers); load_state_dict() makes the next batch continue
    from there, at any DP size or number of workers.
    """

    def __init__(
        self,
        data_dir: str | Path,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        num_workers: int = 0,
        split: str = "train",
        cache_dir: str | Path | None = None,
        prefetch_factor: int = 2,
        pin_memory: bool = False,
    ):
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank} dp_size={dp_size}"
            )
        if global_batch_size < 1 or global_batch_size % dp_size:
            raise ValueError(
                f"global_batch_size {global_batch_size} must be a positive multiple of "
                f"dp_size {dp_size}"
            )
        if seed < 0 or num_workers < 0:
            raise ValueError(f"need seed >= 0 and num_workers >= 0, got {seed}, {num_workers}")
        self.index = read_index(data_dir)
        check_index_vocabulary(self.index)  # at start, not as a bad token id at some step
        self.dataset = ShardSampleDataset(self.index, split, cache_dir)
        if len(self.dataset) == 0:
            raise DataError(f"{self.index.index_path}: split {split!r} holds no sample")
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.pin_memory = pin_memory
        self.order = SampleOrder(len(self.dataset), seed)
        self._samples_consumed = 0
        self._batches = None  # live iterator, (re)started lazily from _samples_consumed

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.dp_size

    @property
    def num_samples(self) -> int:
        """Samples in the split (one epoch)."""
        return len(self.dataset)

    @property
    def epoch(self) -> int:
        """Epoch of the next sample to be yielded."""
        return self._samples_consumed // len(self.dataset)

    def state_dict(self) -> dict:
        return {"samples_consumed": self._samples_consumed, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        consumed = state.get("samples_consumed")
        if not isinstance(consumed, int) or isinstance(consumed, bool) or consumed < 0:
            raise ValueError(f"loader state has a bad samples_consumed: {state!r}")
        if state.get("seed") != self.seed:
            raise ValueError(
                f"loader state was saved with seed {state.get('seed')!r}, this loader has seed "
                f"{self.seed}: the sample order would differ"
            )
        self.close()
        self._samples_consumed = consumed

    def _start(self) -> Iterator[torch.Tensor]:
        sampler = RankBatchSampler(
            self.order, self._samples_consumed, self.global_batch_size, self.dp_rank, self.dp_size
        )
        if self.num_workers == 0:
            return (self.dataset.__getitems__(batch) for batch in sampler)
        loader = DataLoader(
            self.dataset,
            batch_sampler=sampler,
            num_workers=self.num_workers,
            collate_fn=_batch_as_is,
            prefetch_factor=self.prefetch_factor,
            pin_memory=self.pin_memory,
            worker_init_fn=_ignore_stop_signals,
        )
        with _stop_signals_blocked():  # the workers start here
            return iter(loader)

    def __iter__(self) -> TrainLoader:
        return self

    def __next__(self) -> torch.Tensor:
        if self._batches is None:
            self._batches = self._start()
        try:
            batch = next(self._batches)
        except BaseException:
            self.close()  # the next call restarts cleanly from the same position
            raise
        self._samples_consumed += self.global_batch_size
        return batch

    def close(self) -> None:
        """Stop the worker processes, if any (iteration may continue afterwards)."""
        batches, self._batches = self._batches, None
        shutdown = getattr(batches, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()


def validation_batches(
    data_dir: str | Path,
    batch_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    max_batches: int | None = None,
    split: str = "val",
    cache_dir: str | Path | None = None,
) -> Iterator[torch.Tensor]:
    """The split once, in stored order: this rank's LongTensor batches (batch_size, L + 1).

    Step t covers stored samples [t*B*n, (t+1)*B*n), rank r its r-th slice of batch_size,
    so every rank gets the same number of batches; the remainder (fewer than
    batch_size * dp_size samples) is dropped, and a split smaller than that yields nothing.
    """
    if dp_size < 1 or not 0 <= dp_rank < dp_size or batch_size < 1:
        raise ValueError(
            f"need batch_size >= 1 and 0 <= dp_rank < dp_size, got batch_size={batch_size} "
            f"dp_rank={dp_rank} dp_size={dp_size}"
        )
    if max_batches is not None and max_batches < 0:
        raise ValueError(f"max_batches must be >= 0 or None, got {max_batches}")
    dataset = ShardSampleDataset(read_index(data_dir), split, cache_dir)
    global_batch = batch_size * dp_size
    num_batches = len(dataset) // global_batch
    if max_batches is not None:
        num_batches = min(num_batches, max_batches)
    return _validation_iter(dataset, num_batches, global_batch, batch_size * dp_rank, batch_size)


def _validation_iter(dataset, num_batches, global_batch, offset, batch_size):
    try:
        for step in range(num_batches):
            start = step * global_batch + offset
            yield dataset.__getitems__(range(start, start + batch_size))
    finally:
        dataset.close()
