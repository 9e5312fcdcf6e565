"""`inspect`: hash and read every shard and check it against the index."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from data_pipeline import DataError
from data_pipeline.index import SPLITS, DatasetIndex, ShardInfo, read_index, sha256_file
from data_pipeline.progress import progress_bar
from data_pipeline.shards import read_shard_samples
from data_pipeline.tokenizer import load_tokenizer


def summary(index: DatasetIndex) -> str:
    """A few human-readable lines about a prepared dataset."""
    inputs = index.inputs
    lines = [
        f"dataset {index.data_dir}",
        f"  seq_len {index.seq_len} (samples of {index.sample_len} tokens, {index.token_dtype}), "
        f"vocab {index.vocab_size}, eos id {index.eos_id}",
        f"  tokenizer {index.tokenizer_file} sha256 {index.tokenizer_sha256[:16]}...",
        f"  inputs: {len(inputs.get('files', []))} files, {inputs.get('documents')} documents, "
        f"{inputs.get('bytes')} bytes, {inputs.get('tokens')} tokens",
    ]
    for split in SPLITS:
        entry = index.raw["splits"][split]
        lines.append(
            f"  {split}: {index.num_samples(split)} samples in {len(index.shards(split))} shards, "
            f"{entry.get('documents')} documents, {entry.get('tokens')} tokens "
            f"({entry.get('dropped_tokens')} dropped at the end)"
        )
    return "\n".join(lines)


def check_shard_sha256(shard: ShardInfo, index: DatasetIndex) -> None:
    """The shard's bytes hash to the sha256 the index records."""
    actual = sha256_file(shard.path)
    if actual != shard.sha256:
        raise DataError(
            f"{shard.path}: sha256 {actual} differs from {shard.sha256} recorded in "
            f"{index.index_path} (the shard changed after prepare wrote it)"
        )


def _show(processor, sample: np.ndarray, eos_id: int, limit: int = 400) -> str:
    """Decoded text with document boundaries marked; long samples are cut."""
    pieces, start = [], 0
    for end in [int(i) for i in np.flatnonzero(sample == eos_id)] + [len(sample)]:
        pieces.append(processor.decode(sample[start:end].tolist()))
        start = end + 1
    text = " <|eos|> ".join(pieces)
    return repr(text if len(text) <= limit else text[:limit] + "...")


def inspect_dataset(data_dir: str | Path, num_decoded: int = 3, progress: bool = True) -> str:
    """Check shards (sha256, readable, counts, keys, token range) and tokenizer; a report.

    Raises DataError naming the first bad file.
    """
    index = read_index(data_dir)  # tokenizer sha256 and shard sizes
    processor = load_tokenizer(index.tokenizer_path)
    if processor.vocab_size != index.vocab_size:
        raise DataError(
            f"{index.tokenizer_path}: {processor.vocab_size} pieces, "
            f"index says vocab_size {index.vocab_size}"
        )
    decoded: list[str] = []
    total = sum(index.num_samples(split) for split in SPLITS)
    eos_count = 0
    with progress_bar(progress, total=total, desc="inspect", unit="sample",
                      log_interval_s=30.0) as bar:
        for split in SPLITS:
            position = 0
            for shard in index.shards(split):
                check_shard_sha256(shard, index)
                count = 0
                for name, sample in read_shard_samples(
                    shard.path, index.sample_len, index.token_dtype, position
                ):
                    low, high = int(sample.min()), int(sample.max())
                    if low < 0 or high >= index.vocab_size:
                        raise DataError(
                            f"{shard.path}: sample {name} has token ids in [{low}, {high}], "
                            f"outside the vocabulary [0, {index.vocab_size})"
                        )
                    eos_count += int((sample == index.eos_id).sum())
                    if len(decoded) < num_decoded and (split == "train" or not decoded):
                        decoded.append(
                            f"  {split}/{shard.name}/{name}: "
                            f"{_show(processor, sample, index.eos_id)}"
                        )
                    count += 1
                    bar.update(1)
                if count != shard.num_samples:
                    raise DataError(
                        f"{shard.path}: {count} samples, index says {shard.num_samples}"
                    )
                position += count
    report = [summary(index), f"  ok: {total} samples checked, {eos_count} EOS tokens, every "
              "shard's sha256 matches"]
    if decoded:
        report += ["samples:"] + decoded
    return "\n".join(report)
