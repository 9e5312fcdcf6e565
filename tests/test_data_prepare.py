"""prepare: round trip, packing, splits, inputs, determinism; inspect on a good dataset."""

from __future__ import annotations

import io
import json
import os
import tarfile

import numpy as np
import pytest
from data_fixtures import make_documents, prepare_tiny, write_jsonl, write_txt

from data_pipeline.__main__ import main
from data_pipeline.index import read_index, sha256_file
from data_pipeline.loader import validation_batches
from data_pipeline.shard_layout import record_bytes
from data_pipeline.shards import ShardWriter, read_shard_samples
from data_pipeline.shuffle import PURPOSE_VAL_SPLIT, seeded_permutation
from data_pipeline.tokenizer import load_tokenizer


def stored_stream(index, split: str) -> np.ndarray:
    """All tokens of a split, samples concatenated in stored order."""
    samples, position = [], 0
    for shard in index.shards(split):
        for _, sample in read_shard_samples(
            shard.path, index.sample_len, index.token_dtype, position
        ):
            samples.append(sample)
            position += 1
    return np.concatenate(samples).astype(np.int64)


def split_at_eos(stream: np.ndarray, eos: int) -> tuple[list[list[int]], list[int]]:
    """Complete documents (each ended by EOS) and the unterminated tail."""
    docs, start = [], 0
    for end in np.flatnonzero(stream == eos):
        docs.append(stream[start:end].tolist())
        start = end + 1
    return docs, stream[start:].tolist()


@pytest.mark.timeout(60)
def test_round_trip_and_eos_at_document_boundaries(tmp_path):
    docs = make_documents()
    index = prepare_tiny(
        [write_jsonl(tmp_path / "corpus.jsonl", docs)], tmp_path / "ds", shard_mb=0.02
    )
    sp = load_tokenizer(index.tokenizer_path)
    assert index.eos_id == sp.eos_id and index.vocab_size == sp.vocab_size
    assert len(index.shards("train")) > 1  # packing continues across shard boundaries

    # The split is by document: a seeded choice of round(0.2 * D) documents for val.
    chosen = seeded_permutation(len(docs), 0, PURPOSE_VAL_SPLIT)[: round(0.2 * len(docs))]
    val_numbers = sorted(int(n) for n in chosen)
    split_numbers = {
        "val": val_numbers,
        "train": [n for n in range(len(docs)) if n not in set(val_numbers)],
    }
    for split, numbers in split_numbers.items():
        stream = stored_stream(index, split)
        # Packed = each document's tokens then EOS, document after document (input
        # order), cut into samples; the tail shorter than a sample is dropped.
        expected = []
        for number in numbers:
            expected += sp.encode(docs[number]) + [index.eos_id]
        entry = index.raw["splits"][split]
        assert stream.tolist() == expected[: len(stream)]
        assert len(expected) - len(stream) == entry["dropped_tokens"] < index.sample_len
        assert entry["tokens"] == len(stream) == index.num_samples(split) * index.sample_len
        assert entry["documents"] == len(numbers)
        # Decoding each EOS-terminated piece gives the documents back (identity
        # normalisation, byte fallback: exactly the input text).
        complete, _ = split_at_eos(stream, index.eos_id)
        assert [sp.decode(ids) for ids in complete] == [docs[n] for n in numbers[: len(complete)]]
        assert len(complete) >= len(numbers) - 2
    # Split by document: no document in both, and the val share is as asked.
    val_docs = index.raw["splits"]["val"]["documents"]
    assert val_docs == round(0.2 * len(docs))
    assert val_docs + index.raw["splits"]["train"]["documents"] == len(docs)
    assert index.inputs["documents"] == len(docs)
    assert index.inputs["bytes"] == sum(len(doc.encode()) for doc in docs)


@pytest.mark.timeout(60)
def test_txt_gz_directories_and_globs(tmp_path):
    docs = make_documents(60)
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    write_txt(corpus / "a.txt", docs[:20])
    write_jsonl(corpus / "sub" / "b.jsonl.gz", docs[20:40], compress=True)
    write_jsonl(tmp_path / "c.jsonl", docs[40:])
    (corpus / "notes.md").write_text("ignored: not an input type\n")
    index = prepare_tiny([corpus, str(tmp_path / "c*.jsonl")], tmp_path / "ds", val_fraction=0.1)
    assert index.inputs["documents"] == 60
    assert [f.rsplit("/", 1)[-1] for f in index.inputs["files"]] == [
        "a.txt",
        "b.jsonl.gz",
        "c.jsonl",
    ]
    sp = load_tokenizer(index.tokenizer_path)
    complete, _ = split_at_eos(stored_stream(index, "train"), index.eos_id)
    # Blank lines separate .txt documents; single newlines stay inside a document.
    assert any("\n" in sp.decode(ids) for ids in complete)
    assert all(sp.decode(ids) in docs for ids in complete)


@pytest.mark.timeout(90)
def test_output_does_not_depend_on_workers_and_tokenizer_is_reused(tmp_path):
    docs = make_documents()
    corpus = write_jsonl(tmp_path / "corpus.jsonl", docs)
    first = prepare_tiny([corpus], tmp_path / "one", workers=1, shard_mb=0.02)
    second = prepare_tiny(
        [corpus],
        tmp_path / "two",
        workers=2,
        shard_mb=0.02,
        vocab_size=None,
        tokenizer=first.tokenizer_path,
    )
    assert sha256_file(second.tokenizer_path) == first.tokenizer_sha256
    assert second.raw["tokenizer"]["trained"] is False
    for split in ("train", "val"):
        names = [shard.name for shard in first.shards(split)]
        assert names == [shard.name for shard in second.shards(split)]
        for a, b in zip(first.shards(split), second.shards(split), strict=True):
            assert a.path.read_bytes() == b.path.read_bytes()
    # Retraining the tokenizer on the same input gives the same model.
    again = prepare_tiny([corpus], tmp_path / "three", workers=1, shard_mb=0.02)
    assert again.tokenizer_sha256 == first.tokenizer_sha256


@pytest.mark.timeout(60)
def test_index_json_contents(tmp_path):
    index = prepare_tiny([write_jsonl(tmp_path / "c.jsonl", make_documents())], tmp_path / "ds")
    raw = json.loads((tmp_path / "ds" / "index.json").read_text())
    assert raw["seq_len"] == 16 and raw["sample_len"] == 17
    assert raw["token_dtype"] == "uint16" and raw["vocab_size"] == 400
    assert raw["tokenizer"] == {
        "file": "tokenizer.model",
        "trained": True,
        "sha256": sha256_file(tmp_path / "ds" / "tokenizer.model"),
    }
    shard = raw["splits"]["train"]["shards"][0]
    assert shard["name"] == "train-000000.tar"
    assert shard["bytes"] == (tmp_path / "ds" / "train-000000.tar").stat().st_size
    assert shard["sha256"] == sha256_file(tmp_path / "ds" / "train-000000.tar")
    assert raw["version"] == 2
    assert set(raw["inputs"]) == {"files", "documents", "bytes", "tokens"}
    assert index.tokenizer_path.is_absolute()
    assert read_index(tmp_path / "ds").num_samples("train") == raw["splits"]["train"]["samples"]
    # Nothing else left next to the dataset (the temporary sibling is gone).
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.timeout(60)
def test_cli_prepare_then_inspect(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", make_documents())
    out = tmp_path / "ds"
    assert (
        main(
            [
                "prepare",
                "--input",
                str(corpus),
                "--out",
                str(out),
                "--vocab-size",
                "400",
                "--seq-len",
                "16",
                "--val-fraction",
                "0.2",
                "--workers",
                "1",
                "--shard-mb",
                "0.02",
            ]
        )
        == 0
    )
    assert "train:" in capsys.readouterr().out
    assert main(["inspect", str(out), "--samples", "2"]) == 0
    report = capsys.readouterr().out
    assert "ok:" in report and "train/train-000000.tar/0000000000.npy" in report
    assert "doc0" in report  # decoded text of the first sample
    # --force replaces a prepared dataset.
    assert (
        main(
            [
                "prepare",
                "--input",
                str(corpus),
                "--out",
                str(out),
                "--vocab-size",
                "400",
                "--seq-len",
                "8",
                "--workers",
                "1",
                "--force",
            ]
        )
        == 0
    )
    assert read_index(out).seq_len == 8


@pytest.mark.timeout(60)
def test_no_validation_split(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", make_documents(40))
    index = prepare_tiny([corpus], tmp_path / "ds", val_fraction=0)
    assert index.shards("val") == [] and index.num_samples("val") == 0
    assert index.raw["splits"]["train"]["documents"] == 40
    assert list(validation_batches(index.data_dir, 2)) == []
    assert main(["inspect", str(index.data_dir)]) == 0


def ustar_header(name: str, size: int) -> bytes:
    """A USTAR member header built field by field from the POSIX layout, not by tarfile:
    mode 0644, uid/gid 0, no owner names, mtime 0, a regular file (no device numbers)."""
    fields = [
        name.encode("ascii").ljust(100, b"\0"),  # name
        b"0000644\0", b"0000000\0", b"0000000\0",  # mode, uid, gid
        b"%011o\0" % size, b"00000000000\0",  # size, mtime
        b" " * 8,  # checksum, counted as spaces
        b"0", b"\0" * 100, b"ustar\x0000",  # type (regular file), linkname, magic+version
        b"\0" * 32, b"\0" * 32,  # owner and group names
        b"\0" * 8, b"\0" * 8, b"\0" * 155,  # device numbers (empty: not a device), prefix
    ]
    header = b"".join(fields).ljust(512, b"\0")
    return header[:148] + b"%06o\0 " % sum(header) + header[156:]


def npy_payload(sample: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, sample, allow_pickle=False)
    return buffer.getvalue()


def golden_shard(samples: list[np.ndarray], first_key: int) -> bytes:
    """The documented layout: per sample a header and the payload zero-padded to 512 bytes,
    then the two 512-byte end-of-archive blocks and nothing after them."""
    body = b""
    for position, sample in enumerate(samples, start=first_key):
        payload = npy_payload(sample)
        body += ustar_header(f"{position:010d}.npy", len(payload))
        body += payload + bytes(-len(payload) % 512)
    return body + bytes(1024)


def previous_writer_shard(samples: list[np.ndarray], first_key: int, path) -> bytes:
    """What the writer before webdataset's TarWriter produced: stdlib tarfile in USTAR format,
    truncated just past the end-of-archive blocks."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for position, sample in enumerate(samples, start=first_key):
            payload = npy_payload(sample)
            info = tarfile.TarInfo(f"{position:010d}.npy")
            info.size, info.mode = len(payload), 0o644
            tar.addfile(info, io.BytesIO(payload))
        end = tar.offset + 1024
    os.truncate(path, end)
    return path.read_bytes()


def test_shard_bytes_match_golden_layout_and_previous_writer(tmp_path):
    rng = np.random.default_rng(0)
    samples = [rng.integers(0, 400, size=17).astype(np.uint16) for _ in range(5)]
    writer = ShardWriter(tmp_path, "train", samples_per_shard=3)
    for sample in samples:
        writer.write(sample)
    entries = writer.close()
    assert [(entry["name"], entry["samples"]) for entry in entries] == [
        ("train-000000.tar", 3), ("train-000001.tar", 2)]
    record = record_bytes(17, "uint16")
    assert record == 1024  # 512-byte header + 162-byte .npy padded to 512
    for entry, first_key in zip(entries, (0, 3), strict=True):
        written = (tmp_path / entry["name"]).read_bytes()
        chunk = samples[first_key : first_key + entry["samples"]]
        assert len(written) == entry["bytes"] == entry["samples"] * record + 1024
        assert written == golden_shard(chunk, first_key), f"{entry['name']} differs from layout"
        previous = previous_writer_shard(chunk, first_key, tmp_path / f"previous-{first_key}.tar")
        assert written == previous, f"{entry['name']} differs from the previous writer's bytes"
