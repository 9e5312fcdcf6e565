"""parallel.microbatches: auto (parallel/strategies/microbatch_fit.py): the fewest micro-batches
whose estimated peak fits 85% of the free memory, counts that suit the batch and the schedule, and
a config error naming the key on a CPU or when nothing fits."""

import subprocess
import types

import pytest
import torch

from parallel.strategies.microbatch_fit import (
    FILL,
    Batch,
    candidates,
    estimated_peak,
    fit_microbatches,
    resolve_microbatches,
    with_microbatches,
)
from pretrain.config import ConfigError, load_config
from tests.conftest import cli_env
from tests.test_train import train_cmd

# Activations dominate at this shape, so that the estimate falls with each halving.
SHAPE = ["model.n_layers=4", "model.d_model=256", "model.n_heads=4", "model.seq_len=512",
         "model.vocab_size=1000", "train.batch_size=16", "train.dtype=bf16"]


def config(*overrides: str, world_size: int = 1):
    return load_config(None, [*SHAPE, "parallel.microbatches=auto", *overrides],
                       world_size=world_size)


def batch(cfg) -> Batch:
    return Batch(cfg.train.batch_size, cfg.train.dtype, cfg.optim.decay_alphas)


def test_candidates_split_the_rank_batch_and_suit_the_schedule():
    assert candidates(config().parallel, 12, dp=1) == [1, 2, 3, 4, 6, 12]
    assert candidates(config().parallel, 12, dp=2) == [1, 2, 3, 6]
    # interleaved 1F1B: a multiple of pp or fewer than 2 x pp
    interleaved = config("model.n_layers=8", "parallel.pp=2", "parallel.virtual_stages=2",
                         "train.batch_size=10", world_size=2)
    assert candidates(interleaved.parallel, 10, dp=1) == [1, 2, 10]  # 5 is two rounds of 2 and one


def test_the_fewest_micro_batches_whose_estimate_fits():
    cfg = config()
    p, model = cfg.parallel, cfg.model
    peaks = {m: estimated_peak(with_microbatches(p, m), model, batch(cfg), 1)
             for m in candidates(p, cfg.train.batch_size, 1)}
    assert peaks[1] > peaks[2] > peaks[4] > peaks[8] > peaks[16]
    # free memory between the estimates of 2 and 4 micro-batches: 4
    free = int((peaks[2] + peaks[4]) / 2 / FILL)
    assert fit_microbatches(p, model, batch(cfg), 1, free) == (4, peaks[4])
    assert fit_microbatches(p, model, batch(cfg), 1, int(peaks[1] / FILL) + 1) == (1, peaks[1])
    # with two data-parallel ranks each holds 8 sequences: fewer micro-batches fit
    two = config(world_size=2)
    m, _ = fit_microbatches(two.parallel, two.model, batch(two), 2, free)
    assert m == 2


def test_nothing_fits_is_a_config_error_naming_the_key():
    cfg = config()
    smallest = estimated_peak(with_microbatches(cfg.parallel, 16), cfg.model, batch(cfg), 1)
    with pytest.raises(ConfigError, match="parallel.microbatches") as err:
        fit_microbatches(cfg.parallel, cfg.model, batch(cfg), 1, int(smallest / FILL) - 2**20)
    assert "16 micro-batches of 1 sequence" in str(err.value)


def test_resolution_on_cpu_names_the_key_and_numbers_pass_through():
    cpu = types.SimpleNamespace(device=torch.device("cpu"), world=1, dp=1)
    with pytest.raises(ConfigError, match="parallel.microbatches.*CUDA"):
        resolve_microbatches(config().parallel, config().model, batch(config()), cpu)
    fixed = config("parallel.microbatches=4")
    assert resolve_microbatches(fixed.parallel, fixed.model, batch(fixed), cpu) == (
        fixed.parallel, None)
    with pytest.raises(ConfigError, match="parallel.microbatches"):
        config("train.device=cpu")  # refused before launch when the device is named
    with pytest.raises(ConfigError, match="parallel.microbatches"):
        config("parallel.microbatches=0")


@pytest.mark.timeout(120)
def test_train_with_auto_on_cpu_exits_2_naming_the_key(tiny_data, tmp_path):
    result = subprocess.run(train_cmd(tiny_data, tmp_path / "run", "parallel.microbatches=auto"),
                            capture_output=True, text=True, timeout=110, env=cli_env())
    assert result.returncode == 2, result.stderr
    assert "parallel.microbatches" in result.stderr and "CUDA" in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
