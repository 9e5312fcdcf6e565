"""train.compile: auto (parallel/strategies/compile_choice.py): the mode each layout and device
gets, the default, and how the config command prints it."""

import subprocess
import sys

import pytest

from parallel.strategies.compile_choice import compile_mode
from pretrain.config import load_config
from tests.conftest import ROOT, cli_env


def mode(device: str, *overrides: str, world_size: int = 1) -> str:
    cfg = load_config(None, ["model.vocab_size=128", "model.n_layers=4", *overrides],
                      world_size=world_size)
    return compile_mode(cfg.train.compile, cfg.parallel, cfg.model, device)[0]


@pytest.mark.parametrize("overrides, world, cuda", [
    (["model.dwa=false"], 1, "model"),  # a Transformer: the whole loss
    ([], 1, "blocks"),  # a DenseFormer: its buffered DWAs stay eager
    (["model.dwa=false", "parallel.pp=2"], 2, "blocks"),  # the schedule runs each stage
    (["model.dwa=false", "parallel.zero_stage=3"], 2, "none"),  # compiled modes refused
    (["model.dwa=false", "train.compile=blocks"], 1, "blocks"),  # a setting is kept
    (["model.connection=attnres"], 1, "model"),  # the mixes trace into the one graph
    (["model.connection=attnres", "parallel.pp=2"], 2, "blocks"),
    (["model.connection=mudd"], 1, "none"),  # the buffered mixes run eagerly
])
def test_auto_on_cuda_and_cpu(overrides, world, cuda):
    assert mode("cuda", *overrides, world_size=world) == cuda
    expected_cpu = "blocks" if "train.compile=blocks" in overrides else "none"
    assert mode("cpu", *overrides, world_size=world) == expected_cpu


def test_auto_is_the_default_and_the_config_command_prints_it():
    assert load_config(None, []).train.compile == "auto"
    done = subprocess.run([sys.executable, "-m", "pretrain", "config", "--config",
                           str(ROOT / "configs/tiny.yaml")], capture_output=True, text=True,
                          timeout=120, env=cli_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "  compile: auto\n" in done.stdout and "  dtype: auto\n" in done.stdout
