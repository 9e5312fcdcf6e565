"""No run is ever lost: the checkpoint before validation, bounded NaN skipping, the run-directory
lock, stop signals with loader workers, and resume past damaged checkpoints (docs/failure-modes.md).
"""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pretrain.checkpoint import checkpoint_dir, latest_checkpoint, read_meta
from tests.conftest import ROOT, cli_env
from tests.test_train import losses, on_ranks, run, train_cmd


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def start(cmd, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def wait_for_steps(run_dir: Path, steps: int, proc: subprocess.Popen, timeout: float = 120):
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metrics.exists() and metrics.read_text().count("\n") >= steps:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise TimeoutError(f"{metrics}: fewer than {steps} steps after {timeout} s")


@pytest.mark.timeout(300)
def test_data_longer_than_the_model_trains_validates_and_checkpoints(tiny_data, tmp_path):
    """The data holds 32-token samples; a 16-token model cuts them in validation too."""
    one = run(train_cmd(tiny_data, tmp_path / "one", "model.seq_len=16", "train.steps=4",
                        "train.eval_every=2", "tracking.enabled=false"))
    assert one.returncode == 0, one.stderr
    assert [r["step"] for r in records(tmp_path / "one") if "val_loss" in r] == [2, 4]
    assert latest_checkpoint(tmp_path / "one/checkpoints").name == "step-00000004"

    two = run(on_ranks(2, train_cmd(tiny_data, tmp_path / "pp2", "model.seq_len=16",
                                    "train.steps=4", "train.eval_every=2",
                                    "tracking.enabled=false", "parallel.pp=2")))
    assert two.returncode == 0, two.stderr
    val_one = {r["step"]: r["val_loss"] for r in records(tmp_path / "one") if "val_loss" in r}
    val_two = {r["step"]: r["val_loss"] for r in records(tmp_path / "pp2") if "val_loss" in r}
    assert val_one.keys() == val_two.keys()
    assert all(abs(val_one[s] - val_two[s]) < 1e-5 for s in val_one), (val_one, val_two)
    assert latest_checkpoint(tmp_path / "pp2/checkpoints").name == "step-00000004"


@pytest.fixture(scope="module")
def data_without_validation(tmp_path_factory, tiny_data) -> Path:
    from data_pipeline.prepare import prepare_dataset

    out = tmp_path_factory.mktemp("no-val") / "data"
    corpus = tiny_data.parent / "corpus.jsonl"
    prepare_dataset([str(corpus)], out, tokenizer=tiny_data / "tokenizer.model", seq_len=32,
                    val_fraction=0.0, workers=1, progress=False)
    return out


def test_data_without_validation_split_is_refused_at_start(data_without_validation, tmp_path):
    refused = run(train_cmd(data_without_validation, tmp_path / "run", "train.steps=3"))
    assert refused.returncode == 2, refused.stderr
    assert "data.path" in refused.stderr and "data.val_batches=0" in refused.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written

    without = run(train_cmd(data_without_validation, tmp_path / "run", "train.steps=3",
                            "data.val_batches=0", "tracking.enabled=false"))
    assert without.returncode == 0, without.stderr
    assert not any("val_loss" in r for r in records(tmp_path / "run"))


@pytest.mark.timeout(300)
def test_damaged_validation_shard_exits_2_with_the_step_checkpointed(tiny_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    shard = sorted(data.glob("val-*.tar"))[0]
    with open(shard, "r+b") as f:  # same size (the start-time check passes), broken headers
        f.write(b"\xff" * 1024)
    result = run(train_cmd(data, tmp_path / "run", "train.steps=3", "checkpoint.every=0",
                           "tracking.enabled=false"))
    assert result.returncode == 2, result.stderr
    assert shard.name in result.stderr and "validation at step 3" in result.stderr
    assert latest_checkpoint(tmp_path / "run/checkpoints") == \
        checkpoint_dir(tmp_path / "run/checkpoints", 3)


@pytest.mark.timeout(300)
def test_diverged_run_under_skip_exits_3_keeping_the_checkpoint_before_the_streak(
        tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    # lr 1e30 blows the weights up in step 1's update; every later step is non-finite.
    result = run(train_cmd(tiny_data, run_dir, "train.steps=20", "optim.lr=1e30",
                           "optim.min_lr=0", "optim.warmup_steps=0", "train.on_nan=skip",
                           "train.max_consecutive_skips=3", "checkpoint.every=1",
                           "checkpoint.keep=1", "tracking.enabled=false"))
    assert result.returncode == 3, result.stderr
    skipped = [r["step"] for r in records(run_dir) if r.get("skipped")]
    assert skipped == [2, 3, 4]  # step 5, the 4th skip in a row, stops the run
    before_streak = checkpoint_dir(run_dir / "checkpoints", 1)
    assert f"last good checkpoint: {before_streak}" in result.stderr
    assert read_meta(before_streak)["step"] == 1  # pruning spared it (keep=1)
    assert "step 5: 4 steps in a row skipped" in result.stderr
    assert "train.max_consecutive_skips=3" in result.stderr


@pytest.mark.timeout(300)
def test_a_second_run_on_a_locked_run_dir_is_refused_and_the_first_is_intact(
        tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    first = start(train_cmd(tiny_data, run_dir, "train.steps=100000", "checkpoint.every=2",
                            "train.resume=auto"))
    try:
        wait_for_steps(run_dir, 3, first)
        began = time.time()
        second = run(train_cmd(tiny_data, run_dir, "train.steps=100000", "train.resume=auto"),
                     timeout=120)
        assert second.returncode == 2, second.stderr
        assert time.time() - began < 60
        assert "in use by another run" in second.stderr and f"PID {first.pid}" in second.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        _, stderr = first.communicate(timeout=120)
    assert first.returncode == 75, stderr
    steps = [r["step"] for r in records(run_dir) if "loss" in r]
    assert steps == list(range(1, len(steps) + 1))  # only the first run's lines
    assert read_meta(latest_checkpoint(run_dir / "checkpoints"))["step"] \
        == steps[-1]


@pytest.mark.timeout(300)
def test_sigterm_to_the_process_group_with_loader_workers_checkpoints_and_exits_75(
        tiny_data, tmp_path):
    """What Slurm does on scancel or at the time limit: every process gets SIGTERM."""
    run_dir = tmp_path / "run"
    proc = start(train_cmd(tiny_data, run_dir, "train.steps=100000", "data.num_workers=2",
                           "tracking.enabled=false"), start_new_session=True)
    try:
        wait_for_steps(run_dir, 3, proc)
        os.killpg(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 75, stderr
    saved = read_meta(latest_checkpoint(run_dir / "checkpoints"))["step"]
    assert saved == max(losses(run_dir)) >= 3


@pytest.fixture(scope="module")
def three_checkpoints(tiny_data, tmp_path_factory) -> Path:
    """A finished 6-step run with checkpoints at steps 2, 4 and 6."""
    run_dir = tmp_path_factory.mktemp("resume") / "run"
    done = run(train_cmd(tiny_data, run_dir, "train.steps=6", "checkpoint.every=2",
                         "checkpoint.keep=0", "tracking.enabled=false"))
    assert done.returncode == 0, done.stderr
    return run_dir


def corrupt_a_byte(path: Path) -> None:
    with open(path, "r+b") as f:  # same size: only the sha256 can tell
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_resume_passes_over_corrupt_and_incomplete_checkpoints_with_a_warning(
        tiny_data, three_checkpoints, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(three_checkpoints, run_dir)
    ckpts = run_dir / "checkpoints"
    corrupt_a_byte(checkpoint_dir(ckpts, 6) / "tensors/__0_0.distcp")
    (checkpoint_dir(ckpts, 4) / "manifest.json").unlink()
    resumed = run(train_cmd(tiny_data, run_dir, "train.steps=7", "train.resume=auto",
                            "tracking.enabled=false"))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from {checkpoint_dir(ckpts, 2)} (step 2)" in resumed.stderr
    warnings = [line for line in resumed.stderr.splitlines() if line.startswith("warning")]
    assert any("step-00000006" in w and "corrupt" in w for w in warnings), warnings
    assert any("step-00000004" in w and "incomplete" in w for w in warnings), warnings
    assert sorted(losses(run_dir)) == list(range(1, 8))


def test_resume_with_no_intact_checkpoint_exits_2_naming_them(
        tiny_data, three_checkpoints, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(three_checkpoints, run_dir)
    ckpts = run_dir / "checkpoints"
    for step in (2, 4, 6):
        corrupt_a_byte(checkpoint_dir(ckpts, step) / "tensors/__0_0.distcp")
    before = (run_dir / "metrics.jsonl").read_text()
    refused = run(train_cmd(tiny_data, run_dir, "train.steps=7", "train.resume=auto"))
    assert refused.returncode == 2, refused.stderr
    for step in (2, 4, 6):
        assert f"step-0000000{step}" in refused.stderr
    assert (run_dir / "metrics.jsonl").read_text() == before  # never a silent restart


def test_the_read_commands_pass_over_a_corrupt_newest_checkpoint_with_a_warning(
        three_checkpoints, tmp_path, capsys):
    """generate, eval, export-hf and lm-eval (through load_model) read a run's newest
    intact checkpoint, as train.resume=auto does, and say which one they passed over."""
    from pretrain.cli import main
    from pretrain.load import load_model

    run_dir = tmp_path / "run"
    shutil.copytree(three_checkpoints, run_dir)
    ckpts = run_dir / "checkpoints"
    corrupt_a_byte(checkpoint_dir(ckpts, 6) / "tensors/__0_0.distcp")
    warning = (f"warning: not reading a newer checkpoint: {checkpoint_dir(ckpts, 6)}/tensors/"
               f"__0_0.distcp: sha256 differs from the manifest (corrupt); using "
               f"{checkpoint_dir(ckpts, 4)}")
    commands = [["generate", "--run", str(run_dir), "--prompt", "The", "--max-new-tokens", "2"],
                ["eval", "--run", str(run_dir)],
                ["export-hf", "--run", str(run_dir), "--out", str(tmp_path / "hf")]]
    for command in commands:
        assert main(command) == 0, command
        out, err = capsys.readouterr()
        assert warning in err, command
        if command[0] == "eval":
            assert f"checkpoint {checkpoint_dir(ckpts, 4)} (step 4)" in out
    load_model(run_dir)
    assert warning in capsys.readouterr().err


def test_an_index_whose_vocab_size_was_lowered_exits_2_at_start(tiny_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    index = json.loads((data / "index.json").read_text())
    index["vocab_size"] = 400  # the tokenizer has 512 ids
    (data / "index.json").write_text(json.dumps(index))
    result = run(train_cmd(data, tmp_path / "run", "train.steps=3", "tracking.enabled=false"),
                 timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"{data / 'index.json'}: vocab_size 400 differs from the 512 ids of its " \
           "tokenizer" in result.stderr, result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any step
