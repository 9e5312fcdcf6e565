"""ZeRO and activation checkpointing through `python -m pretrain train` (and torchrun).

Checkpoints are layout-independent: a ZeRO-2 run at DP=2 stopped at step 3 resumes at DP=1
without ZeRO, and a plain DP=1 run resumes under ZeRO-2 at DP=2; both reproduce the losses
of the uninterrupted single-process run (tolerance 1e-5 absolute: DP splits the batch, so
sums are ordered differently). Invalid combinations exit with status 2 before any rank
starts.
"""

import sys

import pytest

from tests.test_train import losses, run, train_cmd

STEPS = ["train.steps=6", "tracking.enabled=false", "parallel.microbatches=2"]


def torchrun(*cmd: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "2", *cmd[1:]]


def assert_same_curve(got: dict, ref: dict, what: str) -> None:
    assert got.keys() == ref.keys(), what
    for step in ref:
        assert abs(got[step] - ref[step]) < 1e-5, (what, step, got[step], ref[step])


@pytest.mark.timeout(600)
def test_zero2_dp2_resumes_at_dp1_without_zero_and_back(tiny_data, tmp_path):
    straight = run(train_cmd(tiny_data, tmp_path / "straight", *STEPS))
    assert straight.returncode == 0, straight.stderr
    reference = losses(tmp_path / "straight")

    zero_dir = tmp_path / "zero-then-plain"
    first = run(torchrun(*train_cmd(tiny_data, zero_dir, *STEPS, "parallel.zero_stage=2",
                                    "parallel.activation_checkpointing=dwa_block",
                                    "train.stop_at=3")))
    assert first.returncode == 0, first.stderr
    second = run(train_cmd(tiny_data, zero_dir, *STEPS, "train.resume=auto"))
    assert second.returncode == 0, second.stderr
    assert_same_curve(losses(zero_dir), reference, "ZeRO-2 DP=2 -> plain DP=1")

    plain_dir = tmp_path / "plain-then-zero"
    first = run(train_cmd(tiny_data, plain_dir, *STEPS, "train.stop_at=3"))
    assert first.returncode == 0, first.stderr
    second = run(torchrun(*train_cmd(tiny_data, plain_dir, *STEPS, "parallel.zero_stage=2",
                                     "train.resume=auto")))
    assert second.returncode == 0, second.stderr
    assert_same_curve(losses(plain_dir), reference, "plain DP=1 -> ZeRO-2 DP=2")


@pytest.mark.parametrize("overrides,key", [
    (["parallel.tp=2", "parallel.zero_stage=2"], "parallel.zero_stage"),
    (["parallel.pp=2", "parallel.zero_stage=3"], "parallel.zero_stage"),
    (["parallel.zero_stage=4"], "parallel.zero_stage"),
    (["parallel.pp=2", "parallel.activation_checkpointing=dwa_block"],
     "parallel.activation_checkpointing"),
    (["parallel.activation_checkpointing=blocks"], "parallel.activation_checkpointing"),
    (["parallel.checkpoint_every=0"], "parallel.checkpoint_every"),
])
def test_invalid_combinations_exit_2_naming_the_key(tiny_data, tmp_path, overrides, key):
    result = run(train_cmd(tiny_data, tmp_path / "run", *overrides), timeout=120)
    assert result.returncode == 2, result.stderr
    assert key in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(600)
def test_zero1_with_pipeline_pp2_dp2_matches_and_resumes_at_dp1(tiny_data, tmp_path):
    """ZeRO-1 over the DP group with the pipeline schedule outside the engine (docs/pipeline.md),
    block checkpointing in the stages; its checkpoint resumes in one process."""
    steps = [*STEPS, "model.n_layers=4"]
    straight = run(train_cmd(tiny_data, tmp_path / "straight", *steps))
    assert straight.returncode == 0, straight.stderr
    run_dir = tmp_path / "pp-zero"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "4", *train_cmd(tiny_data, run_dir, *steps, "parallel.pp=2", "parallel.zero_stage=1",
                           "parallel.activation_checkpointing=block", "train.stop_at=3")[1:]]
    first = run(cmd, timeout=500)
    assert first.returncode == 0, first.stderr
    second = run(train_cmd(tiny_data, run_dir, *steps, "train.resume=auto"))
    assert second.returncode == 0, second.stderr
    assert_same_curve(losses(run_dir), losses(tmp_path / "straight"), "PP=2 DP=2 ZeRO-1")
