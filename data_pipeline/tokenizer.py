"""The tokenizer interface, its sentencepiece backend, and training for `prepare`.

Every user (prepare, inspect, the trainer's run directory, generation, lm-eval) goes
through `Tokenizer`: encode, decode, vocabulary size, EOS/BOS ids and the sha256 of the file
it was loaded from. `load_tokenizer` picks the backend from the file name (`BACKENDS`): a
sentencepiece `tokenizer.model`, or a Hugging Face `tokenizers` `tokenizer.json` (the `hf`
extra), which is what released models ship.

Training choices (sentencepiece), all for faithful round trips of code-like text: identity
normalisation, whitespace kept as is, newline as its own piece, byte fallback (no <unk> for
unseen characters), digits split. Byte fallback reserves 256 ids, so --vocab-size must exceed
256 + the control symbols + the corpus' distinct characters (about 300 for tiny corpora).
Ids: 0 <unk>, 1 <s>, 2 </s> (the end-of-document token), 3 newline.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path

import sentencepiece as spm

from data_pipeline import DataError
from data_pipeline.index import INDEX_FILE, sha256_file

TOKENIZER_FILE = "tokenizer.model"
HF_TOKENIZER_FILE = "tokenizer.json"
# The trained pieces depend on sentencepiece's thread count, so it is fixed (not --workers)
# for the same tokenizer on every machine; oversubscribing a small machine costs little.
TRAIN_THREADS = 8


class Tokenizer(ABC):
    """Text <-> token ids. `path` is the file it was loaded from, `sha256` that file's hash
    (the value a dataset's index.json and a run's fingerprint record)."""

    def __init__(self, path: Path):
        self.path = path
        self.sha256 = sha256_file(path)

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids: every id is in [0, vocab_size)."""

    @property
    @abstractmethod
    def eos_id(self) -> int | None:
        """The end-of-document id (what `prepare` puts after each document), None if none."""

    @property
    @abstractmethod
    def bos_id(self) -> int | None:
        """The begin-of-sequence id, None if none (`prepare` does not use it)."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """The ids of `text` (no EOS/BOS added)."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text (a backend may do it faster)."""
        return [self.encode(text) for text in texts]

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`."""


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece .model file."""

    def __init__(self, path: Path):
        super().__init__(path)
        self._processor = spm.SentencePieceProcessor()
        try:
            self._processor.Load(str(path))
        except (OSError, RuntimeError) as error:
            raise DataError(f"{path}: not a sentencepiece model ({error})") from error

    @property
    def vocab_size(self) -> int:
        return self._processor.get_piece_size()

    @property
    def eos_id(self) -> int | None:
        return _id_or_none(self._processor.eos_id())

    @property
    def bos_id(self) -> int | None:
        return _id_or_none(self._processor.bos_id())

    def encode(self, text: str) -> list[int]:
        return self._processor.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._processor.encode(list(texts), num_threads=1)

    def decode(self, ids: Sequence[int]) -> str:
        return self._processor.decode([int(i) for i in ids])


def _id_or_none(token_id: int) -> int | None:
    return token_id if token_id >= 0 else None


# The special tokens that end and begin a document in the families whose tokenizer.json we
# read (Llama 2/Mistral, Llama 3, GPT-2/Qwen/our BPE, Gemma), first match wins. A
# tokenizer.json does not say which of its special tokens is EOS (a sidecar
# tokenizer_config.json does, and it is not copied with the file), so the ids come from the
# file alone and are the same wherever the file goes.
HF_EOS_TOKENS = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")
HF_BOS_TOKENS = ("<s>", "<|begin_of_text|>", "<bos>")


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer.json. Encoding adds no special tokens (`prepare`
    puts EOS after each document and no BOS, as with sentencepiece); decoding drops them."""

    def __init__(self, path: Path):
        super().__init__(path)
        try:
            # deferred: pulls in tokenizers (slow to start, or optional)
            from tokenizers import Tokenizer as RustTokenizer
        except ImportError as error:
            raise DataError(f"{path}: reading a tokenizer.json needs the `tokenizers` package: "
                            f"pip install -e .[hf]") from error
        try:
            self._tokenizer = RustTokenizer.from_file(str(path))
        except Exception as error:  # tokenizers raises its own Exception subclass
            raise DataError(f"{path}: not a Hugging Face tokenizer.json ({error})") from error

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def _first_id(self, names: tuple[str, ...]) -> int | None:
        for name in names:
            token_id = self._tokenizer.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    @property
    def eos_id(self) -> int | None:
        return self._first_id(HF_EOS_TOKENS)

    @property
    def bos_id(self) -> int | None:
        return self._first_id(HF_BOS_TOKENS)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


# File name -> backend; `find_tokenizer_file` looks for these names in a directory.
BACKENDS: dict[str, type[Tokenizer]] = {TOKENIZER_FILE: SentencePieceTokenizer,
                                        HF_TOKENIZER_FILE: HFTokenizer}


def backend_file_name(path: str | Path) -> str:
    """The name a tokenizer file gets in a dataset, run or export directory: its own if it
    is a name in BACKENDS, tokenizer.json for any other .json, else tokenizer.model (a
    sentencepiece model under another name, as `prepare --tokenizer` accepts)."""
    name = Path(path).name
    if name in BACKENDS:
        return name
    return HF_TOKENIZER_FILE if name.endswith(".json") else TOKENIZER_FILE


def find_tokenizer_file(directory: str | Path) -> Path | None:
    """The tokenizer file of a run or export directory (a name in BACKENDS), if any."""
    for name in BACKENDS:
        if (Path(directory) / name).is_file():
            return Path(directory) / name
    return None


def load_tokenizer(path: str | Path, expected_sha256: str | None = None) -> Tokenizer:
    """The Tokenizer of a tokenizer file, or of a prepared dataset directory.

    Given a dataset directory, the tokenizer named in its index.json is loaded and its
    sha256 checked against the index; given a file, against expected_sha256 if set. Given a
    directory without an index (a Hugging Face model directory), its tokenizer file. The
    backend is `backend_file_name`'s (`prepare --tokenizer` accepts any file name).
    """
    path = Path(path)
    if path.is_dir() and not (path / INDEX_FILE).exists() and find_tokenizer_file(path):
        path = find_tokenizer_file(path)
    if path.is_dir():
        index_path = path / INDEX_FILE
        try:
            tokenizer = json.loads(index_path.read_text(encoding="utf-8"))["tokenizer"]
            path, expected_sha256 = path / tokenizer["file"], tokenizer["sha256"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise DataError(f"{index_path}: cannot find the tokenizer entry ({error})") from error
    if not path.is_file():
        raise DataError(f"{path}: tokenizer model file does not exist")
    if expected_sha256 is not None:  # before parsing: a changed file is named as such
        actual = sha256_file(path)
        if actual != expected_sha256:
            raise DataError(f"{path}: sha256 {actual} differs from the expected "
                            f"{expected_sha256}")
    return BACKENDS[backend_file_name(path)](path)


def check_index_vocabulary(index) -> None:
    """DataError unless `index` (a DatasetIndex, its tokenizer's sha256 checked) gives its
    tokenizer's number of ids as vocab_size: an index whose vocab_size was lowered would
    otherwise surface as out-of-range token ids in some shard at some step."""
    tokenizer = load_tokenizer(index.tokenizer_path)
    if tokenizer.vocab_size != index.vocab_size:
        raise DataError(f"{index.index_path}: vocab_size {index.vocab_size} differs from the "
                        f"{tokenizer.vocab_size} ids of its tokenizer {tokenizer.path}: the "
                        "index was edited or names another tokenizer; prepare the data again")


def copy_tokenizer(source: str | Path, directory: str | Path,
                   expected_sha256: str | None = None, replace: bool = False) -> Path:
    """Copy a tokenizer file (or a dataset directory's) into `directory`, atomically; the
    copy gets its backend's file name, so `find_tokenizer_file(directory)` finds it. An
    identical copy already there is kept; a different one (of either backend) is replaced if
    `replace`, else an error (a run keeps the tokenizer it began with)."""
    tokenizer = load_tokenizer(source, expected_sha256)
    target = Path(directory) / backend_file_name(tokenizer.path)
    present = find_tokenizer_file(directory)
    if present is not None and not replace:
        if present != target or sha256_file(target) != tokenizer.sha256:
            raise DataError(f"{present}: holds a different tokenizer than {tokenizer.path} "
                            f"(sha256 {tokenizer.sha256})")
        return target
    for name in BACKENDS:  # the one tokenizer file of the directory
        if name != target.name:
            (Path(directory) / name).unlink(missing_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        shutil.copyfile(tokenizer.path, tmp)
        os.replace(tmp, target)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half copy behind
        raise
    return target


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
