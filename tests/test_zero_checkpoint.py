"""ZeRO checkpoints as shards (pretrain/zero_checkpoint.py, pretrain/flat_shards.py) and the
DeepSpeed internals they read (parallel/primitives/deepspeed_compat.py).

A ZeRO checkpoint is exact: what a ZeRO-1/2/3 engine at DP=2 writes, read back in one
process, equals DeepSpeed's own gathered full tensors bit for bit, and loading it into
another stage (or plain AdamW) gives that engine the same full state bit for bit; the loss
curves of resumed runs are checked through the CLI (tests/test_zero_cli.py, and here under
`slow`). A save moves no tensor data through a collective.
"""

from __future__ import annotations

import math
import types
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed_test


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3)])
def test_flat_ranges_are_at_most_2n_minus_1_boxes_in_flat_order(shape):
    from pretrain.flat_shards import flat_range_blocks

    numel = math.prod(shape)
    flat = torch.arange(numel).view(shape)
    for start in range(numel):
        for count in range(1, numel - start + 1):
            blocks = flat_range_blocks(shape, start, count)
            assert len(blocks) <= 2 * (len(shape) - 1) + 1, (shape, start, count, blocks)
            covered = torch.cat([flat[tuple(slice(o, o + s) for o, s in zip(*b, strict=True))]
                                 .reshape(-1) for b in blocks])
            assert covered.tolist() == list(range(start, start + count)), (shape, start, count)


# -- in-process: DeepSpeed's internals, exact round trips between stages --------------------

def _owned_ranges_checked(zero) -> dict:
    """{name: (start, numel, local numel, whether master and moments match DeepSpeed's public
    full-tensor helpers over the range)} (collective: the helpers all-reduce)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from parallel.primitives import deepspeed_compat as compat

    optimizer = zero.engine.optimizer
    compat.relink_optimizer_state(optimizer)  # for safe_get_full_optimizer_state
    checked = {}
    for name, param in zero.model.named_parameters():
        owned = compat.owned_range(optimizer, param)
        full = safe_get_full_fp32_param(param).reshape(-1)
        moments = {key: safe_get_full_optimizer_state(param, key).reshape(-1)
                   for key in compat.ADAM_MOMENTS}
        shape = compat.local_shape(param)
        if owned is None:
            checked[name] = (0, 0, math.prod(shape), True)
            continue
        part = slice(owned.start, owned.start + owned.numel)
        same = torch.equal(owned.master, full[part]) and all(
            torch.equal(owned.state(optimizer, key), value[part])
            for key, value in moments.items())
        if owned.model_copy is not None:  # ZeRO-3 at fp32: the model copy is the master
            same = same and torch.equal(owned.model_copy, full[part])
        checked[name] = (owned.start, owned.numel, math.prod(shape), same)
    return checked


def _full_state(target) -> tuple[dict, dict]:
    from parallel.strategies.zero import ZeroEngine
    from pretrain.model.state import full_model_state, full_optimizer_state

    if isinstance(target, ZeroEngine):
        return target.full_model_state(), target.full_optimizer_state()
    model, optimizer = target
    return full_model_state(model), full_optimizer_state(model, optimizer)


def _same(a: tuple[dict, dict], b: tuple[dict, dict]) -> bool:
    (model_a, optim_a), (model_b, optim_b) = a, b
    return model_a.keys() == model_b.keys() == optim_a.keys() == optim_b.keys() and all(
        torch.equal(model_a[n], model_b[n]) for n in model_a) and all(
        torch.equal(optim_a[n][k].float(), optim_b[n][k].float())
        for n in optim_a for k in optim_a[n])


def zero_cases(root: str) -> dict:
    """(each of 2 ranks) ZeRO-1/2/3 engines after 2 steps: DeepSpeed's internals checked,
    a checkpoint written, read back whole, and loaded into another stage (0: plain AdamW)."""
    import torch.distributed as dist

    from pretrain import sharded_checkpoint, zero_checkpoint
    from pretrain.checkpoint import Retention, read_manifest
    from pretrain.run_checkpoint import save_run
    from tests.test_zero import build, config, zero_engine, zero_steps

    rank, out = dist.get_rank(), {}
    for stage, other in ((1, 3), (2, 0), (3, 1)):
        cfg = config(f"parallel.zero_stage={stage}")
        zero = zero_engine(*build(cfg), cfg)
        zero_steps(zero, cfg, 1, 2)
        internals = _owned_ranges_checked(zero)
        full = _full_state(zero)
        engine = types.SimpleNamespace(sharded_state=lambda z=zero: zero_checkpoint.local_state(z))
        path = save_run(engine, Path(root) / f"zero{stage}", 2, {"step": 2}, Retention(keep=0),
                        rank=rank, world=2)
        written = sharded_checkpoint.read_checkpoint(path)
        written = (written["model"], written["optimizer"])
        cfg_other = config(f"parallel.zero_stage={other}")
        cfg_other.train.seed += 1  # other initial weights: the load must replace them all
        model, optimizer = build(cfg_other)
        if other:
            loaded = zero_engine(model, optimizer, cfg_other)
            zero_checkpoint.load_local(path, read_manifest(path), loaded)
        else:
            loaded = (model, optimizer)
            sharded_checkpoint.load_local(path, read_manifest(path), model, optimizer)
        out[stage] = {"internals": internals, "written": _same(written, full),
                      "loaded": (other, _same(_full_state(loaded), full))}
    return out


@pytest.fixture(scope="module")
def zero_results(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("zero-ckpt")
    return run_distributed_test(zero_cases, world_size=2, timeout_s=400, root=str(root))


def test_deepspeed_is_the_version_deepspeed_compat_was_checked_against():
    import deepspeed

    from parallel.primitives.deepspeed_compat import TESTED_VERSION

    assert deepspeed.__version__ == TESTED_VERSION, (
        f"DeepSpeed {deepspeed.__version__}: re-check parallel/primitives/deepspeed_compat.py "
        f"against it (this file's tests), then raise TESTED_VERSION")


@pytest.mark.timeout(420)
def test_deepspeed_compat_reads_what_each_rank_owns(zero_results):
    """Every rank's ranges tile each parameter exactly once, and the master weights and
    AdamW moments read over them are DeepSpeed's (its gathering helpers as the reference)."""
    for stage in (1, 2, 3):
        names = zero_results[0][stage]["internals"].keys()
        for name in names:
            ranges = sorted((r[stage]["internals"][name] for r in zero_results))
            assert all(same for *_, same in ranges), (stage, name, ranges)
            numel = ranges[0][2]
            covered = [(start, count) for start, count, _, _ in ranges if count]
            assert covered[0][0] == 0 and sum(c for _, c in covered) == numel, (stage, name)
            assert all(a + n == b for (a, n), (b, _) in zip(covered, covered[1:], strict=False)), \
                (stage, name, covered)


@pytest.mark.timeout(420)
def test_zero_checkpoints_are_exact_and_load_at_another_stage(zero_results):
    for rank_result in zero_results:
        for stage in (1, 2, 3):
            result = rank_result[stage]
            assert result["written"], f"ZeRO-{stage}: the checkpoint differs from the state"
            other, same = result["loaded"]
            assert same, f"ZeRO-{stage} checkpoint loaded at stage {other}: state differs"


# -- through the trainer ---------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_no_collective_of_a_zero1_tp2_save_carries_more_than_1_mib(tiny_data, tmp_path):
    """ZeRO-1 at TP2 x DP2: each rank writes its flat ranges of its TP shards (row-blocks
    shifted by the shard's offset), and the written tensors are the engine's full state."""
    from pretrain.sharded_checkpoint import read_checkpoint
    from tests.test_sharded_checkpoint import save_with_traffic_recorded

    results = run_distributed_test(
        save_with_traffic_recorded, world_size=4, timeout_s=240, set_up_groups=False,
        data=str(tiny_data), run_dir=str(tmp_path / "run"), world=4,
        layout=["parallel.tp=2", "parallel.zero_stage=1"], full_state=True)
    assert results[0]["bytes"] > 8 * 2**20  # weights and AdamW moments: gathering would show
    for rank, result in enumerate(results):
        assert 0 < result["largest"] <= 2**20, (rank, result["largest"])
    written = read_checkpoint(results[0]["path"])
    assert _same((written["model"], written["optimizer"]), results[0]["full"])
