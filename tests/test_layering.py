"""No import cycles between the project's files (docs/design.md#layering-of-the-code).

Every `import` statement counts, wherever it stands: at the top of a file, inside a
function (a deferred import is still a dependency) or under `if TYPE_CHECKING:`. An edge
A -> B means file A imports module B; a cycle is a strongly connected set of files. Run
`python tests/test_layering.py` to print every cycle with the import lines that close it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pretrain", "parallel", "data_pipeline", "slurm")

# Cycles that other work on issue 13 is removing at the time of writing; each entry is the
# set of files in one cycle. Delete an entry once its cycle is gone: the test then keeps it
# gone (and fails on any cycle not listed here).
KNOWN_CYCLES: list[frozenset[str]] = [
]


def project_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the project's packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module `name` refers to (the longest existing prefix), if any."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def imports(module: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """{imported project module: line of the first import of it} for one file."""
    is_package = path.name == "__init__.py"
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package that holds this file
                package = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(package + ([base] if base else []))
            # `from pkg import name`: the submodule pkg.name if there is one, else pkg itself
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        for target in targets:
            resolved = _resolve(target, modules)
            if resolved is not None and resolved != module:
                found.setdefault(resolved, node.lineno)
    return found


def import_graph() -> tuple[dict[str, dict[str, int]], dict[str, Path]]:
    modules = project_modules()
    return {m: imports(m, p, modules) for m, p in modules.items()}, modules


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def describe(component: list[str], graph: dict[str, dict[str, int]],
             modules: dict[str, Path]) -> str:
    """The files of a cycle and the import lines between them."""
    members = set(component)
    lines = [f"  {modules[a].relative_to(ROOT)}:{line} imports {b}"
             for a in component for b, line in sorted(graph[a].items()) if b in members]
    return " <-> ".join(str(modules[m].relative_to(ROOT)) for m in component) + "\n" + \
        "\n".join(lines)


def _files(component: list[str], modules: dict[str, Path]) -> frozenset[str]:
    return frozenset(str(modules[m].relative_to(ROOT)) for m in component)


def test_no_import_cycles_between_project_files():
    graph, modules = import_graph()
    assert "pretrain.model.config" in graph and len(graph) > 40  # the scan sees the project
    new = [c for c in cycles(graph) if _files(c, modules) not in KNOWN_CYCLES]
    assert not new, "import cycles between files (break them by moving the shared piece " \
        "down a layer):\n" + "\n".join(describe(c, graph, modules) for c in new)


def test_the_cycle_finder_finds_a_cycle_through_a_deferred_import():
    """The check itself: a function-level import closing a loop is reported."""
    graph = {"a": {"b": 1}, "b": {"c": 3}, "c": {"a": 7}, "d": {"a": 2}}
    assert cycles(graph) == [["a", "b", "c"]]
    modules = project_modules()
    edges = imports("parallel.strategies.plan", modules["parallel.strategies.plan"], modules)
    assert "pretrain.model.config" in edges  # a top-level import is seen


if __name__ == "__main__":
    found_graph, found_modules = import_graph()
    for cycle in cycles(found_graph):
        print(describe(cycle, found_graph, found_modules), end="\n\n")
