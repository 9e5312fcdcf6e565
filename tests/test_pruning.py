"""Pruning (`checkpoint.keep`, pretrain/checkpoint.py's Retention) never loses a good
checkpoint: it deletes one only behind `keep` newer checkpoints verified by their sha256,
and never the one a run just wrote, the one it resumed from, or the one pinned before a
streak of skipped steps, decided when each commit happens (docs/failure-modes.md).

Each case runs synchronously and with checkpoint.async, on sharded (DCP) checkpoints: a
corrupt newest checkpoint (a flipped byte; a manifest that does not list DCP's
`.metadata`), an intact newest one that a run resumed before, and NaN skipping while
commits lag behind the steps."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint import (
    CheckpointError,
    Retention,
    checkpoint_dir,
    latest_checkpoint,
    list_checkpoints,
    read_manifest,
)
from tests.conftest import ROOT, cli_env
from tests.test_run_safety import corrupt_a_byte
from tests.test_train import run, train_cmd

MODES = {"sync": "checkpoint.async=false", "async": "checkpoint.async=true"}
QUIET = ["tracking.enabled=false", "data.val_batches=0"]


@pytest.fixture(scope="module")
def three_checkpoints(tiny_data, tmp_path_factory) -> Path:
    """A finished 6-step run with checkpoints at steps 2, 4 and 6."""
    run_dir = tmp_path_factory.mktemp("prune") / "run"
    done = run(train_cmd(tiny_data, run_dir, "train.steps=6", "checkpoint.every=2",
                         "checkpoint.keep=0", *QUIET))
    assert done.returncode == 0, done.stderr
    return run_dir


def drop_metadata_from_manifest(checkpoint: Path) -> None:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    del manifest["files"]["tensors/.metadata"]
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def steps(ckpts: Path) -> list[int]:
    return [step for step, _ in list_checkpoints(ckpts)]


def test_a_manifest_that_does_not_vouch_for_dcp_metadata_is_not_a_checkpoint(
        three_checkpoints, tmp_path):
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(three_checkpoints / "checkpoints", ckpts)
    drop_metadata_from_manifest(checkpoint_dir(ckpts, 6))
    with pytest.raises(CheckpointError, match=r"does not list tensors/\.metadata"):
        read_manifest(checkpoint_dir(ckpts, 6))
    assert latest_checkpoint(ckpts) == checkpoint_dir(ckpts, 4)


def test_retention_counts_only_verified_checkpoints_and_spares_the_protected(
        three_checkpoints, tmp_path):
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(three_checkpoints / "checkpoints", ckpts)
    corrupt_a_byte(checkpoint_dir(ckpts, 6) / "tensors/__0_0.distcp")
    # keep=1: step 6 is corrupt, so step 4 is the newest intact one; step 2 is protected.
    assert Retention(1, lambda: [checkpoint_dir(ckpts, 2)]).prune(ckpts) == []
    assert steps(ckpts) == [2, 4, 6]
    assert Retention(1).prune(ckpts) == [checkpoint_dir(ckpts, 2)]
    assert steps(ckpts) == [4, 6]  # the corrupt newer one is left for a person
    # A verdict is remembered while the manifest is the same file: a new one is hashed again.
    retention = Retention(1)
    retention.prune(ckpts)
    assert list(retention.intact) == [checkpoint_dir(ckpts, 4).resolve()]


def test_checkpoints_and_run_files_get_the_umask_permissions(three_checkpoints):
    for path in (checkpoint_dir(three_checkpoints / "checkpoints", 2),
                 three_checkpoints / "config.yaml", three_checkpoints / "metrics.jsonl"):
        mode = path.stat().st_mode & 0o777
        assert mode == (0o777 if path.is_dir() else 0o666) & ~_umask(), (path, oct(mode))


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("newest", ["flipped byte", "manifest without .metadata"])
def test_a_resume_past_a_corrupt_newest_keeps_what_it_wrote_and_resumed_from(
        tiny_data, three_checkpoints, tmp_path, mode, newest):
    run_dir = tmp_path / "run"
    shutil.copytree(three_checkpoints, run_dir)
    ckpts = run_dir / "checkpoints"
    if newest == "flipped byte":
        corrupt_a_byte(checkpoint_dir(ckpts, 6) / "tensors/__0_0.distcp")
    else:
        drop_metadata_from_manifest(checkpoint_dir(ckpts, 6))
    done = run(train_cmd(tiny_data, run_dir, "train.steps=6", "train.stop_at=5",
                         "train.resume=auto", "checkpoint.keep=1", MODES[mode], *QUIET))
    assert done.returncode == 0, done.stderr
    assert f"resuming from {checkpoint_dir(ckpts, 4)} (step 4)" in done.stderr
    assert "step-00000006" in done.stderr  # the warning naming what was passed over
    # Step 5 (written) and step 4 (resumed from) are kept; the corrupt step 6 is no intact
    # checkpoint, so it does not count toward keep=1 (nor is it deleted).
    assert steps(ckpts) == [4, 5, 6]
    assert latest_checkpoint(ckpts, verify_hashes=True) == checkpoint_dir(ckpts, 5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", list(MODES))
def test_a_run_resumed_from_an_older_checkpoint_keeps_the_one_it_writes(
        tiny_data, three_checkpoints, tmp_path, mode):
    run_dir = tmp_path / "run"
    shutil.copytree(three_checkpoints, run_dir)
    ckpts = run_dir / "checkpoints"
    start = checkpoint_dir(ckpts, 2)
    done = run(train_cmd(tiny_data, run_dir, "train.steps=6", "train.stop_at=4",
                         f"train.resume={start}", "checkpoint.keep=1", MODES[mode], *QUIET))
    assert done.returncode == 0, done.stderr
    assert f"resuming from {start} (step 2)" in done.stderr
    # keep=1 is met by the intact step 6; the step 4 just written again and step 2, resumed
    # from, stay.
    assert steps(ckpts) == [2, 4, 6]
    assert latest_checkpoint(ckpts, verify_hashes=True) == checkpoint_dir(ckpts, 6)
    read_manifest(checkpoint_dir(ckpts, 4), verify_hashes=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", list(MODES))
def test_nan_skipping_with_commits_slower_than_steps_keeps_the_checkpoint_before_it(
        tiny_data, tmp_path, mode):
    from pretrain.sharded_checkpoint import read_checkpoint

    run_dir = tmp_path / "run"
    # lr 1e30 blows the weights up in step 1's update; every later step is skipped. Each
    # commit lags 1.5 s, so with checkpoint.async step 1's is in flight when step 2 skips.
    cmd = train_cmd(tiny_data, run_dir, "train.steps=20", "optim.lr=1e30", "optim.min_lr=0",
                    "optim.warmup_steps=0", "train.on_nan=skip", "train.max_consecutive_skips=3",
                    "checkpoint.every=1", "checkpoint.keep=1", MODES[mode], *QUIET)
    cmd = [cmd[0], str(ROOT / "tests/slow_commit_train.py"), *cmd[3:]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env={**cli_env(), "COMMIT_DELAY_S": "1.5"})
    assert done.returncode == 3, done.stderr
    ckpts = run_dir / "checkpoints"
    before_streak = checkpoint_dir(ckpts, 1)
    assert f"last good checkpoint: {before_streak}" in done.stderr
    state = read_checkpoint(before_streak)  # kept (keep=1), intact, and its weights finite
    assert state["meta"]["step"] == 1
    assert all(torch.isfinite(t).all() for t in state["model"].values())
    assert steps(ckpts) == [1, 4]  # and the newest, written mid-streak
