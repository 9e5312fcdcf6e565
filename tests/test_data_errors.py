"""Bad input: each case is a DataError naming the file, CLI exit status 2, nothing left
half-written that looks complete."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tempfile

import pytest
from data_fixtures import make_documents, prepare_tiny, write_jsonl

from data_pipeline import DataError
from data_pipeline.__main__ import main
from data_pipeline.index import read_index
from data_pipeline.loader import TrainLoader, validation_batches
from data_pipeline.tokenizer import load_tokenizer


@pytest.fixture(autouse=True)
def private_temp_dir(tmp_path, monkeypatch):
    """The loader's wids cache (symlinks) lives in the temp dir: keep it in tmp_path."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "c.jsonl", make_documents())


@pytest.fixture
def dataset(tmp_path, corpus):
    """A fresh small dataset per test (tests below damage it)."""
    return prepare_tiny([corpus], tmp_path / "ds", shard_mb=0.02)


def cli_error(capsys, argv: list[str]) -> str:
    """Run the CLI in-process; assert exit status 2 and return the error line."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") or "\nerror: " in err
    return err


def prepare_argv(inputs, out) -> list[str]:
    return [
        "prepare",
        "--input",
        *map(str, inputs),
        "--out",
        str(out),
        "--vocab-size",
        "400",
        "--seq-len",
        "16",
        "--workers",
        "1",
    ]


def assert_nothing_left(tmp_path, out):
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".{out.name}.")]


@pytest.mark.timeout(60)
def test_missing_and_empty_inputs(tmp_path, capsys):
    out = tmp_path / "ds"
    missing = tmp_path / "nope.jsonl"
    assert str(missing) in cli_error(capsys, prepare_argv([missing], out))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert str(empty) in cli_error(capsys, prepare_argv([empty], out))
    blank_dir = tmp_path / "blank"
    blank_dir.mkdir()
    assert str(blank_dir) in cli_error(capsys, prepare_argv([blank_dir], out))
    glob = str(tmp_path / "*.txt")
    assert glob in cli_error(capsys, prepare_argv([glob], out))
    other = tmp_path / "corpus.csv"
    other.write_text("a,b\n")
    assert str(other) in cli_error(capsys, prepare_argv([other], out))
    assert_nothing_left(tmp_path, out)


@pytest.mark.timeout(60)
def test_bad_tokenizer_option(tmp_path, corpus, capsys):
    out = tmp_path / "ds"
    base = ["prepare", "--input", str(corpus), "--out", str(out), "--workers", "1"]
    model_dir = tmp_path / "model_dir"
    model_dir.mkdir()
    assert str(model_dir) in cli_error(capsys, base + ["--tokenizer", str(model_dir)])
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"not a model")
    assert str(garbage) in cli_error(capsys, base + ["--tokenizer", str(garbage)])
    both = base + ["--tokenizer", str(garbage), "--vocab-size", "400"]
    assert "either --tokenizer or --vocab-size" in cli_error(capsys, both)
    assert_nothing_left(tmp_path, out)


@pytest.mark.timeout(60)
def test_malformed_inputs(tmp_path, capsys):
    out = tmp_path / "ds"
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    assert f"{bad_json}:2" in cli_error(capsys, prepare_argv([bad_json], out))
    no_text = tmp_path / "notext.jsonl"
    no_text.write_text(json.dumps({"body": "x"}) + "\n")
    assert f"{no_text}:1" in cli_error(capsys, prepare_argv([no_text], out))
    truncated = tmp_path / "cut.jsonl.gz"
    with gzip.open(truncated, "wt") as stream:
        stream.write("".join(json.dumps({"text": d}) + "\n" for d in make_documents(200)))
    truncated.write_bytes(truncated.read_bytes()[:-200])
    assert str(truncated) in cli_error(capsys, prepare_argv([truncated], out))
    assert_nothing_left(tmp_path, out)


@pytest.mark.timeout(60)
def test_failure_after_work_started_leaves_nothing(tmp_path, corpus, capsys):
    out = tmp_path / "ds"
    # Too small a vocabulary fails inside tokenizer training, after the scan.
    argv = prepare_argv([corpus], out)
    argv[argv.index("--vocab-size") + 1] = "100"
    assert "--vocab-size 100" in cli_error(capsys, argv)
    assert_nothing_left(tmp_path, out)
    # Sequences longer than the whole validation split: fails after writing shards.
    argv = prepare_argv([corpus], out)
    argv[argv.index("--seq-len") + 1] = "4000"
    assert "seq-len" in cli_error(capsys, argv)
    assert_nothing_left(tmp_path, out)


@pytest.mark.timeout(60)
def test_refuses_to_overwrite(tmp_path, corpus, capsys):
    out = tmp_path / "ds"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    assert "--force" in cli_error(capsys, prepare_argv([corpus], out))
    # --force replaces only a prepared dataset, never an arbitrary directory.
    assert "index.json" in cli_error(capsys, prepare_argv([corpus], out) + ["--force"])
    assert (out / "precious.txt").read_text() == "keep me"
    # An empty directory is fine.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(prepare_argv([corpus], empty)) == 0


@pytest.mark.timeout(60)
def test_truncated_shard(dataset, capsys):
    shard = dataset.shards("train")[1].path
    shard.write_bytes(shard.read_bytes()[:3000])
    assert str(shard) in cli_error(capsys, ["inspect", str(dataset.data_dir)])
    with pytest.raises(DataError, match=str(shard)):
        TrainLoader(dataset.data_dir, global_batch_size=4)


@pytest.mark.timeout(60)
def test_corrupted_shard_same_size(dataset, capsys):
    shard = dataset.shards("train")[0]
    data = bytearray(shard.path.read_bytes())
    data[1024 * 3 : 1024 * 3 + 600] = b"\x07" * 600  # a tar header and payload of sample 3
    shard.path.write_bytes(bytes(data))
    assert str(shard.path) in cli_error(capsys, ["inspect", str(dataset.data_dir)])
    loader = TrainLoader(dataset.data_dir, global_batch_size=dataset.num_samples("train"))
    with pytest.raises(DataError, match=str(shard.path)):
        next(loader)  # one batch is the whole epoch, so it reads the damaged sample
    # Raised in a DataLoader worker, it reaches the caller as the same DataError.
    loader = TrainLoader(
        dataset.data_dir, global_batch_size=dataset.num_samples("train"), num_workers=2
    )
    with pytest.raises(DataError, match=str(shard.path)):
        next(loader)
    loader.close()


@pytest.mark.timeout(60)
def test_index_disagrees_with_shards(dataset, capsys):
    index_path = dataset.index_path
    raw = json.loads(index_path.read_text())
    # A sample count that the shard does not hold.
    raw["splits"]["val"]["shards"][0]["samples"] += 1
    index_path.write_text(json.dumps(raw))
    val_shard = dataset.shards("val")[0].path
    assert str(val_shard) in cli_error(capsys, ["inspect", str(dataset.data_dir)])
    with pytest.raises(DataError, match=str(val_shard)):
        list(validation_batches(dataset.data_dir, batch_size=1))
    # A vocabulary smaller than the stored token ids.
    raw["splits"]["val"]["shards"][0]["samples"] -= 1
    raw["vocab_size"] = 300
    index_path.write_text(json.dumps(raw))
    err = cli_error(capsys, ["inspect", str(dataset.data_dir)])
    assert "outside the vocabulary" in err or "pieces" in err
    # A missing shard.
    raw["vocab_size"] = 400
    index_path.write_text(json.dumps(raw))
    dataset.shards("train")[2].path.unlink()
    assert str(dataset.shards("train")[2].path) in cli_error(
        capsys, ["inspect", str(dataset.data_dir)]
    )


@pytest.mark.timeout(60)
def test_swapped_shards(dataset, capsys):
    # Same sizes, so only the sample keys tell that the order is not the index's.
    first, second = dataset.shards("train")[0].path, dataset.shards("train")[1].path
    first_bytes = first.read_bytes()
    first.write_bytes(second.read_bytes())
    second.write_bytes(first_bytes)
    assert str(first) in cli_error(capsys, ["inspect", str(dataset.data_dir)])
    loader = TrainLoader(dataset.data_dir, global_batch_size=dataset.num_samples("train"))
    with pytest.raises(DataError, match="index and shards disagree"):
        next(loader)


@pytest.mark.timeout(60)
def test_bad_or_missing_index(dataset, capsys, tmp_path):
    index_path = dataset.index_path
    index_path.write_text("{ not json")
    assert str(index_path) in cli_error(capsys, ["inspect", str(dataset.data_dir)])
    raw = {"format": "denseformer-data", "version": 2, "seq_len": 16}
    index_path.write_text(json.dumps(raw))
    assert "vocab_size" in cli_error(capsys, ["inspect", str(dataset.data_dir)])
    index_path.unlink()
    with pytest.raises(DataError, match=str(index_path)):
        read_index(dataset.data_dir)
    assert str(tmp_path / "nowhere") in cli_error(capsys, ["inspect", str(tmp_path / "nowhere")])


@pytest.mark.timeout(60)
def test_tokenizer_hash_mismatch(dataset, capsys):
    tokenizer = dataset.tokenizer_path
    tokenizer.write_bytes(tokenizer.read_bytes() + b"\0")
    assert str(tokenizer) in cli_error(capsys, ["inspect", str(dataset.data_dir)])
    for call in (
        lambda: read_index(dataset.data_dir),
        lambda: load_tokenizer(dataset.data_dir),
        lambda: TrainLoader(dataset.data_dir, global_batch_size=2),
    ):
        with pytest.raises(DataError, match="sha256"):
            call()


@pytest.mark.timeout(60)
def test_bad_loader_arguments(dataset):
    with pytest.raises(ValueError, match="multiple of dp_size"):
        TrainLoader(dataset.data_dir, global_batch_size=6, dp_rank=0, dp_size=4)
    with pytest.raises(ValueError, match="dp_rank"):
        TrainLoader(dataset.data_dir, global_batch_size=8, dp_rank=4, dp_size=4)
    loader = TrainLoader(dataset.data_dir, global_batch_size=4, seed=1)
    with pytest.raises(ValueError, match="seed"):
        loader.load_state_dict({"samples_consumed": 8, "seed": 2})
    with pytest.raises(ValueError, match="samples_consumed"):
        loader.load_state_dict({"samples_consumed": -1, "seed": 1})


@pytest.mark.timeout(60)
def test_exit_status_through_python_m(dataset):
    shard = dataset.shards("val")[0].path
    shard.write_bytes(shard.read_bytes()[:-700])
    result = subprocess.run(
        [sys.executable, "-m", "data_pipeline", "inspect", str(dataset.data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert str(shard) in result.stderr and "Traceback" not in result.stderr
