"""The layers of the code hold, and no import cycle joins its files
(docs/design.md#layering-of-the-code).

The house, bottom to top; a room may use its own floor and the floors below, never above:

    +---------------------------------------------------------------------------+
    | commands   *cli.py, cli/, __main__.py, slurm/, python -m parallel.<tool>  |
    +---------------------------------------------------------------------------+
    | run        pretrain/: config, trainer + engine, checkpoints, tracking,     |
    |            generation, evaluation, hf/                                     |
    +---------------------------------------------------------------------------+
    | strategies parallel/strategies/: pipeline, DDP, ZeRO, checkpointing,       |
    |            compile, memory estimates, ParallelSection                      |
    +---------------------------------------------------------------------------+
    | model      pretrain/model/: DenseFormerConfig, the DenseFormer, DWA        |
    +---------------------------------------------------------------------------+
    | base       data_pipeline/, parallel/__init__.py, parallel/primitives/      |
    +---------------------------------------------------------------------------+

Every `import` statement counts, wherever it stands: at the top of a file, inside a
function (a deferred import is still a dependency) or under `if TYPE_CHECKING:`. An edge
A -> B means file A imports module B; a cycle is a strongly connected set of files.
Besides the floors: nothing under parallel/ but command-line code reads the run config
(`pretrain.config`), and imports stand at the top of a file unless the library is heavy or
optional, or deferring it keeps a command quick to start (a `# deferred` comment says which).
Run `python tests/test_layering.py` to print every cycle and every upward import.
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

LAYERS = ("base", "model", "strategies", "run", "commands")  # bottom to top

# Libraries a function may import (with a `# deferred` comment saying why): slow to import
# (seconds), optional extras, or pulled in only by one command.
HEAVY = frozenset({"torch", "megatron", "deepspeed", "mlflow", "transformers", "tokenizers",
                   "accelerate", "lm_eval", "matplotlib", "triton", "scipy", "safetensors",
                   "sentencepiece", "webdataset", "wids"})

def layer(module: str) -> str:
    """The floor of a project module (the drawing above)."""
    parts = module.split(".")
    if (parts[0] == "slurm" or parts[-1] == "__main__" or parts[-1].endswith("cli")
            or "cli" in parts):
        return "commands"
    if parts[0] == "data_pipeline" or module == "parallel" or parts[:2] == ["parallel",
                                                                             "primitives"]:
        return "base"
    if parts[:2] == ["pretrain", "model"]:
        return "model"
    if parts[:2] == ["parallel", "strategies"]:
        return "strategies"
    if parts[0] == "pretrain":
        return "run"
    return "commands"  # parallel/plan/ and the like: the packages behind `python -m parallel.X`


def upward_imports(graph: dict[str, dict[str, int]]) -> list[tuple[str, str, int]]:
    """(importer, imported, line) of every import of a module on a higher floor."""
    return sorted((a, b, line) for a, edges in graph.items() for b, line in edges.items()
                  if LAYERS.index(layer(b)) > LAYERS.index(layer(a)))


def run_config_readers(graph: dict[str, dict[str, int]]) -> list[tuple[str, str, int]]:
    """(importer, imported, line) of every import of pretrain.config under parallel/ outside
    command-line code."""
    return sorted((a, b, line) for a, edges in graph.items() for b, line in edges.items()
                  if a.split(".")[0] == "parallel" and layer(a) != "commands"
                  and (b == "pretrain.config" or b.startswith("pretrain.config.")))


def _where(module: str, modules: dict[str, Path], line: int) -> str:
    return f"{modules[module].relative_to(ROOT)}:{line}"


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


def test_each_floor_imports_only_its_own_and_those_below():
    graph, modules = import_graph()
    found = upward_imports(graph)
    assert not found, "imports of a higher floor (move the shared piece down, or the " \
        "importer up):\n" + "\n".join(f"  {_where(a, modules, line)} ({layer(a)}) imports "
                                       f"{b} ({layer(b)})" for a, b, line in found)


def test_only_command_line_code_under_parallel_reads_the_run_config():
    graph, modules = import_graph()
    found = run_config_readers(graph)
    assert not found, "parallel/ reads the run config outside its command lines (take the " \
        "section or plain values):\n" + "\n".join(
            f"  {_where(a, modules, line)} imports {b}" for a, b, line in found)


def test_the_floors_are_assigned_as_drawn():
    assert [layer(m) for m in ("data_pipeline.loader", "parallel", "parallel.primitives.groups",
                               "pretrain.model.dwa", "parallel.strategies.zero",
                               "pretrain.config", "pretrain", "pretrain.generation",
                               "pretrain.cli", "pretrain.checkpoint_cli", "parallel.cli.plan",
                               "pretrain.__main__", "slurm.sweep", "parallel.plan")] == [
        "base", "base", "base", "model", "strategies", "run", "run", "run", "commands",
        "commands", "commands", "commands", "commands", "commands"]


def test_the_floor_checker_finds_an_upward_import():
    """The check itself: the model importing the run, a primitive importing the model, or a
    strategy reading the run config is reported, with its line."""
    graph = {"pretrain.model.dwa": {"pretrain.generation": 12, "parallel.primitives.tensor": 3},
             "parallel.primitives.groups": {"pretrain.model.config": 5},
             "parallel.strategies.plan": {"pretrain.config.sections": 9,
                                          "pretrain.model.config": 4},
             "parallel.cli.plan": {"pretrain.config": 7}}
    assert upward_imports(graph) == [
        ("parallel.primitives.groups", "pretrain.model.config", 5),
        ("parallel.strategies.plan", "pretrain.config.sections", 9),
        ("pretrain.model.dwa", "pretrain.generation", 12)]
    assert run_config_readers(graph) == [
        ("parallel.strategies.plan", "pretrain.config.sections", 9)]


def deferred_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, imported module, its comment) of every import inside a function of one file;
    the comment is a `# deferred ...` on the import's line or on the line above its block of
    imports ("" if none)."""
    source = path.read_text()
    lines = source.splitlines()
    found = []
    for function in ast.walk(ast.parse(source, str(path))):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = ["." * node.level + (node.module or "")]
            else:
                continue
            at = node.lineno - 1
            while at > 0 and lines[at - 1].lstrip().startswith(("import ", "from ")):
                at -= 1  # the top of this block of imports
            comment = next((line.strip() for line in (lines[node.lineno - 1], lines[at - 1])
                            if "# deferred" in line), "")
            found += [(node.lineno, name, comment[comment.index("# deferred"):] if comment
                       else "") for name in names]
    return found


def misplaced_imports(path: Path) -> list[int]:
    """Lines of the function-level imports the rule refuses: a heavy library without a
    `# deferred` comment, anything else without one that says it keeps a command's start-up
    quick."""
    return [line for line, name, comment in deferred_imports(path)
            if not comment or name.split(".")[0] not in HEAVY and "start" not in comment]


def test_imports_stand_at_the_top_of_files():
    """Only heavy or optional libraries, or what a command's start-up time keeps out, are
    imported inside a function, each with a `# deferred` comment saying why."""
    found = []
    for path in sorted(project_modules().values()):
        name = str(path.relative_to(ROOT))
        found += [f"{name}:{line}: {path.read_text().splitlines()[line - 1].strip()}"
                  for line in misplaced_imports(path)]
    assert not found, "move these imports to the top of the file (or, for a heavy library " \
        "or a command's start-up, say so in a `# deferred` comment):\n  " + "\n  ".join(found)


def test_the_import_placement_check_finds_a_function_level_import(tmp_path):
    """The check itself: a project module or a light library imported in a function is
    refused unless its comment names start-up time; a heavy one needs a comment."""
    source = tmp_path / "example.py"
    source.write_text("import json\n\n\ndef f():\n    from pretrain import optim\n"
                      "    import yaml  # deferred: keeps `python -m x --help` quick to start\n"
                      "    # deferred: heavy\n    import mlflow\n    import os\n"
                      "    import torch\n\n\ndef g():\n    import deepspeed\n")
    assert misplaced_imports(source) == [5, 9, 14]


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
    for importer, imported, at in upward_imports(found_graph):
        print(f"{_where(importer, found_modules, at)} ({layer(importer)}) imports {imported} "
              f"({layer(imported)})")
