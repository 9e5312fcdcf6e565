"""The fast test tier: which tests are unit tests, and a guard that keeps them so.

A test is in the fast tier (marker `fast`, run by `bash scripts/test.sh --fast`) unless it
can start another process: a multi-rank spawn (`tests/distributed.py`), a CLI subprocess
(`subprocess`, `torchrun`, `cli_env`) or any `multiprocessing` use. That is decided from the
code, not from a list kept by hand: the names the test function uses (its body, nested
functions, the helpers and classes it calls that are defined under tests/, and the fixtures
it requests, followed the same way) are searched for a spawning name or an object from a
spawning module. Library code is not followed, so a test whose spawn happens inside the
package is named in `SPAWNS_INSIDE_THE_PACKAGE`; single-process tests too long for the tier
are named in `TOO_SLOW_FOR_FAST`.

The guard makes a mistake loud: while a `fast` test sets up or runs, starting a process from
its thread (`subprocess.Popen`, `multiprocessing` processes, `os.system`, `os.posix_spawn`)
raises `SpawnInFastTier`, and the test fails even if it caught that error.
"""

from __future__ import annotations

import importlib
import inspect
import multiprocessing.process
import os
import platform
import subprocess
import threading
import traceback
import types
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
ROOT = TESTS_DIR.parent
PLATFORM_FILE = Path(platform.__file__)

# Names whose use means another process: the multi-rank helper, the CLI environment, and
# the modules that start processes (as module names, attributes or imported objects).
SPAWNING_NAMES = frozenset({
    "run_distributed_test", "cli_env", "subprocess", "multiprocessing", "Popen",
    "torchrun", "start_processes", "posix_spawn", "system",
})
SPAWNING_MODULES = ("subprocess", "multiprocessing", "torch.multiprocessing",
                    "tests.distributed", "distributed")

# Tests whose process starts inside the package (not visible from the test's own code),
# by module or by `module::test name` (without parameters), with what starts it.
SPAWNS_INSIDE_THE_PACKAGE: dict[str, str] = {
    "test_data_demo.py::test_demo_corpus_is_deterministic": "build_demo_corpus's worker pool",
    "test_data_prepare.py::test_output_does_not_depend_on_workers_and_tokenizer_is_reused":
        "prepare_dataset's worker pool",
    "test_data_errors.py::test_corrupted_shard_same_size": "TrainLoader's DataLoader workers",
    "test_data_loader.py::test_resume_mid_epoch_and_across_epochs": "DataLoader workers",
    "test_data_loader.py::test_state_counts_yielded_batches_not_prefetched": "DataLoader workers",
    "test_tracking.py::test_git_commit": "git, run by pretrain.tracking.git_commit",
    "test_tracking.py::test_mlflow_run_is_continued_on_resume": "git, run by the tracker",
    "test_step_rows.py::test_tracker_logs_many_rows_in_requests_mlflow_accepts":
        "git, run by the tracker",
    "test_sweep_preflight.py::test_no_preflight_submits_without_the_checks":
        "sbatch, run by slurm.sweep",
    "test_hc_kernels.py::test_build_is_cached_per_source_and_a_failing_compiler_falls_back":
        "the C compiler, run by pretrain.model.hc_native.build",
}

# Single-process tests left out of the fast tier for time alone: what they wait on, and their
# seconds in `scripts/test.sh --fast` on 2 cores loaded by other jobs (2026-12-05).
TOO_SLOW_FOR_FAST: dict[str, str] = {
    "test_study_report.py::test_report_picks_best_lr_and_pairs_by_seed":
        "an MLflow store of many runs, 10 s",
    "test_study_report.py::test_cpu_mfu_is_against_one_measured_matmul_and_says_so":
        "an MLflow store, 10 s",
    "test_slurm_sweep.py::test_fit_command_on_a_synthetic_store": "an MLflow store, 9 s",
    "test_tracking.py::test_unreachable_server_is_a_config_error_within_30s":
        "MLflow's connection timeouts, 5 s",
}


class SpawnInFastTier(RuntimeError):
    """A test marked `fast` tried to start a process."""


def _uses_spawning(code: types.CodeType, namespace: dict, seen: set) -> str | None:
    """The spawning name reached from `code` (run with globals `namespace`), or None."""
    if code in seen:
        return None
    seen.add(code)
    # A function-level `from tests.x import helper` puts both names in co_names, and so does
    # `x.helper` with x a test module: look the helper up in those modules too.
    namespaces = [namespace] + [vars(importlib.import_module(name)) for name in code.co_names
                                if name.startswith("tests.") and _is_module(name)]
    namespaces += [vars(value) for value in map(namespace.get, code.co_names)
                   if isinstance(value, types.ModuleType)
                   and _in_tests(getattr(value, "__file__", None) or "/")]
    for name in code.co_names:
        if name in SPAWNING_NAMES:
            return name
        value = next((space[name] for space in namespaces if name in space), None)
        found = _follow(value, seen)
        if found:
            return f"{name} -> {found}" if found != name else name
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found = _uses_spawning(const, namespace, seen)
            if found:
                return found
    return None


def _is_module(name: str) -> bool:
    """Whether `name` (from a code object's names) is a module under tests/."""
    return (TESTS_DIR / (name.removeprefix("tests.").replace(".", "/") + ".py")).is_file()


def _follow(value, seen: set) -> str | None:
    """The spawning name a module-level object of a test module leads to, or None."""
    if value is None:
        return None
    if isinstance(value, types.ModuleType):
        return value.__name__ if value.__name__ in SPAWNING_MODULES else None
    module = getattr(value, "__module__", None) or ""
    if module in SPAWNING_MODULES:
        return f"{module}.{getattr(value, '__name__', '?')}"
    if inspect.isclass(value):
        if not _defined_in_tests(value):
            return None
        for member in vars(value).values():
            found = _follow(member, seen)
            if found:
                return found
        return None
    func = inspect.unwrap(value) if callable(value) else None
    func = getattr(func, "__func__", func)  # bound and static methods
    code = getattr(func, "__code__", None)
    if code is None or not _in_tests(code.co_filename):
        return None
    return _uses_spawning(code, func.__globals__, seen)


def _defined_in_tests(cls) -> bool:
    try:
        return _in_tests(inspect.getfile(cls))
    except (TypeError, OSError):
        return False


def _in_tests(filename: str) -> bool:
    return Path(filename).resolve().is_relative_to(TESTS_DIR)


def spawn_reason(item: pytest.Item) -> str | None:
    """Why `item` may start a process (a name it reaches), or None for a unit test."""
    module = Path(str(item.fspath)).name
    base = f"{module}::{item.originalname}" if hasattr(item, "originalname") else item.nodeid
    for key in (module, base):
        if key in SPAWNS_INSIDE_THE_PACKAGE:
            return SPAWNS_INSIDE_THE_PACKAGE[key]
    seen: set = set()
    found = _follow(getattr(item, "obj", None), seen)
    if found:
        return found
    fixture_info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        for fixture in (fixture_info.name2fixturedefs.get(name, ()) if fixture_info else ()):
            found = _follow(fixture.func, seen)
            if found:
                return f"fixture {name}: {found}"
    return None


def too_slow(item: pytest.Item) -> bool:
    module = Path(str(item.fspath)).name
    return module in TOO_SLOW_FOR_FAST or \
        f"{module}::{getattr(item, 'originalname', item.name)}" in TOO_SLOW_FOR_FAST


def pytest_collection_modifyitems(config, items) -> None:
    """Mark every unit test `fast` (see the module docstring)."""
    for item in items:
        if spawn_reason(item) is None and not too_slow(item):
            item.add_marker(pytest.mark.fast)


def _harmless(stack: list[traceback.FrameSummary]) -> bool:
    """A process started by the standard library's `platform` (`uname -p`, asked by MLflow
    on import): it queries the machine; it is not what the tier keeps out."""
    return any(Path(frame.filename) == PLATFORM_FILE for frame in stack)


def _project_caller(stack: list[traceback.FrameSummary]) -> str:
    """file:line function of the innermost project frame (not the venv's, not this file)."""
    for frame in reversed(stack):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(ROOT) and not path.is_relative_to(ROOT / ".venv") \
                and path != Path(__file__).resolve():
            return f"{path.relative_to(ROOT)}:{frame.lineno} {frame.name}"
    return "outside the project"


def _refuse(what: str, original, attempts: list):
    test_thread = threading.get_ident()

    def refuse(*args, **kwargs):
        stack = traceback.extract_stack()[:-1]
        # Another thread (one an earlier test left running) is not this test's doing.
        if threading.get_ident() != test_thread or _harmless(stack):
            return original(*args, **kwargs)
        attempts.append(f"{what} from {_project_caller(stack)}")
        raise SpawnInFastTier(
            f"a test in the fast tier started a process: {attempts[-1]}. If the test "
            "spawns in a helper under tests/, name it in SPAWNING_NAMES; if in the package, "
            "name the test in SPAWNS_INSIDE_THE_PACKAGE (tests/tiers.py)")
    return refuse


def _guarded(item: pytest.Item):
    """Run one phase of `item` with process starts refused when it is in the fast tier."""
    if item.get_closest_marker("fast") is None:
        return (yield)
    attempts: list[str] = []
    patches = [(subprocess.Popen, "__init__"), (multiprocessing.process.BaseProcess, "start"),
               (os, "system"), (os, "posix_spawn"), (os, "posix_spawnp")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in patches]
    for owner, name, original in saved:
        setattr(owner, name, _refuse(f"{getattr(owner, '__name__', owner)}.{name}", original,
                                     attempts))
    try:
        result = yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
    if attempts:
        raise SpawnInFastTier(f"{item.nodeid} is marked fast but started a process: "
                              f"{attempts[0]}")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guarded(item))
