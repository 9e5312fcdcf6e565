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


@pytest.mark.timeout(240)
def test_ignored_dwa_keys_get_one_note_per_run(tiny_data, tmp_path):
    """Two ranks train under AttnRes with DWA keys off their defaults: one note line, from
    the main process (keys at their defaults say nothing: tests/test_config.py)."""
    from tests.test_train import on_ranks, run, train_cmd

    note = ("note: model.dwa_dilation, model.dwa_period are ignored under "
            "model.connection=attnres")
    attnres = ["model.connection=attnres", "model.attnres_blocks=2", "train.steps=2",
               "optim.warmup_steps=1",
               "data.val_batches=0", "tracking.enabled=false", "checkpoint.every=0"]
    done = run(on_ranks(2, train_cmd(tiny_data, tmp_path / "a", *attnres, "model.dwa_period=2",
                                     "model.dwa_dilation=2")))
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line for line in done.stderr.splitlines() if "model.dwa_" in line] == [note]


@pytest.mark.parametrize("module", ["plan", "memory"])
def test_parallel_commands_note_ignored_dwa_keys_on_stderr(module, capsys):
    import importlib

    main_of = importlib.import_module(f"parallel.cli.{module}").main
    sets = ["model.vocab_size=300", "model.connection=attnres", "model.dwa_period=2"]
    assert main_of(["--config", "configs/tiny.yaml", "--json",
                    *[a for s in sets for a in ("--set", s)]]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == ["note: model.dwa_period is ignored under "
                                "model.connection=attnres"]
    assert out.startswith("{")  # the JSON document alone


@pytest.mark.parametrize("setting,key", [("model.connection=attn", "model.connection"),
                                         ("model.attnres_blocks=5", "model.attnres_blocks")])
@pytest.mark.parametrize("command", ["train", "config"])
def test_bad_connection_settings_exit_2_naming_the_key(command, setting, key, tmp_path,
                                                       capsys):
    err = failed(capsys, command, "--config", str(ROOT / "configs/tiny.yaml"), "--set",
                 "model.connection=attnres", "--set", setting, "--set",
                 f"run.dir={tmp_path / 'run'}")
    assert err.splitlines()[0].startswith(f"error: {key}: "), err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("settings,key", [
    (("model.mudd_streams=qk",), "model.mudd_streams"),
    (("model.mudd_dynamic=maybe",), "model.mudd_dynamic"),
    (("train.compile=model",), "train.compile")])
def test_bad_mudd_settings_exit_2_naming_the_key(settings, key, tmp_path, capsys):
    sets = [a for s in ("model.connection=mudd", *settings) for a in ("--set", s)]
    err = failed(capsys, "config", "--config", str(ROOT / "configs/tiny.yaml"), *sets,
                 "--set", f"run.dir={tmp_path / 'run'}")
    assert err.splitlines()[0].startswith(f"error: {key}: "), err
    assert "mudd" in err.splitlines()[0]
