"""Input discovery and document reading for `prepare`.

Accepted inputs: files, directories (searched recursively) and glob patterns of
  .txt   documents separated by one or more blank lines (a file with no blank line is
         one document);
  .jsonl one JSON object per line with a string field "text" (one document per line);
and the same compressed with gzip (.txt.gz, .jsonl.gz). Files are read as UTF-8.
Documents are numbered in the order: inputs as given, each directory or glob expanded
in sorted order, documents in file order. A file that holds no document is an error.
"""

from __future__ import annotations

import glob
import gzip
import json
import re
from collections.abc import Iterator
from pathlib import Path

from data_pipeline import DataError

SUFFIXES = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz")
_BLANK_LINES = re.compile(r"\n(?:[ \t\r\f\v]*\n)+")


def _kind(path: Path) -> str | None:
    name = path.name
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return suffix
    return None


def expand_inputs(specs: list[str]) -> list[Path]:
    """Resolve files, directories and globs to a de-duplicated list of input files."""
    if not specs:
        raise DataError("no input given (pass --input FILE|DIR|GLOB ...)")
    files: list[Path] = []
    for spec in specs:
        path = Path(spec)
        if glob.has_magic(spec):
            matches = sorted(Path(match) for match in glob.glob(spec, recursive=True))
            found = [match for match in matches if match.is_file() and _kind(match)]
            if not found:
                raise DataError(f"{spec}: glob matches no {'/'.join(SUFFIXES)} file")
        elif path.is_dir():
            found = sorted(
                (p for p in path.rglob("*") if p.is_file() and _kind(p)),
                key=lambda p: p.relative_to(path).as_posix(),
            )
            if not found:
                raise DataError(f"{path}: directory holds no {'/'.join(SUFFIXES)} file")
        elif path.is_file():
            if not _kind(path):
                raise DataError(f"{path}: unsupported input type (expected one of {SUFFIXES})")
            found = [path]
        else:
            raise DataError(f"{path}: input does not exist")
        files += found
    unique, seen = [], set()
    for file in files:
        key = file.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(file)
    return unique


def _open_text(path: Path):
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _split_txt(text: str) -> list[str]:
    text = text.replace("\r\n", "\n")
    return [doc.strip("\n") for doc in _BLANK_LINES.split(text) if doc.strip()]


def read_documents(path: Path) -> Iterator[str]:
    """Yield the documents of one input file; DataError naming the file (and line) if bad."""
    kind = _kind(path)
    try:
        with _open_text(path) as stream:
            if kind.startswith(".txt"):
                yield from _split_txt(stream.read())
                return
            for line_number, line in enumerate(stream, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise DataError(f"{path}:{line_number}: not valid JSON ({error})") from error
                text = record.get("text") if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise DataError(f"{path}:{line_number}: no string field 'text'")
                if text.strip():
                    yield text
    except (OSError, EOFError, UnicodeDecodeError, gzip.BadGzipFile) as error:
        raise DataError(f"{path}: unreadable input ({error})") from error


def iter_documents(files: list[Path]) -> Iterator[str]:
    """All documents of all files, in document order."""
    for path in files:
        yield from read_documents(path)
