"""The dataset index (DIR/index.json): what `prepare` wrote and what the loader may trust.

read_index() checks the index against the files next to it (tokenizer sha256, each shard
present with the recorded size and the size its sample count implies) so a trainer fails
at start-up, naming the file, rather than mid-run; it only stats the shards. `inspect` goes
further: it checks each shard's sha256 and reads every sample.

Version 2 records a sha256 per shard, whose tar ends right after its last sample (see
shards.py). An index of another version (1: older `prepare`, no shard sha256, tars padded to
a 10240-byte record) is refused, naming its version: prepare the dataset again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from data_pipeline import DataError
from data_pipeline.shard_layout import record_bytes, samples_for_bytes, shard_bytes

INDEX_FILE = "index.json"
FORMAT_NAME = "denseformer-data"
FORMAT_VERSION = 2
SPLITS = ("train", "val")


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def token_dtype_for(vocab_size: int) -> str:
    """uint16 while every id fits, int32 beyond."""
    return "uint16" if vocab_size < 65536 else "int32"


def shard_name(split: str, number: int) -> str:
    return f"{split}-{number:06d}.tar"


def sample_key(position: int) -> str:
    """Key of the sample at this position of its split (zero-padded, no dots)."""
    return f"{position:010d}"


@dataclass(frozen=True)
class ShardInfo:
    """One tar shard: its file, how many samples it holds, its size and sha256."""

    name: str
    path: Path
    num_samples: int
    num_bytes: int
    sha256: str


@dataclass
class DatasetIndex:
    """Parsed index.json of a prepared dataset directory."""

    data_dir: Path
    version: int
    seq_len: int
    vocab_size: int
    eos_id: int
    token_dtype: str
    tokenizer_file: str
    tokenizer_sha256: str
    split_shards: dict[str, list[ShardInfo]]
    raw: dict = field(repr=False)

    @property
    def sample_len(self) -> int:
        """Tokens per stored sample: seq_len inputs plus one for the shifted target."""
        return self.seq_len + 1

    @property
    def tokenizer_path(self) -> Path:
        return self.data_dir / self.tokenizer_file

    @property
    def index_path(self) -> Path:
        return self.data_dir / INDEX_FILE

    def shards(self, split: str) -> list[ShardInfo]:
        """The shards of a split, in stored order."""
        if split not in self.split_shards:
            raise DataError(
                f"{self.index_path}: no split {split!r} (has {sorted(self.split_shards)})"
            )
        return list(self.split_shards[split])

    def num_samples(self, split: str) -> int:
        """Samples in a split (0 for an empty validation split)."""
        return sum(shard.num_samples for shard in self.shards(split))

    @property
    def inputs(self) -> dict:
        """Input summary recorded by prepare: files, documents, bytes, tokens."""
        return dict(self.raw.get("inputs", {}))


def _require(mapping: dict, key: str, kind: type | tuple, where: str, index_path: Path):
    if key not in mapping:
        raise DataError(f"{index_path}: missing key {where}{key}")
    value = mapping[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise DataError(f"{index_path}: key {where}{key} has a bad value {value!r}")
    return value


def parse_index(raw: dict, data_dir: Path) -> DatasetIndex:
    """Validate the structure of a loaded index.json (no file-system checks)."""
    index_path = data_dir / INDEX_FILE
    if not isinstance(raw, dict):
        raise DataError(f"{index_path}: expected a JSON object at the top level")
    fmt, version = raw.get("format"), raw.get("version")
    if fmt != FORMAT_NAME or version != FORMAT_VERSION or isinstance(version, bool):
        raise DataError(
            f"{index_path}: format {fmt!r} version {version!r}, expected {FORMAT_NAME!r} "
            f"version {FORMAT_VERSION}"
            + (" (version 1 is an older `prepare`'s: prepare the dataset again)"
               if fmt == FORMAT_NAME and version == 1 else "")
        )
    seq_len = _require(raw, "seq_len", int, "", index_path)
    vocab_size = _require(raw, "vocab_size", int, "", index_path)
    eos_id = _require(raw, "eos_id", int, "", index_path)
    token_dtype = _require(raw, "token_dtype", str, "", index_path)
    if seq_len < 1 or vocab_size < 2 or not 0 <= eos_id < vocab_size:
        raise DataError(
            f"{index_path}: inconsistent seq_len={seq_len} vocab_size={vocab_size} eos_id={eos_id}"
        )
    if token_dtype != token_dtype_for(vocab_size):
        raise DataError(
            f"{index_path}: token_dtype {token_dtype!r} does not match vocab_size {vocab_size}"
        )
    tokenizer = _require(raw, "tokenizer", dict, "", index_path)
    tokenizer_file = _require(tokenizer, "file", str, "tokenizer.", index_path)
    tokenizer_sha256 = _require(tokenizer, "sha256", str, "tokenizer.", index_path)
    splits = _require(raw, "splits", dict, "", index_path)
    split_shards = {}
    for split in SPLITS:
        entry = _require(splits, split, dict, "splits.", index_path)
        shard_list = _require(entry, "shards", list, f"splits.{split}.", index_path)
        infos = []
        for number, shard in enumerate(shard_list):
            where = f"splits.{split}.shards[{number}]."
            if not isinstance(shard, dict):
                raise DataError(f"{index_path}: {where[:-1]} is not an object")
            name = _require(shard, "name", str, where, index_path)
            samples = _require(shard, "samples", int, where, index_path)
            num_bytes = _require(shard, "bytes", int, where, index_path)
            if "/" in name or name.startswith(".") or samples < 1:
                raise DataError(f"{index_path}: bad shard entry {where[:-1]} = {shard!r}")
            digest = _require(shard, "sha256", str, where, index_path)
            if len(digest) != 64 or digest.strip("0123456789abcdef"):
                raise DataError(
                    f"{index_path}: key {where}sha256 has a bad value {digest!r} "
                    "(expected 64 lowercase hex digits)"
                )
            infos.append(ShardInfo(name, data_dir / name, samples, num_bytes, digest))
        split_shards[split] = infos
    return DatasetIndex(
        data_dir=data_dir,
        version=version,
        seq_len=seq_len,
        vocab_size=vocab_size,
        eos_id=eos_id,
        token_dtype=token_dtype,
        tokenizer_file=tokenizer_file,
        tokenizer_sha256=tokenizer_sha256,
        split_shards=split_shards,
        raw=raw,
    )


def read_index(data_dir: str | Path, check_files: bool = True) -> DatasetIndex:
    """Read and validate DIR/index.json; with check_files, also the tokenizer and shard sizes.

    Raises DataError naming the offending file.
    """
    data_dir = Path(data_dir).resolve()
    index_path = data_dir / INDEX_FILE
    if not data_dir.is_dir():
        raise DataError(f"{data_dir}: not a directory (expected a prepared dataset): "
                        f"`python -m data_pipeline prepare --input FILES --out {data_dir}` "
                        "makes one")
    if not index_path.is_file():
        raise DataError(
            f"{index_path}: missing; {data_dir} is not a prepared dataset "
            "(run `python -m data_pipeline prepare`)"
        )
    try:
        raw = json.loads(index_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DataError(f"{index_path}: not valid JSON ({error})") from error
    except OSError as error:
        raise DataError(f"{index_path}: unreadable ({error})") from error
    index = parse_index(raw, data_dir)
    if check_files:
        check_index_files(index)
    return index


def check_index_files(index: DatasetIndex) -> None:
    """Tokenizer hash, shard sizes and sample counts agree with the index (one stat a shard).

    Samples are fixed-size records, so a shard's size follows from its sample count: an
    index promising more samples than a shard holds (an IndexError at some later step) or
    fewer (a silent subset) is refused here.
    """
    # Imported here: shards.py imports this module for the shard and sample names.

    tokenizer_path = index.tokenizer_path
    if not tokenizer_path.is_file():
        raise DataError(f"{tokenizer_path}: tokenizer file named in {index.index_path} is missing")
    actual = sha256_file(tokenizer_path)
    if actual != index.tokenizer_sha256:
        raise DataError(
            f"{tokenizer_path}: sha256 {actual} differs from {index.tokenizer_sha256} "
            f"recorded in {index.index_path}"
        )
    record = record_bytes(index.sample_len, index.token_dtype)
    for split in SPLITS:
        for shard in index.shards(split):
            try:
                size = shard.path.stat().st_size
            except OSError as error:
                raise DataError(
                    f"{shard.path}: shard listed in the index is unreadable ({error.strerror})"
                ) from error
            holds = samples_for_bytes(size, record)
            if shard.num_samples not in holds:
                expected = shard_bytes(shard.num_samples, record)
                raise DataError(
                    f"{shard.path}: index says {shard.num_samples} samples, which make a "
                    f"{expected}-byte shard, but the file has {size} bytes "
                    f"({_describe_count(holds, record)}); the index does not match the shard"
                )
            if size != shard.num_bytes:
                raise DataError(
                    f"{shard.path}: {size} bytes on disk, index says {shard.num_bytes} "
                    "(truncated or replaced shard)"
                )


def _describe_count(holds: range, record: int) -> str:
    if not holds:
        return f"not a whole number of {record}-byte samples: truncated or not from prepare"
    return f"{holds.start} samples"


def write_index(raw: dict, data_dir: Path) -> Path:
    """Write index.json (after checking it parses back); returns its path."""
    parse_index(raw, data_dir)
    path = data_dir / INDEX_FILE
    path.write_text(json.dumps(raw, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path
