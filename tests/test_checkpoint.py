"""pretrain.checkpoint: round trip, pruning, and never trusting a half-written checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint import (
    MANIFEST,
    CheckpointError,
    checkpoint_dir,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)

REPO = Path(__file__).resolve().parents[1]


def small_state(step: int) -> dict:
    return {"model": {"w": torch.full((4, 3), float(step))}, "meta": {"step": step}}


def test_round_trip_model_optimizer_meta(tmp_path):
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 2))
    model[1].bias.data = model[1].bias.data.to(torch.bfloat16).float()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    model(torch.randn(3, 5)).sum().backward()
    optimizer.step()
    meta = {"step": 17, "scheduler": {"last_epoch": 17}, "loader": {"offset": [1, 2, 3]},
            "mlflow_run_id": "abc", "loss": 2.5}
    extra = {"ids": torch.arange(10), "half": torch.ones(2, dtype=torch.bfloat16)}
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "meta": meta,
             "extra": extra}

    path = save_checkpoint(tmp_path / "ckpt", 17, state, keep=3)
    assert path == checkpoint_dir(tmp_path / "ckpt", 17) and path.name == "step-00000017"
    assert sorted(p.name for p in path.iterdir()) == [
        "extra.pt", MANIFEST, "meta.json", "model.pt", "optimizer.pt"]
    assert json.loads((path / "meta.json").read_text()) == meta

    loaded = load_checkpoint(path)
    assert set(loaded) == {"model", "optimizer", "meta", "extra"}
    assert loaded["meta"] == meta
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded["model"][name], tensor)
    assert loaded["extra"]["half"].dtype == torch.bfloat16
    assert torch.equal(loaded["extra"]["ids"], torch.arange(10))

    fresh = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 2))
    fresh.load_state_dict(loaded["model"])
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2, betas=(0.9, 0.95))
    fresh_opt.load_state_dict(loaded["optimizer"])
    for a, b in zip(optimizer.state.values(), fresh_opt.state.values(), strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["step"], b["step"])
    assert fresh_opt.param_groups[0]["betas"] == (0.9, 0.95)

    assert set(load_checkpoint(path, parts=["meta"])) == {"meta"}
    with pytest.raises(CheckpointError, match="no part 'nope'"):
        load_checkpoint(path, parts=["nope"])


def test_keep_prunes_oldest(tmp_path):
    root = tmp_path / "ckpt"
    for step in range(1, 6):
        save_checkpoint(root, step, small_state(step), keep=2)
    assert [s for s, _ in list_checkpoints(root)] == [4, 5]
    assert latest_checkpoint(root) == checkpoint_dir(root, 5)
    assert load_checkpoint(latest_checkpoint(root))["meta"]["step"] == 5
    assert sorted(p.name for p in root.iterdir()) == ["step-00000004", "step-00000005"]


def test_keep_zero_keeps_all(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, small_state(step), keep=0)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 2, 3]


def test_saving_a_step_again_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 4, small_state(4), keep=3)
    save_checkpoint(tmp_path, 4, small_state(40), keep=3)
    assert load_checkpoint(checkpoint_dir(tmp_path, 4))["meta"]["step"] == 40
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000004"]


def test_empty_or_missing_root(tmp_path):
    assert latest_checkpoint(tmp_path / "nothing") is None
    assert latest_checkpoint(tmp_path) is None


def test_half_written_checkpoints_are_never_used(tmp_path):
    root = tmp_path / "ckpt"
    good = save_checkpoint(root, 3, small_state(3), keep=0)
    # A killed save: its temp dir is left behind (contents complete but never renamed).
    tmp = root / ".tmp-step-00000009-abcd"
    tmp.mkdir()
    torch.save(small_state(9)["model"], tmp / "model.pt")
    # A step dir without a manifest.
    no_manifest = checkpoint_dir(root, 8)
    no_manifest.mkdir()
    torch.save(small_state(8)["model"], no_manifest / "model.pt")
    # A checkpoint whose file was truncated after the manifest was written.
    truncated = save_checkpoint(root, 7, small_state(7), keep=0)
    with open(truncated / "model.pt", "r+b") as f:
        f.truncate(10)
    # A manifest that is itself torn.
    torn = save_checkpoint(root, 6, small_state(6), keep=0)
    (torn / MANIFEST).write_text((torn / MANIFEST).read_text()[:20])
    # A file listed in the manifest is gone.
    missing = save_checkpoint(root, 5, small_state(5), keep=0)
    (missing / "meta.json").unlink()

    assert latest_checkpoint(root) == good
    assert latest_checkpoint(root, verify_hashes=True) == good
    with pytest.raises(CheckpointError, match=r"step-00000008/manifest\.json: missing"):
        load_checkpoint(no_manifest)
    with pytest.raises(CheckpointError, match=r"step-00000007/model\.pt: 10 bytes"):
        load_checkpoint(truncated)
    with pytest.raises(CheckpointError, match=r"step-00000006/manifest\.json: unreadable"):
        load_checkpoint(torn)
    with pytest.raises(CheckpointError, match=r"step-00000005/meta\.json: listed"):
        load_checkpoint(missing)
    with pytest.raises(CheckpointError, match="missing"):
        load_checkpoint(tmp)
    assert load_checkpoint(good)["meta"]["step"] == 3

    # The next save clears the stale temp dir (and prunes only complete checkpoints).
    save_checkpoint(root, 10, small_state(10), keep=1)
    assert not tmp.exists()
    assert [s for s, _ in list_checkpoints(root)] == [5, 6, 7, 8, 10]
    assert latest_checkpoint(root) == checkpoint_dir(root, 10)


def test_same_size_corruption_is_caught_by_the_hash(tmp_path):
    path = save_checkpoint(tmp_path, 2, small_state(2), keep=0)
    data = bytearray((path / "model.pt").read_bytes())
    data[-30] ^= 0xFF
    (path / "model.pt").write_bytes(bytes(data))
    assert latest_checkpoint(tmp_path) == path  # sizes agree: the cheap check passes
    assert latest_checkpoint(tmp_path, verify_hashes=True) is None
    with pytest.raises(CheckpointError, match=r"model\.pt: sha256 differs"):
        load_checkpoint(path)


def test_failed_save_leaves_nothing(tmp_path):
    with pytest.raises(TypeError, match="'meta' is not JSON"):
        save_checkpoint(tmp_path, 1, {"model": {}, "meta": {"x": torch.ones(1)}}, keep=1)
    with pytest.raises(ValueError, match="invalid checkpoint part name"):
        save_checkpoint(tmp_path, 1, {"../evil": {}}, keep=1)
    assert list(tmp_path.iterdir()) == []


WRITER = """
import sys, torch
from pretrain.checkpoint import save_checkpoint
root = sys.argv[1]
save_checkpoint(root, 1, {"model": {"w": torch.ones(3)}, "meta": {"step": 1}}, keep=3)
print("saved", flush=True)
big = {f"w{i}": torch.zeros(8, 1024, 1024) for i in range(4)}  # 128 MB, written twice
save_checkpoint(root, 2, {"model": big, "optimizer": big, "meta": {"step": 2}}, keep=3)
print("saved again", flush=True)
"""


@pytest.mark.timeout(60)
def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root)], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "saved"
        deadline = time.monotonic() + 30
        while not any(p.name.startswith(".tmp-step-00000002") and any(p.iterdir())
                      for p in root.iterdir()):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert not checkpoint_dir(root, 2).exists(), "the save finished before the kill"
    assert any(p.name.startswith(".tmp-step-00000002") for p in root.iterdir())
    assert latest_checkpoint(root) == checkpoint_dir(root, 1)
    assert load_checkpoint(latest_checkpoint(root))["meta"] == {"step": 1}
    shutil.rmtree(root)  # do not leave 100s of MB in pytest's kept temp dirs
