"""Every documentation reference in the repository points at something that exists.

Checked: each `docs/NAME.md` (and `docs/NAME.md#anchor`) cited in README.md, docs/*.md, the
.py/.sh/.sbatch/.yaml/.toml files and scripts such as .ci/run; each relative link in the
markdown files; and that nothing cites the design notes that live outside the repository, or
the retired `docs_*.md` files; and each repository path named anywhere in that text (code
comments and docstrings included: `tests/test_zero.py`, `configs/paper/`), where
`{a,b}` is expanded, `*` is a glob and an all-capitals part (`MODEL`) stands for any name.
Anchors are GitHub's: the heading text lower-cased,
punctuation dropped, spaces turned into hyphens, a `-1`, `-2`, ... suffix on repeats.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE_SUFFIXES = {".py", ".sh", ".sbatch", ".yaml", ".yml", ".toml"}
# Not part of the repository's own text: environments, generated and ignored outputs.
SKIP_DIRS = {".git", ".venv", ".pytest_cache", ".torch_extensions", "__pycache__", "build",
             "data", "runs", "fits", "logs"}

# "docs/pipeline.md" or "docs/pipeline.md#what-crosses-a-stage-boundary"
DOCS_CITATION = re.compile(r"(?<![\w/.-])docs/([\w./-]+?\.md)(#[\w-]+)?")
# Markdown link targets: [text](target) and [text]: target
MD_LINK = re.compile(r"\]\(([^)\s]+)\)|^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)
# The design notes outside the repository, spelled so this file does not cite them itself.
OUTSIDE_NOTES = re.compile(r"DESIGN" r"\.md")
RETIRED_DOCS = re.compile(r"\bdocs_\w+\.md\b")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`\n]*`")
THIS = Path(__file__).name
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def repository_files() -> list[Path]:
    """README, docs/*.md and the source, script and config files of the checkout."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        # Prune in place so os.walk never descends into .venv and the other skipped folders.
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for name in files:
            path = Path(folder) / name
            # This file's own examples name made-up files on purpose.
            if name == THIS:
                continue
            if path.suffix in SOURCE_SUFFIXES or path.suffix == ".md" or is_script(path):
                found.append(path)
    return sorted(found)


def is_script(path: Path) -> bool:
    """An executable text file without a suffix, such as .ci/run (it starts with #!)."""
    if path.suffix:
        return False
    with path.open("rb") as f:
        return f.read(2) == b"#!"


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading (before de-duplication)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link shows its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(markdown: Path) -> frozenset[str]:
    """Anchors of every heading outside code blocks, with GitHub's -1, -2 suffixes."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in markdown.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_code = not in_code
            continue
        match = None if in_code else HEADING.match(line)
        if match:
            base = github_anchor(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return frozenset(out)


def prose(markdown: str) -> str:
    """The markdown without code blocks and inline code, where brackets are not links."""
    lines, in_code = [], False
    for line in markdown.splitlines():
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code:
            lines.append(INLINE_CODE.sub("", line))
    return "\n".join(lines)


def check_target(source: Path, target: Path, anchor: str | None, what: str) -> str | None:
    """A message if target (or its anchor) does not exist, else None."""
    rel_source = source.relative_to(ROOT)
    if not target.is_file():
        return f"{rel_source}: cites {what}, but {target.relative_to(ROOT)} does not exist"
    if anchor and target.suffix == ".md" and anchor not in anchors(target):
        return (f"{rel_source}: cites {what}, but {target.relative_to(ROOT)} has no heading "
                f"with anchor #{anchor}")
    return None


def broken_references(path: Path) -> list[str]:
    """Every reference in path that points at a missing file or heading."""
    text = path.read_text(encoding="utf-8", errors="replace")
    problems = []
    for match in DOCS_CITATION.finditer(text):
        anchor = match.group(2)[1:] if match.group(2) else None
        problem = check_target(path, ROOT / "docs" / match.group(1), anchor, match.group(0))
        if problem:
            problems.append(problem)
    if path.suffix == ".md":
        for match in MD_LINK.finditer(prose(text)):
            link = match.group(1) or match.group(2)
            if re.match(r"^[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
                continue
            file_part, _, anchor = link.partition("#")
            target = (path.parent / file_part).resolve() if file_part else path
            if ROOT not in target.parents and target != ROOT:
                problems.append(f"{path.relative_to(ROOT)}: link {link} leaves the repository")
                continue
            problem = check_target(path, target, anchor or None, link)
            if problem:
                problems.append(problem)
    for pattern, why in ((OUTSIDE_NOTES, "design notes outside the repository"),
                         (RETIRED_DOCS, "a docs_*.md file that no longer exists")):
        for match in pattern.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            problems.append(f"{path.relative_to(ROOT)}:{line}: cites {match.group(0)} "
                            f"({why}); point at a file under docs/ instead")
    return list(dict.fromkeys(problems))  # one message per broken reference


@functools.lru_cache(maxsize=None)
def repository_path(root: Path) -> re.Pattern:
    """A path under one of the repository's top-level folders (those holding its files:
    .ci, pretrain, tests, ...), not part of a longer path (a brace counts only with a comma
    in it: `{r.name}` in an f-string ends the path)."""
    folders = "|".join(sorted({re.escape(p.relative_to(root).parts[0])
                               for p in repository_files() if p.parent != root}))
    return re.compile(rf"(?<![\w/.$~-])((?:{folders})/(?:[\w.*/-]|\{{[\w.-]*,[\w.,-]*\}})*)")


def named_paths_exist(root: Path, named: str) -> bool:
    """Whether every path `named` stands for (braces expanded) exists: a glob for `*` and
    for the all-capitals parts that stand for a name."""
    named = named.rstrip(".-")
    pieces = re.split(r"(\{[^}]*\})", named)
    options = [p[1:-1].split(",") if p.startswith("{") else [p] for p in pieces]
    for choice in itertools.product(*options):
        path = "".join(choice)
        pattern = re.sub(r"(?<![a-z])[A-Z][A-Z_]+(?![a-z])", "*", path)
        if not (any(root.glob(pattern)) if "*" in pattern else (root / path).exists()):
            return False
    return True


def missing_paths(path: Path) -> list[str]:
    """Each repository path named in `path` that does not exist, with its line."""
    text = path.read_text(encoding="utf-8", errors="replace")
    problems = []
    for match in repository_path(ROOT).finditer(text):
        if not named_paths_exist(ROOT, match.group(1)):
            line = text.count("\n", 0, match.start()) + 1
            problems.append(f"{path.relative_to(ROOT)}:{line}: names {match.group(1)}, "
                            "which does not exist")
    return problems


def test_every_repository_path_named_exists():
    problems = [p for path in repository_files() for p in missing_paths(path)]
    assert not problems, "paths named that do not exist:\n" + "\n".join(problems)


def test_every_cited_docs_file_and_anchor_exists():
    files = repository_files()
    assert ROOT / "README.md" in files, "README.md is missing"
    assert any(p.parent == ROOT / "docs" for p in files), "docs/ holds no .md file"
    problems = [p for path in files for p in broken_references(path)]
    assert not problems, "broken documentation references:\n" + "\n".join(problems)


def test_readme_links_into_every_docs_file():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md"))
               if f"docs/{p.name}" not in readme]
    assert not missing, f"README.md does not link to docs/{', docs/'.join(missing)}"


@pytest.mark.parametrize("heading, anchor", [
    ("What crosses a stage boundary", "what-crosses-a-stage-boundary"),
    ("ZeRO (DeepSpeed, `parallel/strategies/zero.py`)", "zero-deepspeed-parallelstrategieszeropy"),
    ("Slurm: launchers, preemption, sweeps", "slurm-launchers-preemption-sweeps"),
    ("`DIR/index.json`", "dirindexjson"),
    ("Step time (CPU, tiny shape)", "step-time-cpu-tiny-shape"),
])
def test_github_anchor(heading, anchor):
    assert github_anchor(heading) == anchor


def test_checker_catches_a_missing_file_and_anchor(tmp_path, monkeypatch):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# A\n\n## Real heading\n\n```\n# not a heading\n```\n")
    src = tmp_path / "mod.py"
    src.write_text('"""See docs/a.md#real-heading, docs/a.md#not-a-heading and docs/b.md."""\n'
                   "# DESIGN" ".md section 4\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    problems = broken_references(src)
    assert len(problems) == 3, problems
    assert "no heading with anchor #not-a-heading" in problems[0]
    assert "docs/b.md does not exist" in problems[1]
    assert "mod.py:2: cites DESIGN" in problems[2]


def test_path_checker_catches_a_missing_path_and_reads_patterns(tmp_path, monkeypatch):
    for name in ("tests/test_zero.py", "configs/paper/dense-48-1x1.yaml",
                 "configs/paper/dense-48-4x5.yaml"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    src = tmp_path / "mod.py"
    src.write_text("# tests/test_zero.py, configs/paper/, configs/paper/dense-48-{1x1,4x5}.yaml,\n"
                   "# configs/paper/MODEL.yaml, tests/test_*.py, runs/x/step-1 (not tracked)\n"
                   "# tests/test_deepspeed_compat.py and configs/paper/dense-48-{1x1,2x2}.yaml\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert missing_paths(src) == [
        "mod.py:3: names tests/test_deepspeed_compat.py, which does not exist",
        "mod.py:3: names configs/paper/dense-48-{1x1,2x2}.yaml, which does not exist"]
