"""Tiny corpora and datasets for the data-pipeline tests (seconds, not minutes)."""

from __future__ import annotations

import gzip
import json
import random
import tarfile
from pathlib import Path

from data_pipeline.prepare import prepare_dataset

SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "te", "vo", "zi", "pa", "qu", "ex", "on"]
EXTRA_CHARS = ["é", "ü", "中", "—", "(", ")", ",", ".", ":", "=", "_", "1", "2", "7"]
TINY_VOCAB = 400  # byte fallback alone takes 256 ids


def make_documents(count: int = 120, seed: int = 0) -> list[str]:
    """Unique synthetic documents: pseudo-words, some punctuation, unicode and newlines."""
    rng = random.Random(seed)
    words = ["".join(rng.choices(SYLLABLES, k=rng.randint(1, 3))) for _ in range(150)]
    docs = []
    for number in range(count):
        lines = []
        for _ in range(rng.randint(1, 4)):
            line = [rng.choice(words) for _ in range(rng.randint(3, 14))]
            if rng.random() < 0.3:
                line.insert(rng.randrange(len(line)), rng.choice(EXTRA_CHARS))
            lines.append(" ".join(line))
        if rng.random() < 0.2:
            lines.insert(1, f"    indented = line({number})")
        docs.append(f"doc{number} " + "\n".join(lines))
    return docs


def write_jsonl(path: Path, docs: list[str], compress: bool = False) -> Path:
    lines = "".join(json.dumps({"text": doc, "id": n}) + "\n" for n, doc in enumerate(docs))
    if compress:
        with gzip.open(path, "wt", encoding="utf-8") as stream:
            stream.write(lines)
    else:
        path.write_text(lines, encoding="utf-8")
    return path


def write_txt(path: Path, docs: list[str]) -> Path:
    """Documents separated by a blank line (the .txt convention of `prepare`)."""
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


def prepare_tiny(inputs: list, out: Path, **options):
    """prepare_dataset with tiny-corpus defaults: vocab 400, seq_len 16, 20% val, 1 worker."""
    settings = dict(vocab_size=TINY_VOCAB, seq_len=16, val_fraction=0.2, workers=1, progress=False)
    settings.update(options)
    return prepare_dataset([str(path) for path in inputs], out, **settings)


def downgrade_to_version_1(data_dir: Path) -> None:
    """Turn a prepared dataset into what an older `prepare` wrote: index version 1, no shard
    sha256, each tar padded with zeros to tarfile's 10240-byte record (byte for byte what
    tarfile.close() appends when nothing cuts it off)."""
    index_path = Path(data_dir) / "index.json"
    raw = json.loads(index_path.read_text())
    raw["version"] = 1
    for split in raw["splits"].values():
        for shard in split["shards"]:
            path = Path(data_dir) / shard["name"]
            data = path.read_bytes()
            path.write_bytes(data + bytes(-len(data) % tarfile.RECORDSIZE))
            shard["bytes"] = path.stat().st_size
            shard.pop("sha256", None)
    index_path.write_text(json.dumps(raw, indent=2))
