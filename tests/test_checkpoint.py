"""pretrain.checkpoint: round trip, pruning, and never trusting a half-written checkpoint."""

from __future__ import annotations

import hashlib
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
    read_meta,
)
from pretrain.sharded_checkpoint import read_checkpoint, write_checkpoint

REPO = Path(__file__).resolve().parents[1]
SHARD = "tensors/__0_0.distcp"  # the one file of tensors one process writes


def small_state(step: int) -> dict:
    return {"model": {"w": torch.full((4, 3), float(step))}, "meta": {"step": step}}


def test_round_trip_model_optimizer_meta(tmp_path):
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 2))
    model[1].bias.data = model[1].bias.data.to(torch.bfloat16)
    model_state = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer_state = {name: {"step": torch.tensor(3.0), "exp_avg": torch.randn_like(p),
                              "exp_avg_sq": torch.rand_like(p)}
                       for name, p in model_state.items()}
    meta = {"step": 17, "scheduler": {"last_epoch": 17}, "loader": {"offset": [1, 2, 3]},
            "mlflow_run_id": "abc", "loss": 2.5}
    state = {"model": model_state, "optimizer": optimizer_state, "meta": meta}

    path = write_checkpoint(tmp_path / "ckpt", 17, state, keep=3)
    assert path == checkpoint_dir(tmp_path / "ckpt", 17) and path.name == "step-00000017"
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["format"] == 2 and manifest["parts"] == {"meta": "meta.json",
                                                             "tensors": "tensors"}
    assert sorted(manifest["files"]) == ["meta.json", "tensors/.metadata", SHARD]
    assert json.loads((path / "meta.json").read_text()) == meta == read_meta(path)

    loaded = read_checkpoint(path)
    assert loaded["meta"] == meta and loaded["model"].keys() == model_state.keys()
    for name, tensor in model_state.items():
        assert loaded["model"][name].dtype == tensor.dtype
        assert torch.equal(loaded["model"][name], tensor), name
        for key, value in optimizer_state[name].items():
            assert torch.equal(loaded["optimizer"][name][key], value), (name, key)
    assert loaded["model"]["1.bias"].dtype == torch.bfloat16
    assert "optimizer" not in read_checkpoint(path, optimizer=False)


def test_keep_prunes_oldest(tmp_path):
    root = tmp_path / "ckpt"
    for step in range(1, 6):
        write_checkpoint(root, step, small_state(step), keep=2)
    assert [s for s, _ in list_checkpoints(root)] == [4, 5]
    assert latest_checkpoint(root) == checkpoint_dir(root, 5)
    assert read_meta(latest_checkpoint(root))["step"] == 5
    assert torch.equal(read_checkpoint(latest_checkpoint(root))["model"]["w"],
                       torch.full((4, 3), 5.0))
    assert sorted(p.name for p in root.iterdir()) == ["step-00000004", "step-00000005"]


def test_keep_zero_keeps_all(tmp_path):
    for step in (1, 2, 3):
        write_checkpoint(tmp_path, step, small_state(step), keep=0)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 2, 3]


def test_saving_a_step_again_replaces_it(tmp_path):
    write_checkpoint(tmp_path, 4, small_state(4), keep=3)
    write_checkpoint(tmp_path, 4, small_state(40), keep=3)
    assert read_meta(checkpoint_dir(tmp_path, 4))["step"] == 40
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000004"]


def test_empty_or_missing_root(tmp_path):
    assert latest_checkpoint(tmp_path / "nothing") is None
    assert latest_checkpoint(tmp_path) is None


def test_half_written_checkpoints_are_never_used(tmp_path):
    root = tmp_path / "ckpt"
    good = write_checkpoint(root, 3, small_state(3), keep=0)
    # A killed save: its temp dir is left behind (contents complete but never renamed).
    tmp = root / ".tmp-step-00000009-abcd"
    shutil.copytree(good, tmp)
    (tmp / MANIFEST).unlink()
    # A step dir without a manifest.
    no_manifest = checkpoint_dir(root, 8)
    shutil.copytree(tmp, no_manifest)
    # A checkpoint whose file was truncated after the manifest was written.
    truncated = write_checkpoint(root, 7, small_state(7), keep=0)
    with open(truncated / SHARD, "r+b") as f:
        f.truncate(10)
    # A manifest that is itself torn.
    torn = write_checkpoint(root, 6, small_state(6), keep=0)
    (torn / MANIFEST).write_text((torn / MANIFEST).read_text()[:20])
    # A file listed in the manifest is gone.
    missing = write_checkpoint(root, 5, small_state(5), keep=0)
    (missing / "meta.json").unlink()

    assert latest_checkpoint(root) == good
    assert latest_checkpoint(root, verify_hashes=True) == good
    with pytest.raises(CheckpointError, match=r"step-00000008/manifest\.json: missing"):
        read_meta(no_manifest)
    with pytest.raises(CheckpointError, match=r"step-00000007/tensors/__0_0\.distcp: 10 bytes"):
        read_checkpoint(truncated)
    with pytest.raises(CheckpointError, match=r"step-00000006/manifest\.json: unreadable"):
        read_meta(torn)
    with pytest.raises(CheckpointError, match=r"step-00000005/meta\.json: listed"):
        read_meta(missing)
    with pytest.raises(CheckpointError, match="missing"):
        read_meta(tmp)
    assert read_meta(good)["step"] == 3

    # The next save clears the stale temp dir (and prunes only complete checkpoints).
    write_checkpoint(root, 10, small_state(10), keep=1)
    assert not tmp.exists()
    assert [s for s, _ in list_checkpoints(root)] == [5, 6, 7, 8, 10]
    assert latest_checkpoint(root) == checkpoint_dir(root, 10)


def test_same_size_corruption_is_caught_by_the_hash(tmp_path):
    path = write_checkpoint(tmp_path, 2, small_state(2), keep=0)
    data = bytearray((path / SHARD).read_bytes())
    data[-30] ^= 0xFF
    (path / SHARD).write_bytes(bytes(data))
    assert latest_checkpoint(tmp_path) == path  # sizes agree: the cheap check passes
    assert latest_checkpoint(tmp_path, verify_hashes=True) is None
    with pytest.raises(CheckpointError, match=r"tensors/__0_0\.distcp: sha256 differs"):
        read_checkpoint(path)


def test_failed_save_leaves_nothing(tmp_path):
    with pytest.raises(TypeError, match="'meta' is not JSON"):
        write_checkpoint(tmp_path, 1, {"model": {"w": torch.ones(1)},
                                       "meta": {"x": torch.ones(1)}}, keep=1)
    assert list(tmp_path.iterdir()) == []


def format_1_checkpoint(path: Path, state: dict, manifest_format: int | None = 1) -> Path:
    """`state` as the trainer wrote it before sharded checkpoints: full tensors in model.pt
    (and optimizer.pt), meta.json, a manifest of format 1 (the first had no "format" key)."""
    path.mkdir(parents=True)
    (path / "meta.json").write_text(json.dumps(state["meta"]))
    parts = {"meta": "meta.json"}
    for name in ("model", "optimizer"):
        if name in state:
            torch.save(state[name], path / f"{name}.pt")
            parts[name] = f"{name}.pt"
    files = {rel: {"bytes": (path / rel).stat().st_size,
                   "sha256": hashlib.sha256((path / rel).read_bytes()).hexdigest()}
             for rel in parts.values()}
    manifest = {"step": state["meta"]["step"], "parts": parts, "files": files}
    if manifest_format is not None:
        manifest["format"] = manifest_format
    (path / MANIFEST).write_text(json.dumps(manifest))
    return path


@pytest.mark.parametrize("manifest_format", [1, None], ids=["format-1", "no-format-key"])
def test_a_format_1_checkpoint_is_refused_naming_its_version(tmp_path, capsys,
                                                             manifest_format):
    from pretrain.cli import main

    old = format_1_checkpoint(checkpoint_dir(tmp_path / "run" / "checkpoints", 1),
                              small_state(1), manifest_format)
    assert latest_checkpoint(old.parent) == old  # intact: the refusal must say why, not skip
    said = (rf"{old} is a checkpoint of format 1 \(parts meta, model\); this version reads "
            rf"format 2 only\. Format 1 .* `python -m pretrain checkpoint convert {old} --out "
            r"NEW` at commit 8c1caaa or earlier")
    for read in (read_meta, read_checkpoint):
        with pytest.raises(CheckpointError, match=said):
            read(old)
    for tool in (["inspect", str(old)], ["export", str(old), "--out", str(tmp_path / "x")]):
        assert main(["checkpoint", *tool]) == 2
        assert f"{old} is a checkpoint of format 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the converter is gone from this version
        main(["checkpoint", "convert", str(old), "--out", str(tmp_path / "new")])


def test_a_later_format_is_refused_naming_its_version(tmp_path):
    path = write_checkpoint(tmp_path, 1, small_state(1))
    manifest = json.loads((path / MANIFEST).read_text())
    (path / MANIFEST).write_text(json.dumps({**manifest, "format": 3}))
    with pytest.raises(CheckpointError, match=r"format 3 \(parts meta, tensors\); this "
                       r"version reads format 2 only$"):
        read_meta(path)


WRITER = """
import sys, torch
from pretrain.sharded_checkpoint import write_checkpoint
root = sys.argv[1]
write_checkpoint(root, 1, {"model": {"w": torch.ones(3)}, "meta": {"step": 1}}, keep=3)
print("saved", flush=True)
big = {f"w{i}": torch.zeros(8, 1024, 1024) for i in range(4)}  # 128 MB, written twice
moments = {name: {"exp_avg": torch.zeros_like(t)} for name, t in big.items()}
write_checkpoint(root, 2, {"model": big, "optimizer": moments, "meta": {"step": 2}}, keep=3)
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
    assert read_meta(latest_checkpoint(root)) == {"step": 1}
    shutil.rmtree(root)  # do not leave 100s of MB in pytest's kept temp dirs
