"""The Hugging Face `tokenizers` backend: a tokenizer.json through prepare, run directories
and the Tokenizer interface (a tiny BPE trained here on the test corpus; nothing downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from data_fixtures import make_documents, prepare_tiny, write_jsonl

from data_pipeline import DataError
from data_pipeline.index import sha256_file
from data_pipeline.shards import read_shard_samples
from data_pipeline.tokenizer import copy_tokenizer, find_tokenizer_file, load_tokenizer

pytest.importorskip("tokenizers")  # the hf extra; .ci/run installs it


def train_bpe(docs: list[str], path: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE with GPT-2's special token, written as tokenizer.json at `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(docs, trainer)
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    return train_bpe(make_documents(), tmp_path_factory.mktemp("bpe") / "my-bpe.json")


def test_interface_round_trip_and_special_ids(bpe):
    tok = load_tokenizer(bpe)
    text = "def f(x):\n    return x + 1  # ünïcode"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.eos_id == 0 and tok.bos_id is None  # <|endoftext|>, the only special token
    assert tok.eos_id not in ids  # no special tokens added on encode
    assert tok.decode([*ids, tok.eos_id]) == text  # and dropped on decode
    assert tok.encode_batch([text, "x"]) == [ids, tok.encode("x")]
    assert tok.vocab_size == 300 and tok.sha256 == sha256_file(bpe)


def test_prepare_with_a_tokenizer_json_and_run_directory_copy(bpe, tmp_path):
    docs = make_documents()
    corpus = write_jsonl(tmp_path / "corpus.jsonl", docs)
    index = prepare_tiny([corpus], tmp_path / "ds", tokenizer=bpe, vocab_size=None,
                         val_fraction=0.0)
    raw = json.loads((tmp_path / "ds" / "index.json").read_text())
    assert raw["tokenizer"]["file"] == "tokenizer.json" and not raw["tokenizer"]["trained"]
    assert index.vocab_size == 300 and index.eos_id == 0

    tok = load_tokenizer(tmp_path / "ds")  # the dataset's copy, sha256 checked
    stream = np.concatenate([s for _, s in read_shard_samples(
        index.shards("train")[0].path, index.sample_len, index.token_dtype, 0)])
    first = stream[: np.flatnonzero(stream == tok.eos_id)[0]].tolist()
    assert tok.decode(first) == docs[0]  # EOS after each document, no BOS before

    # A directory holding a tokenizer.json (a Hugging Face model directory) works as well.
    assert load_tokenizer(tmp_path / "ds").sha256 == load_tokenizer(bpe).sha256

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "tokenizer.model").write_bytes(b"an older run's tokenizer")
    with pytest.raises(DataError, match="holds a different tokenizer"):
        copy_tokenizer(tmp_path / "ds", run_dir)  # a resumed run keeps its own
    copy_tokenizer(tmp_path / "ds", run_dir, replace=True)  # a fresh run replaces it
    assert find_tokenizer_file(run_dir) == run_dir / "tokenizer.json"
    assert not (run_dir / "tokenizer.model").exists()


def test_a_file_that_is_not_a_tokenizer_json_is_named(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"not": "a tokenizer"}')
    with pytest.raises(DataError, match=f"{bad}: not a Hugging Face tokenizer.json"):
        load_tokenizer(bad)
