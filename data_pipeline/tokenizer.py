"""Sentencepiece tokenizer: training (for `prepare`) and loading (for everyone).

Training choices, all for faithful round trips of code-like text: identity normalisation,
whitespace kept as is, newline as its own piece, byte fallback (no <unk> for unseen
characters), digits split. Byte fallback reserves 256 ids, so --vocab-size must exceed
256 + the control symbols + the corpus' distinct characters (about 300 for tiny corpora).
Ids: 0 <unk>, 1 <s>, 2 </s> (the end-of-document token), 3 newline.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm

from data_pipeline import DataError
from data_pipeline.index import INDEX_FILE, sha256_file

TOKENIZER_FILE = "tokenizer.model"
# The trained pieces depend on sentencepiece's thread count, so it is fixed (not --workers)
# for the same tokenizer on every machine; oversubscribing a small machine costs little.
TRAIN_THREADS = 8


def train_tokenizer(lines: Iterable[str], model_path: Path, vocab_size: int, seed: int) -> Path:
    """Train a unigram sentencepiece model on `lines` and write it to model_path.

    The caller samples the lines (deterministically); sentencepiece itself samples nothing.
    The model is returned in memory and written by us, so no output path ends up inside
    it: the same lines give the same bytes. hard_vocab_limit is off, so a small corpus may
    give fewer pieces than asked for.
    """
    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model,
            vocab_size=vocab_size,
            model_type="unigram",
            character_coverage=0.9995,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            user_defined_symbols=["\n"],
            split_digits=True,
            hard_vocab_limit=False,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            num_threads=TRAIN_THREADS,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            minloglevel=2,
        )
    except RuntimeError as error:
        hint = ""
        if "smaller than required_chars" in str(error):
            hint = f" (--vocab-size {vocab_size} is too small for this corpus; raise it)"
        raise DataError(f"tokenizer training failed{hint}: {error}") from error
    model_path.write_bytes(model.getvalue())
    return model_path


def load_tokenizer(path: str | Path, expected_sha256: str | None = None):
    """A SentencePieceProcessor from a .model file, or from a prepared dataset directory.

    Given a dataset directory, the tokenizer named in its index.json is loaded and its
    sha256 checked against the index; given a file, against expected_sha256 if set.
    """
    path = Path(path)
    if path.is_dir():
        index_path = path / INDEX_FILE
        try:
            tokenizer = json.loads(index_path.read_text(encoding="utf-8"))["tokenizer"]
            path, expected_sha256 = path / tokenizer["file"], tokenizer["sha256"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise DataError(f"{index_path}: cannot find the tokenizer entry ({error})") from error
    if not path.is_file():
        raise DataError(f"{path}: tokenizer model file does not exist")
    if expected_sha256 is not None:
        actual = sha256_file(path)
        if actual != expected_sha256:
            raise DataError(f"{path}: sha256 {actual} differs from the expected {expected_sha256}")
    processor = spm.SentencePieceProcessor()
    try:
        processor.Load(str(path))
    except (OSError, RuntimeError) as error:
        raise DataError(f"{path}: not a sentencepiece model ({error})") from error
    return processor
