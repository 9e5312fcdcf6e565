"""demo-corpus: stdlib docstrings and comments, deterministic."""

from __future__ import annotations

import json
import textwrap

import pytest

from data_pipeline.__main__ import main
from data_pipeline.demo_corpus import (
    build_demo_corpus,
    extract_documents,
    stdlib_dir,
    stdlib_sources,
)


def test_extracts_docstrings_and_comment_blocks(tmp_path):
    source = tmp_path / "example.py"
    source.write_text(
        textwrap.dedent('''\
        #!/usr/bin/env python3
        # -*- coding: utf-8 -*-
        """Module docstring."""

        # First comment line of a block,
        # and its second line.
        x = 1  # a trailing comment is not a block

        TEXT = """
        # not a comment: this line is inside a string literal
        """


        class Thing:
            """Class docstring.

            Detail.
                Indented detail.
            """

            def method(self):
                """Method docstring."""
        ''')
    )
    assert extract_documents(source) == [
        "Module docstring.",
        "Class docstring.\n\nDetail.\n    Indented detail.",
        "Method docstring.",
        "First comment line of a block,\nand its second line.",
    ]
    broken = tmp_path / "broken.py"
    broken.write_text("def (:\n")
    assert extract_documents(broken) == []


@pytest.mark.timeout(120)
def test_demo_corpus_is_deterministic(tmp_path, capsys):
    first = build_demo_corpus(tmp_path / "a.jsonl", max_mb=0.3, workers=1, progress=False)
    assert main(["demo-corpus", "--out", str(tmp_path / "b.jsonl"), "--max-mb", "0.3"]) == 0
    assert "documents" in capsys.readouterr().out
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    records = [json.loads(line) for line in (tmp_path / "a.jsonl").open()]
    assert len(records) == first["documents"] > 100
    assert all(isinstance(r["text"], str) and r["text"].strip() for r in records)
    assert 0.3e6 <= first["bytes"] < 0.3e6 + max(len(r["text"].encode()) for r in records)
    # Sorted relative-path order of the stdlib sources.
    root = stdlib_dir()
    order = [path.relative_to(root).as_posix() for path in stdlib_sources(root)]
    sources = list(dict.fromkeys(r["source"] for r in records))
    assert sources == sorted(sources, key=order.index)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial file
