"""Asynchronous checkpoint saves (checkpoint.async, pretrain/run_checkpoint.py's
Checkpointer): killed in flight, the previous checkpoint is whole and the run resumes from it
exactly; a failed background write ends every rank naming it; a stop signal with saves in
flight exits 75 once its checkpoint is committed; and (slow) an asynchronous run
writes the same checkpoints and losses as a synchronous one."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint import checkpoint_dir, latest_checkpoint, list_checkpoints
from tests.conftest import ROOT, cli_env
from tests.test_train import losses, on_ranks, run, train_cmd

ASYNC = ["train.steps=8", "checkpoint.every=2", "checkpoint.keep=0", "checkpoint.async=true",
         "tracking.enabled=false", "data.val_batches=0"]


def _async_cmd(script: str, data: Path, run_dir: Path) -> list[str]:
    """`python -m pretrain train` with ASYNC, through the test script `script`."""
    cmd = train_cmd(data, run_dir, *ASYNC)
    return [cmd[0], str(ROOT / "tests" / script), *cmd[3:]]


@pytest.mark.timeout(300)
def test_sigkill_during_an_async_save_leaves_the_previous_checkpoint(tiny_data, tmp_path):
    from pretrain.sharded_checkpoint import read_checkpoint

    run_dir, marker = tmp_path / "run", tmp_path / "in-flight"
    proc = subprocess.Popen(_async_cmd("stalled_save_train.py", tiny_data, run_dir), cwd=ROOT,
                            env={**cli_env(), "STALL_AT_SAVE": "2", "STALL_MARKER": str(marker)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert marker.exists(), proc.stderr.read() if proc.poll() is not None else "no stall"
    in_flight = Path(marker.read_text())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    proc.stderr.close()

    ckpts = run_dir / "checkpoints"
    assert (in_flight / "tensors/__0_0.distcp").is_file()  # the write was under way
    assert [step for step, _ in list_checkpoints(ckpts)] == [2]
    assert latest_checkpoint(ckpts, verify_hashes=True) == checkpoint_dir(ckpts, 2)
    assert read_checkpoint(checkpoint_dir(ckpts, 2))["meta"]["step"] == 2
    before = losses(run_dir)  # training went on while the write was in flight
    assert max(before) >= 4, before

    resumed = run(train_cmd(tiny_data, run_dir, *ASYNC, "train.resume=auto"))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from {checkpoint_dir(ckpts, 2)} (step 2)" in resumed.stderr
    after = losses(run_dir)
    assert all(after[step] == loss for step, loss in before.items() if step > 2), (before, after)
    assert not list(ckpts.glob(".tmp-*"))  # the killed save's directory was cleared


@pytest.mark.timeout(300)
def test_a_failed_background_write_ends_every_rank_naming_it(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    cmd = _async_cmd("enospc_train.py", tiny_data, run_dir)
    result = subprocess.run(on_ranks(2, cmd), capture_output=True, text=True, timeout=240,
                            cwd=ROOT, env={**cli_env(), "ENOSPC_AT_SAVE": "2",
                                           "ENOSPC_RANK": "1"})
    assert result.returncode == 1, result.stderr  # torchrun's status; each rank says 74
    ckpts = run_dir / "checkpoints"
    message = f"cannot write the checkpoint of step 4 into {ckpts}: No space left on device " \
              "[ENOSPC]"
    for rank in (0, 1):
        assert f"error (rank {rank}): {message}" in result.stderr, result.stderr
    assert f"the previous checkpoint {checkpoint_dir(ckpts, 2)} is intact" in result.stderr
    assert "exit status 74" in result.stderr
    assert latest_checkpoint(ckpts, verify_hashes=True) == checkpoint_dir(ckpts, 2)
    assert max(losses(run_dir)) < 8  # it stopped at a step boundary, not at the end
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000002"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_async_save_and_resume_equal_the_synchronous_run(tiny_data, tmp_path):
    from pretrain.sharded_checkpoint import read_checkpoint

    common = ["train.steps=4", "checkpoint.every=2", "checkpoint.keep=0",
              "tracking.enabled=false", "data.val_batches=0"]
    sync, background = tmp_path / "sync", tmp_path / "async"
    done = run(on_ranks(2, train_cmd(tiny_data, sync, *common, "checkpoint.async=false")))
    assert done.returncode == 0, done.stderr
    # Stopped after step 2 (its save in the background), resumed, step 4 saved the same way.
    for extra in (["train.stop_at=2"], ["train.resume=auto"]):
        done = run(on_ranks(2, train_cmd(tiny_data, background, *common,
                                         "checkpoint.async=true", *extra)))
        assert done.returncode == 0, done.stderr
    assert f"checkpoint: {checkpoint_dir(background / 'checkpoints', 4)}" in done.stderr
    assert losses(background) == losses(sync)  # bitwise: the same layout
    for step in (2, 4):
        want = read_checkpoint(checkpoint_dir(sync / "checkpoints", step))
        got = read_checkpoint(checkpoint_dir(background / "checkpoints", step))
        assert got["meta"]["step"] == step and got["model"].keys() == want["model"].keys()
        for name, tensor in want["model"].items():
            assert torch.equal(got["model"][name], tensor), (step, name)
            for key, value in want["optimizer"][name].items():
                assert torch.equal(got["optimizer"][name][key], value), (step, name, key)


@pytest.mark.timeout(300)
def test_sigterm_with_saves_in_flight_exits_75_after_the_commit(tiny_data, tmp_path):
    """A save every step keeps one in flight: the stop waits for it and for its own."""
    run_dir = tmp_path / "run"
    cmd = train_cmd(tiny_data, run_dir, "train.steps=100000", "checkpoint.every=1",
                    "checkpoint.async=true", "tracking.enabled=false", "data.val_batches=0")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=cli_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + 120
    while time.time() < deadline and not (metrics.exists()
                                          and metrics.read_text().count("\n") >= 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr
    ckpts = run_dir / "checkpoints"
    last = latest_checkpoint(ckpts, verify_hashes=True)
    step = max(losses(run_dir))
    assert last == checkpoint_dir(ckpts, step), (last, step)  # the stopping step, committed
    assert f"stopped on request after step {step}; checkpoint {last}" in stderr
    assert not list(ckpts.glob(".tmp-*"))
