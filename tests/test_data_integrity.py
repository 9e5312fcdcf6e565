"""Prepared data that no longer matches its index: a wrong sample count is refused when
training starts (one stat per shard), a changed byte by `inspect` (shard sha256)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import tempfile

import numpy as np
import pytest
from data_fixtures import downgrade_to_version_1, make_documents, prepare_tiny, write_jsonl

from data_pipeline import DataError
from data_pipeline.__main__ import main
from data_pipeline.index import read_index, sha256_file
from data_pipeline.shard_layout import record_bytes
from tests.conftest import ROOT, cli_env

# A model that fits the tiny dataset (vocab 400, seq_len 16); two steps at most.
TINY_TRAIN = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=16",
              "model.dwa_dilation=1", "model.dwa_period=1", "train.batch_size=8",
              "train.steps=2", "optim.warmup_steps=1", "data.val_batches=1"]


@pytest.fixture(autouse=True)
def private_temp_dir(tmp_path, monkeypatch):
    """The loader's wids cache (symlinks) lives in the temp dir: keep it in tmp_path."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "c.jsonl", make_documents())


@pytest.fixture
def dataset(tmp_path, corpus):
    """A fresh dataset per test (tests below damage it): 19 samples a full shard."""
    return prepare_tiny([corpus], tmp_path / "ds", shard_mb=0.02)


def set_sample_count(index, split: str, number: int, samples: int) -> None:
    """Rewrite index.json with another sample count for one shard (its size left alone)."""
    raw = json.loads(index.index_path.read_text())
    raw["splits"][split]["shards"][number]["samples"] = samples
    index.index_path.write_text(json.dumps(raw))


def test_shard_sizes_follow_from_sample_counts(dataset):
    record = record_bytes(dataset.sample_len, dataset.token_dtype)
    for split in ("train", "val"):
        for shard in dataset.shards(split):
            assert shard.path.stat().st_size == shard.num_samples * record + 1024
            assert shard.sha256 == sha256_file(shard.path)
            with tarfile.open(shard.path) as tar:  # still a tar the stdlib reads to the end
                assert len(tar.getmembers()) == shard.num_samples


@pytest.mark.timeout(60)
@pytest.mark.parametrize("delta", [1, -1], ids=["too_high", "too_low"])
def test_wrong_sample_count_refused_at_start(dataset, delta):
    shard = dataset.shards("train")[1]
    set_sample_count(dataset, "train", 1, shard.num_samples + delta)
    with pytest.raises(DataError) as caught:
        read_index(dataset.data_dir)
    message = str(caught.value)
    assert str(shard.path) in message
    assert f"index says {shard.num_samples + delta} samples" in message
    assert f"({shard.num_samples} samples)" in message
    assert f"has {shard.num_bytes} bytes" in message
    # Reading the index alone (what `python -m pretrain config` does) looks at no shard.
    assert read_index(dataset.data_dir, check_files=False).shards("train")[1].num_samples == (
        shard.num_samples + delta
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("delta", [1, -1], ids=["too_high", "too_low"])
def test_train_cli_exits_2_on_wrong_sample_count(dataset, tmp_path, delta):
    shard = dataset.shards("val")[0]
    set_sample_count(dataset, "val", 0, shard.num_samples + delta)
    run_dir = tmp_path / "run"
    sets = [*TINY_TRAIN, f"data.path={dataset.data_dir}", f"run.dir={run_dir}"]
    result = subprocess.run(
        [sys.executable, "-m", "pretrain", "train", "--config", str(ROOT / "configs/tiny.yaml"),
         *[arg for item in sets for arg in ("--set", item)]],
        capture_output=True, text=True, timeout=240, env=cli_env(), cwd=ROOT,
    )
    assert result.returncode == 2, result.stderr
    assert f"error: {shard.path}: index says {shard.num_samples + delta} samples" in result.stderr
    assert not (run_dir / "checkpoints").exists()


@pytest.mark.timeout(60)
def test_flipped_token_refused_by_inspect(dataset):
    shard = dataset.shards("train")[0]
    with tarfile.open(shard.path) as tar:
        member = tar.getmembers()[5]
        stored = np.load(io.BytesIO(tar.extractfile(member).read()))
    npy_header = member.size - stored.nbytes
    token = 3
    position = member.offset_data + npy_header + token * stored.itemsize  # low byte (<u2)
    data = bytearray(shard.path.read_bytes())
    data[position] ^= 0x01
    shard.path.write_bytes(bytes(data))
    with tarfile.open(shard.path) as tar:
        damaged = np.load(io.BytesIO(tar.extractfile(tar.getmembers()[5]).read()))
    # Same size, a valid tar, a token id still inside the vocabulary: only the hash tells.
    assert damaged[token] != stored[token] and 0 <= damaged[token] < dataset.vocab_size
    read_index(dataset.data_dir)  # the start-time check only stats: it cannot see this
    result = subprocess.run(
        [sys.executable, "-m", "data_pipeline", "inspect", str(dataset.data_dir)],
        capture_output=True, text=True, timeout=60, env=cli_env(), cwd=ROOT,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert str(shard.path) in result.stderr
    assert shard.sha256 in result.stderr and sha256_file(shard.path) in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(60)
def test_old_index_version_is_refused_naming_it(dataset, capsys):
    downgrade_to_version_1(dataset.data_dir)
    with pytest.raises(DataError, match=r"version 1, expected 'denseformer-data' version 2 "
                       r"\(version 1 is an older `prepare`'s: prepare the dataset again\)"):
        read_index(dataset.data_dir)
    assert main(["inspect", str(dataset.data_dir), "--samples", "0"]) == 2
    assert f"{dataset.index_path}: format 'denseformer-data' version 1" in \
        capsys.readouterr().err
