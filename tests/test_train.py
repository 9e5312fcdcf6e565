"""End-to-end training through the CLI: loss goes down, resume is exact, errors are clear."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, cli_env

TINY = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=32",
        "model.dwa_dilation=1", "model.dwa_period=1", "train.batch_size=8",
        "optim.lr=3e-3", "optim.min_lr=3e-4", "optim.warmup_steps=2", "data.val_batches=2",
        "train.log_every=5", "checkpoint.keep=2"]


def train_cmd(data: Path, run_dir: Path, *extra: str) -> list[str]:
    sets = [*TINY, f"data.path={data}", f"run.dir={run_dir}", *extra]
    return [sys.executable, "-m", "pretrain", "train", "--config",
            str(ROOT / "configs/tiny.yaml"), *[a for s in sets for a in ("--set", s)]]


def run(cmd, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=cli_env(),
                          cwd=ROOT)


def on_ranks(ranks: int, cmd: list[str]) -> list[str]:
    """`cmd` (a `python -m pretrain ...` line) under torchrun on `ranks` local ranks; as is
    for one rank."""
    if ranks == 1:
        return cmd
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(ranks), *cmd[1:]]


def losses(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if "loss" in r}


@pytest.mark.timeout(300)
def test_training_reduces_loss_and_resume_is_bitwise_exact(tiny_data, tmp_path):
    straight, sliced = tmp_path / "straight", tmp_path / "sliced"
    done = run(train_cmd(tiny_data, straight, "train.steps=30", "train.eval_every=10"))
    assert done.returncode == 0, done.stderr
    assert "CPU memory: " in done.stderr  # what the trainer did with malloc (cpu_memory.py)
    curve = losses(straight)
    assert sorted(curve) == list(range(1, 31))
    assert sum(list(curve.values())[-5:]) / 5 < curve[1] - 0.5  # it learns
    for name in ("config.yaml", "metrics.jsonl", "loss_curve.png", "mlflow.db"):
        assert (straight / name).exists(), name
    val = [json.loads(x) for x in (straight / "metrics.jsonl").read_text().splitlines()
           if "val_loss" in x]
    assert [v["step"] for v in val] == [10, 20, 30] and all("loss" not in v for v in val)

    first = run(train_cmd(tiny_data, sliced, "train.steps=30", "train.eval_every=10",
                          "train.stop_at=13"))
    assert first.returncode == 0, first.stderr
    with open(sliced / "metrics.jsonl", "a") as f:
        f.write('{"step": 14, "loss": 1.0, "lr"')  # a torn line, as if killed mid-write
    second = run(train_cmd(tiny_data, sliced, "train.steps=30", "train.eval_every=10",
                           "train.resume=auto"))
    assert second.returncode == 0, second.stderr
    assert losses(sliced) == curve  # bitwise: same floats at every step
    from pretrain.checkpoint import latest_checkpoint
    from pretrain.sharded_checkpoint import read_checkpoint

    a = read_checkpoint(latest_checkpoint(straight / "checkpoints"))["model"]
    b = read_checkpoint(latest_checkpoint(sliced / "checkpoints"))["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)

    evaluated = run([sys.executable, "-m", "pretrain", "eval", "--run", str(straight)])
    assert evaluated.returncode == 0, evaluated.stderr
    assert "val_loss" in evaluated.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("override,key", [
    ("model.n_heads=3", "model.n_heads"),
    ("model.dwa_dilation=0", "model.dwa_dilation"),
    ("train.steps=abc", "train.steps"),
    ("model.no_such_key=1", "model.no_such_key"),
    ("model.vocab_size=300", "model.vocab_size"),  # differs from the tokenizer
])
def test_invalid_config_exits_2_naming_the_key(tiny_data, tmp_path, override, key):
    result = run(train_cmd(tiny_data, tmp_path / "run", override), timeout=120)
    assert result.returncode == 2, result.stderr
    assert key in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.timeout(300)
def test_nan_loss_stops_with_last_good_checkpoint_intact(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    # An absurd learning rate blows the weights up after the first update.
    result = run(train_cmd(tiny_data, run_dir, "train.steps=10", "optim.lr=1e30",
                           "optim.min_lr=0", "optim.warmup_steps=0", "checkpoint.every=1"))
    assert result.returncode == 3, result.stderr
    assert "non-finite" in result.stderr
    from pretrain.checkpoint import latest_checkpoint
    from pretrain.sharded_checkpoint import read_checkpoint

    last = latest_checkpoint(run_dir / "checkpoints")
    state = read_checkpoint(last)
    assert all(torch.isfinite(t).all() for t in state["model"].values())

    # Skipping stops once more than train.max_consecutive_skips steps in a row are skipped
    # (tests/test_run_safety.py); below that the run ends normally.
    skipped = run(train_cmd(tiny_data, tmp_path / "skip", "train.steps=4", "optim.lr=1e30",
                            "optim.min_lr=0", "optim.warmup_steps=0", "train.on_nan=skip"))
    assert skipped.returncode == 0, skipped.stderr
    records = [json.loads(x) for x in (tmp_path / "skip/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("skipped")] == [2, 3, 4]
    too_many = run(train_cmd(tiny_data, tmp_path / "too-many", "train.steps=4", "optim.lr=1e30",
                             "optim.min_lr=0", "optim.warmup_steps=0", "train.on_nan=skip",
                             "train.max_consecutive_skips=2"))
    assert too_many.returncode == 3, too_many.stderr


@pytest.mark.timeout(300)
def test_sigterm_saves_a_checkpoint_and_resume_finishes(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(train_cmd(tiny_data, run_dir, "train.steps=100000"), cwd=ROOT,
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 120
    metrics = run_dir / "metrics.jsonl"
    while time.time() < deadline:
        if metrics.exists() and metrics.read_text().count("\n") >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)  # a second signal while stopping changes nothing
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr
    from pretrain.checkpoint import latest_checkpoint, read_meta

    step = read_meta(latest_checkpoint(run_dir / "checkpoints"))["step"]
    assert step >= 3
    resumed = run(train_cmd(tiny_data, run_dir, f"train.steps={step + 2}", "train.resume=auto"))
    assert resumed.returncode == 0, resumed.stderr
    assert max(losses(run_dir)) == step + 2


@pytest.mark.timeout(300)
def test_two_data_parallel_ranks_match_one(tiny_data, tmp_path):
    one = run(train_cmd(tiny_data, tmp_path / "one", "train.steps=5", "tracking.enabled=false"))
    assert one.returncode == 0, one.stderr
    two = run(on_ranks(2, train_cmd(tiny_data, tmp_path / "two", "train.steps=5",
                                    "tracking.enabled=false")))
    assert two.returncode == 0, two.stderr
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert a.keys() == b.keys()
    for step in a:
        assert abs(a[step] - b[step]) < 1e-5, (step, a[step], b[step])
