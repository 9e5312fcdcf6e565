"""`load_model(path)`: a trained model and its tokenizer, ready for inference.

    model, tokenizer = load_model("runs/tiny")          # its newest complete checkpoint
    model, tokenizer = load_model("runs/tiny/checkpoints/step-00000100")
    model, tokenizer = load_model("exported/")          # `python -m pretrain checkpoint export`

In a plain Python session the model lives in a 1-rank world (made on the fly); under torchrun
every rank holds its tensor-parallel share (TP = the world size unless the parallel state
already exists). The tokenizer is the one the run trained with: the copy in the run or export
directory, else the one the run's data index names (checked against its sha256).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file

from data_pipeline import DataError
from data_pipeline.index import read_index
from data_pipeline.tokenizer import Tokenizer, find_tokenizer_file, load_tokenizer
from parallel.primitives import groups
from pretrain import checkpoint, sharded_checkpoint
from pretrain.config import Config, ConfigError, load_config
from pretrain.model.config import DenseFormerConfig
from pretrain.model.denseformer import DenseFormer
from pretrain.model.state import load_full_model_state

EXPORTED_WEIGHTS = "model.safetensors"
CONFIG_FILE = "config.yaml"


def model_config(cfg: Config, vocab_size: int) -> DenseFormerConfig:
    """The model shape of a loaded run config, its vocabulary filled in."""
    return cfg.model.with_vocab(vocab_size)


def load_model(path: str | Path, device: str | torch.device | None = None
               ) -> tuple[torch.nn.Module, Tokenizer]:
    """(model in eval mode on `device` (default: this rank's GPU, else the CPU), tokenizer)
    from a run directory, a native checkpoint or an exported directory."""
    cfg, state, meta, tokenizer = read_trained(Path(path))
    vocab = cfg.model.vocab_size if cfg.model.vocab_size is not None else tokenizer.vocab_size
    if vocab < tokenizer.vocab_size:  # a larger model vocabulary is fine (reserved rows)
        raise checkpoint.CheckpointError(
            f"{path}: the model has a vocabulary of {vocab} but its tokenizer "
            f"{tokenizer.path} has {tokenizer.vocab_size} ids")
    expected = meta.get("fingerprint", {}).get("tokenizer_sha256")
    if expected is not None and expected != tokenizer.sha256:
        raise checkpoint.CheckpointError(
            f"{path}: trained with the tokenizer of sha256 {expected}, but {tokenizer.path} "
            f"has {tokenizer.sha256}")
    shape = model_config(cfg, vocab)
    _initialize_groups(shape)
    model = DenseFormer(shape)
    try:
        load_full_model_state(model, state)
    except (KeyError, ValueError) as err:  # a tensor missing, or of another shape
        raise checkpoint.CheckpointError(f"{path}: its weights do not fit the model its "
                                         f"{CONFIG_FILE} describes: {err}") from None
    model.to(torch.device(device) if device is not None else groups.default_device())
    return model.eval(), tokenizer


def _initialize_groups(shape: DenseFormerConfig) -> None:
    """A 1-rank world in a plain session; under torchrun, TP over every rank."""
    tp = None
    if not dist.is_initialized():
        tp = int(os.environ.get("WORLD_SIZE", 1))
        if shape.n_heads % tp or shape.padded_vocab_size % tp:
            raise ConfigError("WORLD_SIZE", f"{tp} ranks cannot split the model's "
                              f"{shape.n_heads} heads and {shape.padded_vocab_size} vocabulary "
                              "rows evenly (generation runs every rank as one TP group)")
    groups.ensure_initialized(tp=tp)


def read_trained(path: Path) -> tuple[Config, dict, dict, Tokenizer]:
    """(config, full model tensors, checkpoint meta, tokenizer) of whatever `path` is."""
    if (path / EXPORTED_WEIGHTS).is_file():
        return _read_exported(path)
    if (path / checkpoint.MANIFEST).is_file():
        return _read_native(path, path.resolve().parent.parent)
    if (path / "checkpoints").is_dir():
        latest = checkpoint.newest_intact(path / "checkpoints")
        if latest is None:
            raise checkpoint.CheckpointError(f"{path}: no complete checkpoint under "
                                             f"{path / 'checkpoints'}")
        return _read_native(latest, path.resolve(), verified=True)
    raise checkpoint.CheckpointError(
        f"{path}: neither a run directory (with checkpoints/), a checkpoint (with "
        f"{checkpoint.MANIFEST}) nor an exported directory (with {EXPORTED_WEIGHTS})")


def _read_exported(path: Path) -> tuple[Config, dict, dict, Tokenizer]:
    tokenizer_file = find_tokenizer_file(path)
    if tokenizer_file is None:
        raise checkpoint.CheckpointError(
            f"{path}: exported directory without a tokenizer file (tokenizer.model or "
            "tokenizer.json); export it again with `python -m pretrain checkpoint export`")
    cfg = _config(path / CONFIG_FILE)
    try:
        state = load_file(path / EXPORTED_WEIGHTS)
    except (OSError, SafetensorError) as error:
        raise checkpoint.CheckpointError(f"{path / EXPORTED_WEIGHTS}: cannot be read "
                                         f"({error})") from error
    return cfg, state, {}, load_tokenizer(tokenizer_file)


def _read_native(path: Path, run_dir: Path, verified: bool = False
                 ) -> tuple[Config, dict, dict, Tokenizer]:
    """The same of a native checkpoint (`verified`: its hashes were just checked)."""
    cfg = _config(run_dir / CONFIG_FILE, [f"run.dir={run_dir}"])
    tokenizer = run_tokenizer(run_dir, cfg)
    loaded = sharded_checkpoint.read_checkpoint(path, optimizer=False,
                                                verify_hashes=not verified)
    return cfg, loaded["model"], loaded["meta"], tokenizer


def run_tokenizer(run_dir: Path, cfg: Config) -> Tokenizer:
    """The run directory's copy of its tokenizer, else its data index's (sha256 checked)."""
    copy = find_tokenizer_file(run_dir)
    if copy is not None:
        return load_tokenizer(copy)
    if cfg.data.path is not None:
        try:
            index = read_index(cfg.data.path, check_files=False)
        except DataError as error:
            raise checkpoint.CheckpointError(
                f"{run_dir}: holds no tokenizer file and its data.path has no readable index "
                f"({error})") from error
        return load_tokenizer(index.tokenizer_path, index.tokenizer_sha256)
    raise checkpoint.CheckpointError(
        f"{run_dir}: holds no tokenizer file (tokenizer.model) and its config has no "
        "data.path to find one")


def _config(path: Path, overrides: list[str] | None = None) -> Config:
    if not path.is_file():
        raise checkpoint.CheckpointError(f"{path} is missing: the model's shape is in it")
    # Generation needs the model section only: the training checks do not apply.
    return load_config(path, overrides or [], check=False)
