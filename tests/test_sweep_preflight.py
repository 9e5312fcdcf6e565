"""`python -m slurm sweep --submit` runs every task's start-up checks before it queues
anything: a sweep whose tasks would fail (bad data.path, a truncated shard, a changed
tokenizer, an unwritable run directory) exits 2 naming the task and
the key, and writes nothing; `--no-preflight` skips the checks. No Slurm: PATH holds no
sbatch, so a sweep that got past the checks stops at "sbatch not found"."""

from __future__ import annotations

import shutil

import pytest

from slurm.__main__ import main
from tests.conftest import ROOT

TINY_SWEEP = ROOT / "configs/sweeps/tiny-cpu.yaml"


@pytest.fixture
def no_sbatch(tmp_path, monkeypatch):
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def _submit(out, *extra: str) -> int:
    return main(["sweep", str(TINY_SWEEP), "--submit", "--out", str(out), *extra])


def _spoil(data, how: str) -> list[str]:
    """Damage a copy of the dataset (or the config against it); the overrides to submit."""
    if how == "missing":
        return [f"data.path={data}-nope"]
    if how == "truncated shard":
        shard = data / "train-000000.tar"
        shard.write_bytes(shard.read_bytes()[:-512])
    if how == "tokenizer changed":
        tokenizer = data / "tokenizer.model"
        tokenizer.write_bytes(tokenizer.read_bytes() + b"\n")
    return [f"data.path={data}"]


@pytest.mark.parametrize("how, key, text", [
    ("missing", "data.path", "not a directory"),
    ("truncated shard", "data.path", "the index does not match the shard"),
    ("tokenizer changed", "data.path", "differs from"),
])
def test_a_sweep_whose_tasks_would_fail_is_not_queued(tmp_path, tiny_data, no_sbatch, capsys,
                                                      how, key, text):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    out = tmp_path / "out"
    assert _submit(out, *[x for o in _spoil(data, how) for x in ("--set", o)]) == 2
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert first.startswith("preflight: task 0 (tiny-cpu-transformer-L2-W32-D5.12k-s0) and 3 "
                            f"more task(s): 1, 2, 3: {key}: "), err
    assert text in first, err
    assert "4 of 4 task(s) would fail at start-up; nothing was submitted" in err
    assert "sbatch" not in err and not out.exists()  # nothing written, nothing queued


def test_an_unwritable_run_directory_is_named(tmp_path, tiny_data, no_sbatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the sweep directory would go")
    assert _submit(blocker / "out", "--set", f"data.path={tiny_data}") == 2
    err = capsys.readouterr().err
    assert f"preflight: the sweep: out: Slurm logs: out: {blocker} is not writable" in err
    assert "task 0 (tiny-cpu-transformer-L2-W32-D5.12k-s0) and 3 more task(s): 1, 2, 3: " \
           f"run.dir: {blocker} is not writable" in err


def test_no_preflight_submits_without_the_checks(tmp_path, tiny_data, no_sbatch, capsys):
    out = tmp_path / "out"
    assert _submit(out, "--no-preflight", "--set", f"data.path={tmp_path}/nope") == 2
    err = capsys.readouterr().err
    assert "sbatch not found" in err and "preflight" not in err
    assert (out / "sweep.json").is_file()  # written: the checks did not stop it
    # With good data the checks pass and the sweep goes on to sbatch.
    assert _submit(tmp_path / "out2", "--set", f"data.path={tiny_data}") == 2
    assert "sbatch not found" in capsys.readouterr().err
