"""What the command line says on a mistake: one line naming the cause, and a last line that
fits the command (only `train` trains)."""

from __future__ import annotations

import pytest

from pretrain.cli import main
from tests.conftest import ROOT


def failed(capsys, *argv: str) -> str:
    """Run the CLI in-process; assert exit status 2; its stderr."""
    assert main(list(argv)) == 2
    return capsys.readouterr().err


def test_each_command_ends_with_its_own_reason(tmp_path, capsys):
    missing = str(tmp_path / "no-run")
    err = failed(capsys, "generate", "--run", missing, "--prompt", "x")
    assert err.splitlines()[-1] == ("exit status 2: bad prompt, option, model or tokenizer; "
                                    "nothing was generated"), err
    err = failed(capsys, "eval", "--run", missing)
    assert err.splitlines()[-1].endswith("nothing was evaluated"), err
    err = failed(capsys, "export-hf", "--run", missing, "--out", str(tmp_path / "hf"))
    assert err.splitlines()[-1].endswith("nothing was written"), err
    err = failed(capsys, "train", "--config", str(ROOT / "configs/tiny.yaml"), "--set",
                 f"data.path={missing}")
    assert err.splitlines()[-1].endswith("nothing more was trained"), err


def test_import_hf_of_a_dataset_names_the_file_once(tmp_path, capsys):
    (tmp_path / "index.json").write_text("{}")  # a prepared dataset, not a model directory
    err = failed(capsys, "import-hf", str(tmp_path), "--out", str(tmp_path / "run"))
    assert err.splitlines()[0] == (f"error: {tmp_path / 'config.json'}: is missing: not a "
                                   "Hugging Face model directory"), err
    assert "trained" not in err and err.splitlines()[-1].endswith("nothing was written")
    err = failed(capsys, "import-hf", str(tmp_path / "nope"), "--out", str(tmp_path / "run"))
    assert err.splitlines()[0] == f"error: {tmp_path / 'nope'}: is not a directory", err


@pytest.mark.parametrize("argv", [
    ["train", "--config", "configs/tiny.yaml", "--set", "train.steps", "50"],
    ["config", "--config", "configs/tiny.yaml", "--set", "train.steps"],
])
def test_set_without_equals_says_key_value(argv, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "argument --set: 'train.steps' is not KEY=VALUE: write --set train.steps=VALUE" \
        in err, err
    assert "unrecognized arguments" not in err


def test_a_missing_dataset_names_the_command_that_makes_one(tmp_path, capsys):
    missing = tmp_path / "data"
    err = failed(capsys, "train", "--config", str(ROOT / "configs/tiny.yaml"), "--set",
                 f"data.path={missing}", "--set", f"run.dir={tmp_path / 'run'}")
    assert err.splitlines()[0] == (f"error: {missing}: not a directory (expected a prepared "
                                   f"dataset): `python -m data_pipeline prepare --input FILES "
                                   f"--out {missing}` makes one"), err
