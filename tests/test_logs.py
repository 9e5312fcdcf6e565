"""Logs for people and for log files: a progress bar on a terminal, plain lines elsewhere.

Under Slurm stderr is a file; a tqdm bar there is a stream of carriage-return frames. The
runs below send stderr to a file, as Slurm does, and read it back; the helper itself is
checked on a real terminal (a pseudo-terminal from `pty.openpty`).
"""

from __future__ import annotations

import fcntl
import io
import os
import pty
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from data_fixtures import make_documents, write_jsonl
from tqdm import tqdm

from data_pipeline.progress import LineProgress, progress_bar, write_line
from tests.conftest import ROOT, cli_env

TINY = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=32",
        "model.dwa_dilation=1", "model.dwa_period=1", "train.batch_size=8",
        "optim.warmup_steps=2", "data.val_batches=2", "train.steps=6", "train.log_every=3",
        "train.eval_every=3", "checkpoint.every=0", "tracking.enabled=false"]


def run_with_stderr_to_file(cmd: list[str], log: Path, timeout: float) -> str:
    """Run `cmd` with stderr going to the file `log` (as under Slurm); the log's text, read
    without newline translation (which would turn a carriage return into a newline)."""
    with open(log, "wb") as stderr:
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=stderr, env=cli_env(),
                              cwd=ROOT, timeout=timeout)
    text = log.read_bytes().decode()
    assert done.returncode == 0, text[-3000:]
    return text


@pytest.mark.timeout(300)
def test_training_log_file_has_step_lines_and_no_bar_frames(tiny_data, tmp_path):
    sets = [*TINY, f"data.path={tiny_data}", f"run.dir={tmp_path / 'run'}"]
    cmd = [sys.executable, "-m", "pretrain", "train", "--config",
           str(ROOT / "configs/tiny.yaml"), *[a for s in sets for a in ("--set", s)]]
    log = run_with_stderr_to_file(cmd, tmp_path / "train.log", timeout=240)
    assert "\r" not in log, f"carriage returns in the log file:\n{log[-2000:]!r}"
    for step in (3, 6):
        assert f"step {step}/6 loss " in log, log[-2000:]
        assert f"step {step} validation: loss " in log, log[-2000:]
    assert "done: step 6" in log


@pytest.mark.timeout(120)
def test_prepare_log_file_has_plain_lines_and_no_bar_frames(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", make_documents())
    cmd = [sys.executable, "-m", "data_pipeline", "prepare", "--input", str(corpus), "--out",
           str(tmp_path / "ds"), "--vocab-size", "400", "--seq-len", "16", "--workers", "1"]
    log = run_with_stderr_to_file(cmd, tmp_path / "prepare.log", timeout=110)
    assert "\r" not in log, f"carriage returns in the log file:\n{log[-2000:]!r}"
    # Each phase ends with one plain line of its counts.
    assert "scan: 1/1 " in log and "tokenizer: 1/1 " in log and "tokenize: " in log, log


def read_terminal(master: int) -> bytes:
    """Everything written to the terminal so far (the pty's other end)."""
    out = b""
    while select.select([master], [], [], 0.2)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the terminal side is closed
            break
        if not chunk:
            break
        out += chunk
    return out


def test_bar_on_a_terminal_plain_lines_elsewhere(tmp_path):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # 80 columns
    terminal = os.fdopen(slave, "w")
    try:
        assert terminal.isatty()
        bar = progress_bar(total=4, desc="work", unit="item", file=terminal)
        assert isinstance(bar, tqdm) and not bar.disable
        for _ in range(4):
            bar.update(1)
        bar.close()
        terminal.flush()
        drawn = read_terminal(master)
        # Redrawn in place: each frame starts with a carriage return (the terminal's own
        # "\r\n" for a newline would not show this).
        assert b"\rwork:" in drawn and b"4/4" in drawn, drawn
        silent = progress_bar(False, total=4, desc="off", file=terminal, log_interval_s=0)
        silent.update(4)
        silent.close()
        terminal.flush()
        assert b"off" not in read_terminal(master)  # disabled: nothing drawn
    finally:
        terminal.close()
        os.close(master)

    with open(tmp_path / "log", "w+", newline="") as log_file:  # "\r" read back as is
        lines = progress_bar(total=3, desc="work", unit="item", file=log_file, log_interval_s=0)
        assert isinstance(lines, LineProgress)
        for _ in range(3):
            lines.update(1)
        lines.set_postfix(loss="1.5")
        lines.close()
        write_line("a plain line", file=log_file)
        log_file.seek(0)
        text = log_file.read()
    assert "\r" not in text
    assert text.splitlines() == [line for line in text.splitlines() if line]  # no blank lines
    assert [line.split(" [")[0] for line in text.splitlines()] == [
        "work: 1/3", "work: 2/3", "work: 3/3", "a plain line"]


def test_without_an_interval_a_log_gets_only_the_callers_lines():
    """The trainer's case: its own "step N/M" lines are the log; the bar prints nothing."""
    log_file = io.StringIO()
    lines = progress_bar(total=10, desc="train", unit="step", file=log_file)
    for _ in range(10):
        lines.update(1)
    lines.close()
    assert log_file.getvalue() == ""
