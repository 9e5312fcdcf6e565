"""What the command lines of parallel.plan, parallel.memory and parallel.memory_probe share:
--config / --set / --json / --world-size, and the run config with its vocabulary."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data_pipeline.index import read_index
from pretrain.config import ConfigError, load_config, override_argument


def config_parser(prog: str, description: str, world_size: bool = True,
                  run_dir: bool = False) -> argparse.ArgumentParser:
    """An argument parser with --config (or, if `run_dir`, --run DIR instead), --set, --json
    and (if `world_size`) --world-size."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True) if run_dir else parser
    source.add_argument("--config", required=not run_dir, help="YAML run config")
    if run_dir:
        source.add_argument("--run", metavar="DIR", help="a run directory, instead of --config")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", type=override_argument,
                        help="override a config key (repeatable)")
    if world_size:
        parser.add_argument("--world-size", type=int, default=None,
                            help="number of ranks: sets the data-parallel size and so the "
                                 "micro-batch (default tp x pp: no data parallelism)")
    parser.add_argument("--json", action="store_true", help="print only the JSON document")
    return parser


def load_run(args: argparse.Namespace, *overrides: str):
    """(run config, DenseFormerConfig) of a `config_parser` command line; `overrides` come
    after the user's. A null model.vocab_size is read from data.path/index.json. Raises
    ConfigError naming the key."""
    world_size = getattr(args, "world_size", None)
    cfg = load_config(args.config, [*args.overrides, *overrides], world_size=world_size)
    vocab = cfg.model.vocab_size or _vocab_from_data(cfg.data.path)
    if vocab is None:
        raise ConfigError("model.vocab_size", "is null and data.path has no index.json: set it "
                          "(--set model.vocab_size=N)")
    return cfg, cfg.model.with_vocab(vocab)


def note_ignored_keys(model) -> None:
    """Print the model's note on ignored DWA keys (if any) on stderr, which --json leaves
    to the document on stdout."""
    note = model.ignored_dwa_note()
    if note:
        print(note, file=sys.stderr)


def _vocab_from_data(path) -> int | None:
    if path and (Path(path) / "index.json").exists():
        return read_index(path, check_files=False).vocab_size
    return None
