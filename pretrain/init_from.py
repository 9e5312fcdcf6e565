"""`train.init_from`: a new run that starts from another run's model weights.

Only the weights are read (each rank its own slices, any layout to any layout); the optimizer
is fresh, the step is 0, and the run is a new MLflow run tagged with its origin
(`init_from`, `init_from_step`). A run that resumes from its own checkpoint ignores
`init_from`: its checkpoint already holds what it started from.

The checkpoint's model must be this run's model, except for the keys of `MAY_DIFFER` (a
longer context, other regularisation or initialisation). A Transformer checkpoint can start
a DenseFormer: its DWAs start as the identity (alpha[i, i] = 1, 0 elsewhere), so the first
step computes exactly the Transformer. A DenseFormer checkpoint with another k x p, or a
DenseFormer continued as a Transformer, is refused, naming the keys.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from pretrain import checkpoint
from pretrain.config import ConfigError
from pretrain.run_dir import (
    NOT_FINGERPRINTED,
    agreed_on_rank0,
    fingerprint_mismatch,
    first_intact,
    saved_model_section,
)

MAY_DIFFER = ("seq_len", "rope_base", "dropout", "init_std", "dwa_init_offdiag", "dwa_impl")
DWA_KEYS = ("dwa", "dwa_dilation", "dwa_period", "dwa_window")


def model_mismatch(saved: dict, current: dict) -> list[str]:
    """The model keys on which a checkpoint's model section `saved` cannot start a run of
    model section `current`, as 'model.key: saved in the checkpoint, current now'."""
    saved, ignored = saved_model_section(saved), set(MAY_DIFFER) | set(NOT_FINGERPRINTED)
    if saved.get("dwa") is False and current.get("dwa") is True:
        ignored |= set(DWA_KEYS)  # a Transformer grows DWAs: its own k x p mean nothing
    keep = lambda section: {k: v for k, v in section.items() if k not in ignored}  # noqa: E731
    return [f"model.{line}" for line in fingerprint_mismatch(keep(saved), keep(current))]


def _checkpoint_of(path: Path) -> Path:
    """The checkpoint `path` names: itself, or a run directory's newest complete one."""
    if (path / checkpoint.MANIFEST).is_file():
        return path
    latest = checkpoint.latest_checkpoint(path / "checkpoints")
    if latest is None:
        raise ConfigError("train.init_from", f"{path} is neither a checkpoint (with "
                          f"{checkpoint.MANIFEST}) nor a run directory with a complete one")
    return latest


def _check(path: Path, fingerprint: dict) -> dict:
    """The checkpoint's meta, after checking that its model can start this run."""
    meta = checkpoint.read_meta(path, verify_hashes=False)
    saved = meta.get("fingerprint")
    if saved is None:
        raise ConfigError("train.init_from", f"{path} records no model config (written before "
                          "checkpoints carried fingerprints): cannot check it fits this run")
    differ = model_mismatch(saved["model"], fingerprint["model"])
    if saved["tokenizer_sha256"] != fingerprint["tokenizer_sha256"]:
        differ.append(f"tokenizer sha256: {saved['tokenizer_sha256'][:12]}... in the "
                      f"checkpoint, {fingerprint['tokenizer_sha256'][:12]}... now (data.path)")
    if differ:
        raise ConfigError("train.init_from", f"{path} cannot start this run; these differ: "
                          + "; ".join(differ))
    return meta


def identity_alpha(model_cfg) -> torch.Tensor:
    """The DWA weights that make a DenseFormer compute its Transformer: 1 on X_i, 0 else."""
    shape = dataclasses.replace(model_cfg, dwa_init_offdiag=0.0)
    return torch.tensor(shape.dwa_pattern.initial_alpha())


def init_from(engine, source: str, model_cfg, fingerprint: dict, rank: int, world: int
              ) -> dict[str, str]:
    """Load the weights of checkpoint (or run directory) `source` into `engine` (collective:
    every rank calls it, and all get the same result or error); the MLflow tags of the
    origin."""
    def choose() -> tuple[str, dict]:
        path = _checkpoint_of(Path(source))
        return str(path), _check(path, fingerprint)

    chosen, meta = agreed_on_rank0(choose, rank == 0, world)
    path = first_intact([chosen], chosen, Path(chosen).parent, rank, world)  # hashes shared
    fill = {"dwa_alpha": identity_alpha(model_cfg)} if model_cfg.has_dwa else {}
    engine.load_weights(path, checkpoint.read_manifest(path), fill=fill)
    return {"init_from": str(path.resolve()), "init_from_step": str(meta["step"])}
