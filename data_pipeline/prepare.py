"""`prepare`: raw text -> tokenizer -> packed sequences -> webdataset shards + index.json.

Phases (each with a progress bar on a terminal's stderr, a plain line every 30 s in a log):
  scan       read every input once: count documents and bytes, reject empty files;
  tokenizer  train sentencepiece on (a deterministic stride sample of) the documents,
             or copy the given model;
  tokenize   encode documents on `workers` processes (ordered, so the output does not
             depend on the number of workers), append EOS to each document, route it to
             the train or val split (split by document, from the seed) and pack each
             split's token stream into samples of seq_len + 1 tokens written to shards.
Everything is written to a hidden sibling directory that is renamed to DIR at the end,
index.json last, so a failed or interrupted run leaves nothing that looks complete. The
index records each shard's sample count, size and sha256 (see index.py for what is checked
when).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from data_pipeline import DataError
from data_pipeline.index import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_FILE,
    DatasetIndex,
    read_index,
    sha256_file,
    token_dtype_for,
    write_index,
)
from data_pipeline.progress import Progress, progress_bar, write_line
from data_pipeline.shard_layout import record_bytes
from data_pipeline.shards import SequencePacker, ShardWriter
from data_pipeline.shuffle import PURPOSE_VAL_SPLIT, seeded_permutation
from data_pipeline.sources import expand_inputs, iter_documents, read_documents
from data_pipeline.tokenizer import (
    TOKENIZER_FILE,
    backend_file_name,
    find_tokenizer_file,
    load_tokenizer,
    train_tokenizer,
)

DEFAULT_VOCAB_SIZE = 8192
DEFAULT_SEQ_LEN = 1024
DEFAULT_VAL_FRACTION = 0.01
DEFAULT_SHARD_MB = 256.0
DEFAULT_TOKENIZER_TRAIN_MB = 64.0
CHUNK_BYTES = 1 << 18  # text per tokenisation task (small enough to balance workers)


PROGRESS_LINE_S = 30.0  # a phase's counts this often in a log file (no bar there)


def _bar(progress: bool, **kwargs) -> Progress:
    return progress_bar(progress, log_interval_s=PROGRESS_LINE_S, **kwargs)


def _note(message: str) -> None:
    write_line(f"prepare: {message}")


def check_output_dir(out_dir: Path, force: bool) -> None:
    """Refuse a non-empty DIR unless --force, and --force only over a prepared dataset."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise DataError(f"{out_dir}: exists and is not a directory")
    if not any(out_dir.iterdir()):
        return
    if not force:
        raise DataError(f"{out_dir}: exists and is not empty (pass --force to replace it)")
    if not (out_dir / INDEX_FILE).is_file():
        raise DataError(
            f"{out_dir}: --force only replaces a prepared dataset, and this directory has no "
            f"{INDEX_FILE}; remove it yourself if it is meant to go"
        )


def _label(files: list[Path]) -> str:
    """The inputs, for an error about all of them."""
    return str(files[0]) if len(files) == 1 else f"{files[0]} (and {len(files) - 1} more inputs)"


def _scan(files: list[Path], progress: bool) -> tuple[int, int]:
    """Count documents and UTF-8 bytes; a file with no document is an error."""
    documents = total_bytes = 0
    with _bar(progress, total=len(files), desc="scan", unit="file") as bar:
        for path in files:
            in_file = 0
            for doc in read_documents(path):
                in_file += 1
                total_bytes += len(doc.encode("utf-8"))
            if in_file == 0:
                raise DataError(f"{path}: input holds no document (empty file?)")
            documents += in_file
            bar.update(1)
    return documents, total_bytes


def _training_lines(files: list[Path], stride: int) -> Iterator[str]:
    """Non-empty lines of every stride-th document (sentencepiece trains on lines)."""
    for number, doc in enumerate(iter_documents(files)):
        if number % stride == 0:
            yield from (line for line in doc.split("\n") if line.strip())


# --- tokenisation workers -------------------------------------------------------------

_worker_state: dict = {}


def _init_worker(model_path: str, dtype: str) -> None:
    _worker_state["processor"] = load_tokenizer(model_path)
    _worker_state["dtype"] = dtype


def _encode_chunk(chunk: tuple[int, list[str]]) -> tuple[int, np.ndarray, np.ndarray, int]:
    """Encode documents: (first doc number, tokens with EOS after each doc, lengths, bytes)."""
    first, texts = chunk
    processor = _worker_state["processor"]
    eos = processor.eos_id
    pieces = processor.encode_batch(texts)
    lengths = np.fromiter((len(ids) + 1 for ids in pieces), dtype=np.int64, count=len(pieces))
    flat = np.empty(int(lengths.sum()), dtype=_worker_state["dtype"])
    position = 0
    for ids in pieces:
        flat[position : position + len(ids)] = ids
        position += len(ids)
        flat[position] = eos
        position += 1
    return first, flat, lengths, sum(len(text.encode("utf-8")) for text in texts)


def _chunks(files: list[Path]) -> Iterator[tuple[int, list[str]]]:
    first, texts, size = 0, [], 0
    for number, doc in enumerate(iter_documents(files)):
        texts.append(doc)
        size += len(doc)
        if size >= CHUNK_BYTES:
            yield first, texts
            first, texts, size = number + 1, [], 0
    if texts:
        yield first, texts


def _encoded_chunks(files, model_path, dtype, workers):
    if workers == 1:
        _init_worker(str(model_path), dtype)
        yield from map(_encode_chunk, _chunks(files))
        return
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_init_worker, initargs=(str(model_path), dtype)) as pool:
        yield from pool.imap(_encode_chunk, _chunks(files))


# --- the command ----------------------------------------------------------------------


@dataclass(frozen=True)
class PrepareOptions:
    """The knobs of `prepare` (see the command line help), checked on creation."""

    vocab_size: int | None = None  # None: DEFAULT_VOCAB_SIZE, or the --tokenizer's
    seq_len: int = DEFAULT_SEQ_LEN
    val_fraction: float = DEFAULT_VAL_FRACTION
    tokenizer: Path | None = None
    workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    seed: int = 0
    shard_mb: float = DEFAULT_SHARD_MB
    tokenizer_train_mb: float = DEFAULT_TOKENIZER_TRAIN_MB
    progress: bool = True

    def __post_init__(self):
        if self.seq_len < 1:
            raise DataError(f"--seq-len must be at least 1, got {self.seq_len}")
        if not 0 <= self.val_fraction < 1:
            raise DataError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.workers < 1 or self.seed < 0 or self.shard_mb <= 0 or self.tokenizer_train_mb <= 0:
            raise DataError(
                f"bad option: workers={self.workers} seed={self.seed} shard_mb={self.shard_mb} "
                f"tokenizer_train_mb={self.tokenizer_train_mb} "
                "(need workers >= 1, seed >= 0, sizes > 0)"
            )
        if self.tokenizer is not None and self.vocab_size is not None:
            raise DataError("give either --tokenizer or --vocab-size (the tokenizer fixes it)")
        if (self.tokenizer is not None and Path(self.tokenizer).is_dir()
                and find_tokenizer_file(self.tokenizer) is None):
            raise DataError(f"{self.tokenizer}: --tokenizer expects a sentencepiece .model, a "
                            "tokenizer.json, or a directory holding one")


def prepare_dataset(
    inputs: list[str],
    out_dir: str | Path,
    *,
    vocab_size: int | None = None,
    seq_len: int = DEFAULT_SEQ_LEN,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    tokenizer: str | Path | None = None,
    workers: int | None = None,
    seed: int = 0,
    shard_mb: float = DEFAULT_SHARD_MB,
    tokenizer_train_mb: float = DEFAULT_TOKENIZER_TRAIN_MB,
    force: bool = False,
    progress: bool = True,
) -> DatasetIndex:
    """Build a dataset directory from raw text; returns its (checked) index.

    With workers > 1 it starts processes with the "spawn" method: a script calling it
    needs the usual `if __name__ == "__main__":` guard.
    """
    options = PrepareOptions(
        vocab_size=vocab_size,
        seq_len=seq_len,
        val_fraction=val_fraction,
        tokenizer=Path(tokenizer) if tokenizer is not None else None,
        workers=workers or os.cpu_count() or 1,
        seed=seed,
        shard_mb=shard_mb,
        tokenizer_train_mb=tokenizer_train_mb,
        progress=progress,
    )
    out_dir = Path(out_dir).absolute()
    check_output_dir(out_dir, force)
    files = expand_inputs(inputs)

    tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir()
    try:
        write_index(_build(files, tmp_dir, options), tmp_dir)
        _move_into_place(tmp_dir, out_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return read_index(out_dir)


def _move_into_place(tmp_dir: Path, out_dir: Path) -> None:
    if out_dir.exists() and not any(out_dir.iterdir()):
        out_dir.rmdir()
    if out_dir.exists():  # a previous dataset, replaced under --force
        old_dir = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        os.replace(out_dir, old_dir)
        os.replace(tmp_dir, out_dir)
        shutil.rmtree(old_dir, ignore_errors=True)
    else:
        os.replace(tmp_dir, out_dir)


def _tokenizer_into(tmp_dir: Path, files, total_bytes: int, options) -> tuple[Path, int | None]:
    """Copy or train the tokenizer into tmp_dir; returns its path there and the training
    document stride (None for a given tokenizer)."""
    if options.tokenizer is not None:
        given = load_tokenizer(options.tokenizer)  # fails early, naming the file
        model_path = tmp_dir / backend_file_name(given.path)
        shutil.copyfile(given.path, model_path)
        return model_path, None
    model_path = tmp_dir / TOKENIZER_FILE
    vocab_size = options.vocab_size or DEFAULT_VOCAB_SIZE
    stride = max(1, math.ceil(total_bytes / (options.tokenizer_train_mb * 1e6)))
    with _bar(options.progress, total=1, desc="tokenizer", unit="model") as bar:
        train_tokenizer(_training_lines(files, stride), model_path, vocab_size, options.seed)
        bar.update(1)
    return model_path, stride


def _val_documents(num_docs: int, files, options) -> np.ndarray:
    """Boolean mask over documents: round(F * D) of them (at least 1 if F > 0), seeded."""
    num_val = round(options.val_fraction * num_docs)
    if options.val_fraction > 0:
        if num_docs < 2:
            raise DataError(f"{_label(files)}: one document cannot be split; use --val-fraction 0")
        num_val = min(max(num_val, 1), num_docs - 1)
    is_val = np.zeros(num_docs, dtype=bool)
    is_val[seeded_permutation(num_docs, options.seed, PURPOSE_VAL_SPLIT)[:num_val]] = True
    return is_val


def _build(files: list[Path], tmp_dir: Path, options: PrepareOptions) -> dict:
    """All phases, writing into tmp_dir; returns the index.json contents."""
    num_docs, total_bytes = _scan(files, options.progress)
    model_path, stride = _tokenizer_into(tmp_dir, files, total_bytes, options)
    processor = load_tokenizer(model_path)
    vocab_size, eos_id = processor.vocab_size, processor.eos_id
    if eos_id is None:
        raise DataError(f"{options.tokenizer}: tokenizer has no end-of-sentence id")
    requested = options.vocab_size or DEFAULT_VOCAB_SIZE
    if options.tokenizer is None and vocab_size < requested:
        _note(f"the corpus supports only {vocab_size} pieces (asked for {requested})")
    dtype = token_dtype_for(vocab_size)
    is_val = _val_documents(num_docs, files, options)

    sample_len = options.seq_len + 1
    samples_per_shard = max(1, int(options.shard_mb * 1e6 // record_bytes(sample_len, dtype)))
    packers = {
        split: SequencePacker(sample_len, dtype, ShardWriter(tmp_dir, split, samples_per_shard))
        for split in ("train", "val")
    }
    doc_tokens = 0
    split_docs = {"train": 0, "val": 0}
    encoded = _encoded_chunks(files, model_path, dtype, options.workers)
    with _bar(
        options.progress, total=total_bytes, desc="tokenize", unit="B", unit_scale=True
    ) as bar:
        for first, flat, lengths, text_bytes in encoded:
            in_val = is_val[first : first + len(lengths)]
            token_in_val = np.repeat(in_val, lengths)
            packers["train"].add(flat[~token_in_val])
            packers["val"].add(flat[token_in_val])
            split_docs["val"] += int(in_val.sum())
            split_docs["train"] += len(lengths) - int(in_val.sum())
            doc_tokens += len(flat) - len(lengths)
            bar.update(text_bytes)

    splits = {}
    for split, packer in packers.items():
        shards = packer.close()
        splits[split] = {
            "shards": shards,
            "samples": packer.writer.num_samples,
            "documents": split_docs[split],
            "tokens": packer.tokens_written,
            "dropped_tokens": packer.tokens_dropped,
        }
    if splits["train"]["samples"] == 0:
        raise DataError(
            f"{_label(files)}: the train split holds {packers['train'].tokens_dropped} tokens, "
            f"fewer than one sample of seq_len + 1 = {sample_len}; add text or lower --seq-len"
        )
    if options.val_fraction > 0 and splits["val"]["samples"] == 0:
        raise DataError(
            f"{_label(files)}: the val split holds {packers['val'].tokens_dropped} tokens, fewer "
            f"than one sample of {sample_len}; raise --val-fraction or lower --seq-len"
        )
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "seq_len": options.seq_len,
        "sample_len": sample_len,
        "vocab_size": vocab_size,
        "token_dtype": dtype,
        "eos_id": eos_id,
        "tokenizer": {
            "file": model_path.name,
            "sha256": sha256_file(model_path),
            "trained": options.tokenizer is None,
        },
        "splits": splits,
        "inputs": {
            "files": [str(path.resolve()) for path in files],
            "documents": num_docs,
            "bytes": total_bytes,
            "tokens": doc_tokens,
        },
        "options": {
            "val_fraction": options.val_fraction,
            "seed": options.seed,
            "samples_per_shard": samples_per_shard,
            "tokenizer_train_stride": stride,
        },
    }
