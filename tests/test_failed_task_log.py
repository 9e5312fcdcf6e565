"""A sweep task that fails ends its log with its one-line cause, with nothing of torchrun's
after it, and `python -m slurm report` shows that line for the run. No Slurm: the sweep is
written with --no-preflight (PATH holds no sbatch), then its task 0 is run by the node
launcher as train.sbatch would run it, its stderr into the task's log file."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from parallel.primitives.groups import free_port
from slurm.__main__ import main
from tests.conftest import ROOT, cli_env

TINY_SWEEP = ROOT / "configs/sweeps/tiny-cpu.yaml"


@pytest.mark.timeout(300)
def test_a_failed_task_ends_its_log_with_the_cause_and_the_report_shows_it(tmp_path,
                                                                          monkeypatch):
    out, bad = tmp_path / "sweep", tmp_path / "nope"
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch: stops after writing the sweep
    assert main(["sweep", str(TINY_SWEEP), "--submit", "--no-preflight", "--out", str(out),
                 "--set", f"data.path={bad}"]) == 2
    monkeypatch.undo()
    log, cause_file = out / "logs" / "tiny-cpu-7_0.out", tmp_path / "cause"
    env = {**cli_env(), "SLURM_ARRAY_TASK_ID": "0", "DENSEFORMER_CAUSE_FILE": str(cause_file)}
    with open(log, "w") as stream:
        done = subprocess.run([sys.executable, "-m", "slurm", "launch", "--sweep", str(out),
                               "--rdzv-host", "127.0.0.1", "--rdzv-port", str(free_port())],
                              env=env, cwd=ROOT, stdout=stream, stderr=subprocess.STDOUT,
                              timeout=240)
    lines = log.read_text().splitlines()
    assert done.returncode == 2, lines
    cause = (f"{bad}: not a directory (expected a prepared dataset): `python -m data_pipeline "
             f"prepare --input FILES --out {bad}` makes one")
    assert lines[-1] == f"launcher: error: {cause}", lines
    assert f"error: {cause}" in lines  # the rank said it first
    text = "\n".join(lines)
    assert "Traceback" not in text and "ChildFailedError" not in text, text
    assert "torchrun: rank 0 exited with status 2" in text
    assert cause_file.read_text() == cause + "\n"  # what train.sbatch appends to its status

    assert main(["report", "--experiment", "sweep-tiny-cpu", "--tracking-uri",
                 f"sqlite:///{out / 'mlflow.db'}", "--out", str(tmp_path / "report")]) == 0
    summary = json.loads((tmp_path / "report" / "report.json").read_text())
    failed = {f["run"]: f for f in summary["failed"]}
    first = failed["tiny-cpu-transformer-L2-W32-D5.12k-s0"]
    assert first["status"] == "FAILED" and first["why"].startswith(f"{cause} ({log})")
    assert {f["status"] for n, f in failed.items() if n != first["run"]} == {"NEVER STARTED"}
