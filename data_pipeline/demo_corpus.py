"""A demo corpus with no download: docstrings and comments of the Python standard library.

Every machine of this kind has the running interpreter's stdlib sources, so the corpus is
the same on every such machine with the same Python installation. Files are visited in
sorted relative-path order; each docstring (module, class, function) and each block of
consecutive full-line comments becomes one document. Output is JSON lines with a `text`
field (plus `source`, the stdlib-relative path, for curiosity).
"""

from __future__ import annotations

import ast
import contextlib
import json
import multiprocessing
import os
import sysconfig
from pathlib import Path

from data_pipeline import DataError
from data_pipeline.progress import progress_bar

# Shorter comment blocks are mostly noise: markers such as "XXX", "TODO" or rows of "#".
MIN_COMMENT_CHARS = 16
SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_dir() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path) -> list[Path]:
    """All .py files under root (third-party packages excluded), in sorted relative order."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS]
        found += [Path(dirpath) / name for name in filenames if name.endswith(".py")]
    return sorted(found, key=lambda path: path.relative_to(root).as_posix())


def _multiline_string_interiors(tree: ast.AST) -> set[int]:
    """Line numbers strictly inside a multi-line string literal (not code, not comments)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Constant, ast.JoinedStr)) and node.end_lineno is not None:
            if node.end_lineno > node.lineno:
                inside.update(range(node.lineno + 1, node.end_lineno + 1))
    return inside


def _comment_blocks(lines: list[str], string_lines: set[int]) -> list[str]:
    """Runs of consecutive full-line comments, '#' and one following space removed."""
    blocks, current = [], []
    for lineno, line in enumerate(lines, start=1):
        stripped = line.strip()
        is_comment = stripped.startswith("#") and lineno not in string_lines
        # Shebang and coding cookies are directives, not prose.
        if is_comment and (stripped.startswith("#!") or "-*- coding" in stripped):
            is_comment = False
        if is_comment:
            body = stripped.lstrip("#")
            current.append(body[1:] if body.startswith(" ") else body)
            continue
        if current:
            blocks.append("\n".join(current).strip())
            current = []
    if current:
        blocks.append("\n".join(current).strip())
    return [block for block in blocks if len(block) >= MIN_COMMENT_CHARS]


def extract_documents(path: Path) -> list[str]:
    """Docstrings then comment blocks of one source file; [] if it does not parse."""
    try:
        source_bytes = path.read_bytes()
        tree = ast.parse(source_bytes)
        text = source_bytes.decode("utf-8")
    except (SyntaxError, ValueError, UnicodeDecodeError, OSError):
        # A few stdlib files are deliberately invalid (test data for the parser).
        return []
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=True)
            if docstring and docstring.strip():
                docs.append(docstring.strip())
    docs += _comment_blocks(text.splitlines(), _multiline_string_interiors(tree))
    return docs


def build_demo_corpus(
    out: Path, max_mb: float = 8.0, workers: int | None = None, progress: bool = True
) -> dict:
    """Write the demo corpus to `out` (.jsonl); returns {"files", "documents", "bytes"}.

    Stops after the document that takes the text past max_mb * 10**6 bytes (UTF-8).
    """
    out = Path(out)
    if out.suffix != ".jsonl":
        raise DataError(f"demo corpus output must end in .jsonl, got {out}")
    if max_mb <= 0:
        raise DataError(f"--max-mb must be positive, got {max_mb}")
    root = stdlib_dir()
    sources = stdlib_sources(root)
    if not sources:
        raise DataError(f"no .py files found in the standard library directory {root}")
    budget = int(max_mb * 1e6)
    stats = {"files": 0, "documents": 0, "bytes": 0, "stdlib": str(root)}
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    workers = workers or os.cpu_count() or 1
    bar = progress_bar(progress, total=len(sources), desc="demo-corpus", unit="file",
                       log_interval_s=30.0)
    try:
        with contextlib.ExitStack() as stack:
            sink = stack.enter_context(open(partial, "w", encoding="utf-8"))
            if workers == 1:
                extracted = map(extract_documents, sources)
            else:  # leaving the stack terminates the pool, also after an early stop
                pool = stack.enter_context(multiprocessing.get_context("spawn").Pool(workers))
                # imap keeps the sorted file order whatever the number of workers.
                extracted = pool.imap(extract_documents, sources, chunksize=8)
            for path, docs in zip(sources, extracted, strict=True):
                bar.update(1)
                if docs:
                    stats["files"] += 1
                for doc in docs:
                    record = {"text": doc, "source": path.relative_to(root).as_posix()}
                    sink.write(json.dumps(record, ensure_ascii=False) + "\n")
                    stats["documents"] += 1
                    stats["bytes"] += len(doc.encode("utf-8"))
                if stats["bytes"] >= budget:
                    break
        os.replace(partial, out)
    finally:
        bar.close()
        partial.unlink(missing_ok=True)
    return stats
