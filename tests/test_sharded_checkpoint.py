"""Sharded checkpoints (pretrain/sharded_checkpoint.py): every rank writes only what it owns,
any layout resumes them, ranks verify disjoint files, and the checkpoint tools read them."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint import checkpoint_dir, hash_share, read_manifest
from tests.conftest import ROOT
from tests.test_train import TINY, losses, on_ranks, run, train_cmd

# 6 blocks x 128 wide, vocabulary 512 (tiny_data): the shape the sharding bound is set for.
WIDE = ["train.steps=6", "model.n_layers=6", "model.d_model=128", "model.n_heads=4",
        "parallel.microbatches=2", "tracking.enabled=false", "data.val_batches=0",
        "checkpoint.every=2", "checkpoint.keep=0"]


def _train(data: Path, run_dir: Path, ranks: int, *extra: str):
    cmd = train_cmd(data, run_dir, *WIDE, *extra)
    result = run(on_ranks(ranks, cmd), timeout=600)
    assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def straight(tiny_data, tmp_path_factory) -> dict[int, float]:
    """Losses of the uninterrupted 6-step run in one process."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    _train(tiny_data, run_dir, 1)
    return losses(run_dir)


@pytest.fixture(scope="module")
def tp2_pp2(tiny_data, tmp_path_factory) -> Path:
    """A run at TP2 x PP2 (4 ranks) stopped after step 4 (checkpoints at steps 2 and 4)."""
    run_dir = tmp_path_factory.mktemp("tp2pp2") / "run"
    _train(tiny_data, run_dir, 4, "parallel.tp=2", "parallel.pp=2", "train.stop_at=4")
    return run_dir


@pytest.mark.timeout(900)
def test_tp2_pp2_checkpoint_is_sharded_evenly_over_the_ranks(tp2_pp2):
    path = checkpoint_dir(tp2_pp2 / "checkpoints", 4)
    files = read_manifest(path)["files"]
    total = sum(f["bytes"] for f in files.values())
    assert max(f["bytes"] for f in files.values()) <= 0.6 * total, files
    per_rank = [files[f"tensors/__{rank}_0.distcp"]["bytes"] for rank in range(4)]
    even = sum(per_rank) / 4
    assert all(abs(b - even) <= 0.25 * even for b in per_rank), per_rank
    assert not any(rel.endswith(".pt") for rel in files)  # nothing gathered to one writer
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 4 and meta["layout"] == "tp2-pp2-dp1" and meta["world"] == 4

    shown = run([sys.executable, "-m", "pretrain", "checkpoint", "inspect", str(path),
                 "--verify"], timeout=120)
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert f"checkpoint {path}: step 4, format 2, written at layout tp2-pp2-dp1 (4 ranks)" in out
    assert "model.dwa_alpha: (6, 7) float32" in out  # one global alpha matrix
    assert "model.embedding.weight: (512, 128) float32, 262,144 bytes in 2 shard(s)" in out
    assert "optim.blocks.5.mlp.fc_in.weight.exp_avg:" in out
    assert "intact: sizes and sha256 of every file match the manifest" in out


@pytest.mark.timeout(900)
def test_tp2_pp2_resumes_in_one_process_and_at_dp2_past_a_corrupt_checkpoint(
        tiny_data, straight, tp2_pp2, tmp_path):
    one = tmp_path / "one"
    shutil.copytree(tp2_pp2, one)
    resumed = _train(tiny_data, one, 1, "train.resume=auto")
    assert f"resuming from {checkpoint_dir(one / 'checkpoints', 4)} (step 4)" in resumed.stderr

    # At DP2, corrupt (same size) a file of step 4 that rank 1, not rank 0, hashes: both
    # ranks must agree to fall back to step 2.
    dp2 = tmp_path / "dp2"
    shutil.copytree(tp2_pp2, dp2)
    newest = checkpoint_dir(dp2 / "checkpoints", 4)
    victim = newest / hash_share(read_manifest(newest)["files"], 1, 2)[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    resumed = _train(tiny_data, dp2, 2, "train.resume=auto")
    assert f"resuming from {checkpoint_dir(dp2 / 'checkpoints', 2)} (step 2)" in resumed.stderr
    assert f"{victim}: sha256 differs from the manifest (corrupt)" in resumed.stderr

    for run_dir in (one, dp2):
        got = losses(run_dir)
        assert got.keys() == straight.keys() == set(range(1, 7)), run_dir
        for step, loss in straight.items():
            assert abs(got[step] - loss) < 1e-4, (run_dir.name, step, got[step], loss)


# The tensor primitives every collective (object collectives included) ends in.
_PRIMITIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "gather",
               "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "send",
               "recv", "isend", "irecv")


def save_with_traffic_recorded(data: str, run_dir: str, world: int, layout: list[str],
                               full_state: bool = False) -> dict:
    """(in each of `world` ranks, `layout` overrides) one step, then a save with every
    collective's tensor bytes recorded; the largest, what the save wrote and where, and
    with `full_state` the ZeRO engine's full (gathered) model and optimizer state."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from pretrain.config import load_config
    from pretrain.train import Trainer, distributed_session

    sets = [*TINY, *WIDE, f"data.path={data}", f"run.dir={run_dir}", *layout]
    cfg = load_config(ROOT / "configs/tiny.yaml", sets, world_size=world)
    largest = [0]

    def recorded(fn):
        def call(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list) for t in a
                        if isinstance(t, torch.Tensor)]
            largest[0] = max([largest[0], *(t.numel() * t.element_size() for t in tensors)])
            return fn(*args, **kwargs)
        return call

    with distributed_session():
        trainer = Trainer(cfg)
        trainer.train_step(trainer.next_batch(iter(trainer.loader)))
        saved = {name: getattr(distributed_c10d, name) for name in _PRIMITIVES}
        for name, fn in saved.items():
            setattr(distributed_c10d, name, recorded(fn))
            setattr(dist, name, getattr(distributed_c10d, name))
        try:
            path = trainer.save()
        finally:
            for name, fn in saved.items():
                setattr(distributed_c10d, name, fn)
                setattr(dist, name, fn)
        full = None
        if full_state:
            zero = trainer.engine.update_rule.zero
            full = zero.full_model_state(), zero.full_optimizer_state()
        trainer.loader.close()
        if trainer.lock is not None:
            trainer.lock.release()
    files = read_manifest(path)["files"]
    return {"largest": largest[0], "bytes": sum(f["bytes"] for f in files.values()),
            "path": str(path), "full": full}


@pytest.mark.timeout(300)
def test_no_collective_of_a_save_carries_more_than_1_mib(tiny_data, tmp_path):
    from tests.distributed import run_distributed_test

    results = run_distributed_test(save_with_traffic_recorded, world_size=4, timeout_s=240,
                                   set_up_groups=False, data=str(tiny_data),
                                   run_dir=str(tmp_path / "run"), world=4,
                                   layout=["parallel.tp=2", "parallel.pp=2"])
    total = results[0]["bytes"]
    assert total > 8 * 2**20  # weights and AdamW moments: gathering them would show
    for rank, result in enumerate(results):
        assert 0 < result["largest"] <= 2**20, (rank, result)


def _train_then_export_view(data: str, run_dir: str) -> dict:
    """(in each of 2 ranks, TP2) train 2 steps, save, and return the live model's logits."""
    import torch.distributed as dist

    from pretrain.config import load_config, save_config
    from pretrain.train import Trainer, distributed_session

    sets = [*TINY, f"data.path={data}", f"run.dir={run_dir}", "parallel.tp=2",
            "tracking.enabled=false", "data.val_batches=0"]
    cfg = load_config(ROOT / "configs/tiny.yaml", sets, world_size=2)
    with distributed_session():
        trainer = Trainer(cfg)
        batches = iter(trainer.loader)
        for _ in range(2):
            trainer.train_step(trainer.next_batch(batches))
        path = trainer.save()
        if dist.get_rank() == 0:  # as the trainer's loop does at start
            save_config(trainer.cfg, Path(run_dir) / "config.yaml")
        tokens = torch.randint(0, trainer.index.vocab_size, (2, 16),
                               generator=torch.Generator().manual_seed(5))
        trainer.model.eval()
        with torch.no_grad():
            logits = trainer.model(tokens)
        trainer.loader.close()
        if trainer.lock is not None:
            trainer.lock.release()
    return {"path": str(path), "tokens": tokens, "logits": logits}


@pytest.mark.timeout(300)
def test_export_gives_the_live_models_logits(tiny_data, tmp_path):
    from safetensors.torch import load_file

    from pretrain.cli import main
    from pretrain.config import load_config
    from pretrain.model import DenseFormer
    from pretrain.model.state import load_full_model_state
    from tests.distributed import run_distributed_test

    live = run_distributed_test(_train_then_export_view, world_size=2, timeout_s=240,
                                set_up_groups=False, data=str(tiny_data),
                                run_dir=str(tmp_path / "run"))[0]
    out = tmp_path / "export"
    assert main(["checkpoint", "export", live["path"], "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "model.safetensors",
                                                     "tokenizer.model"]
    cfg = load_config(out / "config.yaml")
    model = DenseFormer(cfg.model)
    load_full_model_state(model, load_file(out / "model.safetensors"))
    model.eval()
    with torch.no_grad():
        logits = model(live["tokens"])
    torch.testing.assert_close(logits, live["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(600)
def test_old_format_is_refused_and_one_process_writes_a_checkpoint_that_resumes_exactly(
        tiny_data, tmp_path):
    from pretrain.sharded_checkpoint import read_checkpoint, write_checkpoint
    from tests.test_checkpoint import format_1_checkpoint

    common = ["train.steps=4", "tracking.enabled=false", "data.val_batches=0",
              "checkpoint.every=2", "checkpoint.keep=0"]
    straight = tmp_path / "straight"
    done = run(train_cmd(tiny_data, straight, *common))
    assert done.returncode == 0, done.stderr
    state = read_checkpoint(checkpoint_dir(straight / "checkpoints", 2))

    # The step-2 checkpoint as the trainer wrote it before sharded checkpoints.
    run_dir = tmp_path / "old"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copy(straight / "config.yaml", run_dir / "config.yaml")
    old = format_1_checkpoint(checkpoint_dir(run_dir / "checkpoints", 2), state)
    refused = run(train_cmd(tiny_data, run_dir, *common, "train.resume=auto"))
    assert refused.returncode == 2, refused.stderr
    assert f"{old} is a checkpoint of format 1" in refused.stderr
    assert "reads format 2 only" in refused.stderr and "commit 8c1caaa" in refused.stderr

    # The same state written by one process resumes as the trainer's own checkpoint.
    shutil.rmtree(old)
    write_checkpoint(run_dir / "checkpoints", 2, state)
    resumed = run(train_cmd(tiny_data, run_dir, *common, "train.resume=auto"))
    assert resumed.returncode == 0, resumed.stderr
    assert {s: v for s, v in losses(run_dir).items() if s > 2} == \
        {s: v for s, v in losses(straight).items() if s > 2}  # bitwise: same layout
