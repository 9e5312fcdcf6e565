"""Shared fixtures: a tiny tokenised dataset built once per test session."""

import os
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton DWA kernels run in Triton's interpreter, which triton reads when a
# kernel is defined: before any project module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The fast tier: `fast` marks, and the guard that fails a fast test that starts a process.
from tests.tiers import pytest_collection_modifyitems, pytest_runtest_call, pytest_runtest_setup  # noqa: F401,E501

ROOT = Path(__file__).resolve().parent.parent


def pytest_sessionstart(session):
    """Before any test runs, what starts a process on first use, which a fast-tier test may
    not do (tests/tiers.py): build (or find) and load Hyper-Connections' CPU kernels (the C
    compiler), and import matplotlib's font manager (on a fresh machine it lists the fonts
    with fc-list to build its cache)."""
    import matplotlib.font_manager  # noqa: F401

    from pretrain.model import hc_native

    hc_native.lib()


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A small dataset (demo corpus text, vocab 512, seq_len 32) written by data_pipeline."""
    from data_pipeline.demo_corpus import build_demo_corpus
    from data_pipeline.prepare import prepare_dataset

    root = tmp_path_factory.mktemp("tiny-data")
    corpus = root / "corpus.jsonl"
    build_demo_corpus(corpus, max_mb=0.3, workers=1, progress=False)
    out = root / "data"
    prepare_dataset([str(corpus)], out, vocab_size=512, seq_len=32, val_fraction=0.05,
                    workers=1, progress=False)
    return out


def cli_env() -> dict:
    """Environment for CLI subprocesses: one thread per process, repo on the path."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    return env
