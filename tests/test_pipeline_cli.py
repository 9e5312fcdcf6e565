"""`torchrun ... -m pretrain train --set parallel.pp=2` equals the 1-process run, and its
checkpoints load at another pipeline size (and back)."""

import json

import pytest

from tests.test_train import losses, on_ranks, run, train_cmd


def records(run_dir) -> dict[int, dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if "loss" in r}


@pytest.mark.timeout(600)
def test_cli_pp2_matches_pp1_and_checkpoints_load_across_pipeline_sizes(tiny_data, tmp_path):
    common = ["train.steps=6", "model.n_layers=4", "parallel.microbatches=2",
              "tracking.enabled=false", "train.eval_every=6"]
    one = run(train_cmd(tiny_data, tmp_path / "pp1", *common))
    assert one.returncode == 0, one.stderr

    # steps 1-3 at PP=2 with 2 virtual stages per rank, 4 at PP=1, 5-6 at PP=2 split [3, 1]
    mixed = tmp_path / "mixed"
    segments = [(2, ["parallel.pp=2", "parallel.virtual_stages=2", "train.stop_at=3"]),
                (1, ["train.resume=auto", "train.stop_at=4"]),
                (2, ["parallel.pp=2", "parallel.pp_split=[3,1]", "parallel.pp_transfer=raw",
                     "train.resume=auto"])]
    for n, extra in segments:
        cmd = train_cmd(tiny_data, mixed, *common, *extra)
        result = run(on_ranks(n, cmd))
        assert result.returncode == 0, result.stderr
        if n > 1:
            assert "pipeline: 2 ranks" in result.stderr and "after block" in result.stderr
    meta = json.loads(next((mixed / "checkpoints").glob("step-00000006/meta.json")).read_text())
    assert meta["layout"] == "tp1-pp2-dp1"

    a, b = records(tmp_path / "pp1"), records(mixed)
    assert a.keys() == b.keys() == set(range(1, 7))
    for step in a:
        assert abs(a[step]["loss"] - b[step]["loss"]) < 1e-4, (step, a[step], b[step])
        assert abs(a[step]["grad_norm"] - b[step]["grad_norm"]) < 1e-4 * a[step]["grad_norm"]
    val = [json.loads(x)["val_loss"] for run_dir in (tmp_path / "pp1", mixed)
           for x in (run_dir / "metrics.jsonl").read_text().splitlines() if "val_loss" in x]
    assert len(val) == 2 and abs(val[0] - val[1]) < 1e-4
    assert losses(mixed) == {s: r["loss"] for s, r in b.items()}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cli_four_rank_pipeline_layouts_match_pp1(tiny_data, tmp_path):
    common = ["train.steps=4", "model.n_layers=4", "model.n_heads=2", "parallel.microbatches=4",
              "tracking.enabled=false", "train.batch_size=8"]
    one = run(train_cmd(tiny_data, tmp_path / "pp1", *common))
    assert one.returncode == 0, one.stderr
    a = records(tmp_path / "pp1")
    layouts = {"tp2-pp2": ["parallel.pp=2", "parallel.tp=2"], "pp4": ["parallel.pp=4"],
               "pp2-dp2": ["parallel.pp=2", "parallel.microbatches=2"],
               "pp2-interleaved": ["parallel.pp=2", "parallel.virtual_stages=2"]}
    for name, extra in layouts.items():
        cmd = train_cmd(tiny_data, tmp_path / name, *common, *extra)
        n = 2 if name == "pp2-interleaved" else 4
        result = run(on_ranks(n, cmd), timeout=600)
        assert result.returncode == 0, (name, result.stderr)
        b = records(tmp_path / name)
        assert a.keys() == b.keys(), name
        for step in a:
            assert abs(a[step]["loss"] - b[step]["loss"]) < 1e-4, (name, step, a[step], b[step])
