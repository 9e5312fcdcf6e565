"""tests/tiers.py: the fast tier holds the unit tests, and a fast test that starts a process
fails."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import tests.test_model as model_tests
import tests.test_train as train_tests
import tests.tiers as tiers
from tests.conftest import ROOT


def _trains_through_a_helper_imported_here(tmp_path):
    from tests.test_train import run, train_cmd

    return run(train_cmd(tmp_path, tmp_path))


class _Steps:
    @staticmethod
    def launch():
        return train_tests.run(["true"])


def _uses_a_class_that_launches():
    return _Steps.launch()


def test_spawning_is_found_through_helpers_local_imports_and_classes():
    # A test helper that runs torchrun, one imported inside the function, a class's method:
    # each is reached from the code; a pure unit test reaches none.
    assert tiers._follow(train_tests.test_two_data_parallel_ranks_match_one, set())
    assert tiers._follow(_trains_through_a_helper_imported_here, set()).startswith("run")
    assert tiers._follow(_uses_a_class_that_launches, set())
    assert tiers._follow(model_tests.test_dwa_matches_naive_formula, set()) is None


class _FastItem:
    nodeid = "test_unit_in_the_fast_tier"

    @staticmethod
    def get_closest_marker(name):
        return pytest.mark.fast if name == "fast" else None


def test_a_fast_test_that_starts_a_process_fails_even_if_it_catches_the_error():
    phase = tiers._guarded(_FastItem())
    next(phase)  # the guard is up, as while a fast test runs
    with pytest.raises(tiers.SpawnInFastTier,
                       match=re.escape(f"Popen.__init__ from {Path(__file__).relative_to(ROOT)}")):
        subprocess.run([sys.executable, "-c", "pass"])
    try:
        import multiprocessing

        multiprocessing.get_context("spawn").Process(target=print).start()
    except tiers.SpawnInFastTier:
        pass  # swallowed: the phase still fails below
    with pytest.raises(tiers.SpawnInFastTier, match="fast_tier is marked fast but started"):
        phase.send(None)
    # The guard is down again: the real Popen runs.
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0


@pytest.mark.parametrize("named", [*tiers.SPAWNS_INSIDE_THE_PACKAGE, *tiers.TOO_SLOW_FOR_FAST])
def test_every_test_named_in_the_lists_exists(named):
    """A renamed test would otherwise leave its entry matching nothing, and the test fast."""
    module, _, name = named.partition("::")
    source = (tiers.TESTS_DIR / module).read_text()
    assert not name or re.search(rf"^def {re.escape(name)}\(", source, re.MULTILINE), named
