"""Fail fast and say why (trainer side): failed saves, unwritable directories, checkpoint
fingerprints, a finished run resumed, a missing checkpoint (docs/failure-modes.md)."""

import sys
from pathlib import Path

import pytest

from pretrain.checkpoint import checkpoint_dir, latest_checkpoint, read_meta
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
    assert read_meta(checkpoint_dir(ckpts, 2))["step"] == 2
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000002"]  # no temp dir left


@pytest.fixture
def small_tmpfs():
    """mount(directory, size): a real tmpfs of `size` on `directory` (root only: the test
    skips otherwise), unmounted after the test."""
    import os
    import subprocess

    mounted = []

    def mount(directory: Path, size: str) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        directory.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                               str(directory)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
        mounted.append(directory)
        return directory

    yield mount
    for directory in reversed(mounted):
        subprocess.run(["umount", "-l", str(directory)], check=False)


def fill(directory: Path) -> None:
    """Write a file into `directory` until its file system has no byte left."""
    import errno

    with open(directory / "filler", "wb", buffering=0) as f:
        for chunk in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(bytes(chunk))
            except OSError as err:
                assert err.errno == errno.ENOSPC, err


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["false", "true"])
def test_a_real_full_disk_inside_torchs_writer_says_enospc_and_the_file(
        tiny_data, tmp_path, small_tmpfs, mode):
    """/dev/full above fails in Python's open; a full file system fails inside torch's
    writer, which says only "unexpected pos" unless its exception chain is read."""
    import subprocess

    run_dir = tmp_path / "run"
    ckpts = small_tmpfs(run_dir / "checkpoints", "1m")  # one 0.6 MB checkpoint fits
    result = subprocess.run(
        train_cmd(tiny_data, run_dir, "train.steps=4", "checkpoint.every=1",
                  "checkpoint.keep=0", f"checkpoint.async={mode}", "tracking.enabled=false",
                  "data.val_batches=0"), capture_output=True, text=True, timeout=240,
        cwd=ROOT, env=_env_with())
    assert result.returncode == 74, result.stderr
    assert f"cannot write the checkpoint of step 2 into {ckpts}: No space left on device " \
           "[ENOSPC] (" in result.stderr, result.stderr
    assert "/tensors/__0_0.distcp)" in result.stderr
    assert latest_checkpoint(ckpts, verify_hashes=True) == checkpoint_dir(ckpts, 1)


@pytest.mark.timeout(300)
def test_a_full_disk_at_start_exits_naming_it_and_keeps_the_run_files(
        tiny_data, tmp_path, small_tmpfs):
    import subprocess

    run_dir = small_tmpfs(tmp_path / "run", "20m")
    quiet = ["tracking.enabled=false", "data.val_batches=0"]
    done = run(train_cmd(tiny_data, run_dir, "train.steps=3", *quiet))
    assert done.returncode == 0, done.stderr
    config, metrics = (run_dir / "config.yaml").read_text(), \
        (run_dir / "metrics.jsonl").read_text()
    fill(run_dir)
    result = subprocess.run(
        train_cmd(tiny_data, run_dir, "train.steps=4", "train.resume=auto", *quiet,
                  "run.name=" + "a-long-name-" * 200), capture_output=True, text=True,
        timeout=240, cwd=ROOT, env=_env_with())
    assert result.returncode in (2, 74), result.stderr
    assert "Traceback" not in result.stderr
    assert str(run_dir) in result.stderr and "ENOSPC" in result.stderr, result.stderr
    assert (run_dir / "config.yaml").read_text() == config  # never cut off
    assert (run_dir / "metrics.jsonl").read_text() == metrics
    assert sorted(p.name for p in run_dir.iterdir() if "tmp" in p.name) == []


def test_run_files_on_a_full_disk_are_kept_whole_and_named(tmp_path, small_tmpfs):
    from pretrain.run_files import RunFileError, write_atomic
    from pretrain.tracking import MetricsLog

    directory = small_tmpfs(tmp_path / "disk", "64k")
    config, metrics = directory / "config.yaml", directory / "metrics.jsonl"
    write_atomic(config, "model:\n  d_model: 32\n")
    with MetricsLog(metrics, resume_step=None) as log:
        log.log({"step": 1, "loss": 2.0})
        fill(directory)
        with pytest.raises(RunFileError, match=rf"cannot write {metrics}: .*\[ENOSPC\]"):
            log.log({"step": 2, "loss": 1.0, "padding": "x" * 8192})
    with pytest.raises(RunFileError, match=rf"cannot write {config}: .*\[ENOSPC\]"):
        write_atomic(config, "model:\n  d_model: 64\n" + "#" * 8192)
    with pytest.raises(RunFileError, match=r"\[ENOSPC\]"):
        MetricsLog(metrics, resume_step=1)  # a resume rewrites the rows it keeps: no room
    assert config.read_text() == "model:\n  d_model: 32\n"
    assert metrics.read_text() == '{"step": 1, "loss": 2.0}\n'
    assert sorted(p.name for p in directory.iterdir()) == ["config.yaml", "filler",
                                                            "metrics.jsonl"]


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
