"""Fail fast and say why (trainer side): failed saves, unwritable directories, checkpoint
fingerprints, a finished run resumed, a missing checkpoint (docs/failure-modes.md)."""

import sys
from pathlib import Path

import pytest

from pretrain.checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint
from tests.conftest import ROOT
from tests.test_train import on_ranks, run, train_cmd


def enospc_cmd(data: Path, run_dir: Path, *extra: str) -> list[str]:
    cmd = train_cmd(data, run_dir, "train.steps=4", "checkpoint.every=2",
                    "tracking.enabled=false", *extra)
    return [cmd[0], str(ROOT / "tests/enospc_train.py"), *cmd[3:]]


def _env_with(**extra):
    from tests.conftest import cli_env

    return {**cli_env(), **extra}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_full_disk_at_a_save_stops_every_rank_naming_the_path(tiny_data, tmp_path, ranks):
    import subprocess

    run_dir = tmp_path / "run"
    cmd = enospc_cmd(tiny_data, run_dir)
    result = subprocess.run(on_ranks(ranks, cmd), capture_output=True, text=True, timeout=240,
                            cwd=ROOT, env=_env_with(ENOSPC_AT_SAVE="2"))
    # One process: 74. torchrun reports any failure as 1; each rank's own line says 74.
    assert result.returncode == (74 if ranks == 1 else 1), result.stderr
    ckpts = run_dir / "checkpoints"
    message = f"cannot write the checkpoint of step 4 into {ckpts}: No space left on device " \
              "[ENOSPC]"
    assert result.stderr.count(message) == ranks, result.stderr
    assert f"the previous checkpoint {checkpoint_dir(ckpts, 2)} is intact" in result.stderr
    assert "exit status 74" in result.stderr
    assert latest_checkpoint(ckpts, verify_hashes=True) == checkpoint_dir(ckpts, 2)
    assert load_checkpoint(checkpoint_dir(ckpts, 2))["meta"]["step"] == 2
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000002"]  # no temp dir left


@pytest.mark.parametrize("where", ["run.dir", "checkpoints"])
def test_unwritable_run_or_checkpoint_dir_exits_2_at_start(tiny_data, tmp_path, where):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    run_dir = blocker / "run" if where == "run.dir" else tmp_path / "run"
    if where == "checkpoints":
        run_dir.mkdir()
        (run_dir / "checkpoints").write_text("not a directory")
    result = run(train_cmd(tiny_data, run_dir, "train.steps=3", "tracking.enabled=false"),
                 timeout=120)
    assert result.returncode == 2, result.stderr
    assert "run.dir" in result.stderr and "is not writable" in result.stderr
    named = blocker / "run" if where == "run.dir" else run_dir / "checkpoints"
    assert str(named) in result.stderr


@pytest.fixture(scope="module")
def finished_run(tiny_data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    done = run(train_cmd(tiny_data, run_dir, "train.steps=3", "tracking.enabled=false"))
    assert done.returncode == 0, done.stderr
    return run_dir


@pytest.mark.parametrize("override,differs", [
    ("model.d_model=64", "model.d_model: 32 in the checkpoint, 64 now"),
    ("train.seed=1", "seed: 0 in the checkpoint, 1 now"),
])
def test_resuming_a_different_run_exits_2_listing_the_keys(tiny_data, finished_run, override,
                                                           differs):
    result = run(train_cmd(tiny_data, finished_run, "train.steps=5", "train.resume=auto",
                           "tracking.enabled=false", override), timeout=120)
    assert result.returncode == 2, result.stderr
    assert "train.resume" in result.stderr and differs in result.stderr


def test_a_finished_run_resumed_says_there_is_nothing_to_train(tiny_data, finished_run):
    result = run(train_cmd(tiny_data, finished_run, "train.steps=3", "train.resume=auto",
                           "tracking.enabled=false"), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "nothing to train: the run is already at step 3" in result.stderr
    assert "raise train.steps" in result.stderr


def test_eval_of_a_missing_checkpoint_exits_2_naming_it(tmp_path):
    missing = tmp_path / "checkpoints" / "step-00000009"
    result = run([sys.executable, "-m", "pretrain", "eval", "--checkpoint", str(missing)],
                 timeout=120)
    assert result.returncode == 2, result.stderr
    assert "--checkpoint" in result.stderr and str(missing) in result.stderr


def test_a_checkpoint_from_before_the_block_keys_resumes_as_the_gpt_model_it_was():
    """Model keys added after a checkpoint was written (model.block, n_kv_heads,
    tie_embeddings, ffn_hidden_size, ffn_multiple_of) count as their defaults."""
    from pretrain.config import config_to_dict, load_config
    from pretrain.init_from import model_mismatch
    from pretrain.run_dir import fingerprint, fingerprint_mismatch

    new = ("block", "n_kv_heads", "tie_embeddings", "ffn_hidden_size", "ffn_multiple_of")
    now = config_to_dict(load_config(None, []))["model"]
    old = {k: v for k, v in now.items() if k not in new}
    assert fingerprint_mismatch(fingerprint(old, "t", 0), fingerprint(now, "t", 0)) == []
    assert model_mismatch(old, now) == []
    llama = {**now, "block": "llama"}
    assert fingerprint_mismatch(fingerprint(old, "t", 0), fingerprint(llama, "t", 0)) == [
        "model.block: 'gpt' in the checkpoint, 'llama' now"]
    assert model_mismatch(old, llama) == ["model.block: 'gpt' in the checkpoint, 'llama' now"]
