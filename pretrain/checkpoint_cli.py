"""`python -m pretrain checkpoint inspect|export` (command-line code: it reads the run config
of a checkpoint): tools for a checkpoint on disk."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from safetensors.torch import save_file

from pretrain import checkpoint, sharded_checkpoint
from pretrain.config import ConfigError, load_config, save_config


def _run_config(path: Path):
    """The config of the run that wrote checkpoint `path` (run_dir/checkpoints/step-*), its
    vocabulary resolved."""
    run_dir = path.resolve().parent.parent
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError("path", f"{run_dir / 'config.yaml'} is missing: export needs the "
                          "config of the run that wrote the checkpoint")
    return load_config(run_dir / "config.yaml", [f"run.dir={run_dir}"])


def run_tool(tool: str, path: Path, verify: bool, out: Path | None) -> int:
    """`checkpoint inspect|export`; the exit status."""
    if not path.is_dir():
        raise checkpoint.CheckpointError(f"{path} is not a checkpoint directory")
    verify = tool == "export" or verify
    manifest = checkpoint.read_manifest(path, verify_hashes=verify)
    if tool == "inspect":
        return _inspect(path, manifest, verify)
    return _export(path, manifest, out)


def _inspect(path: Path, manifest: dict, verified: bool) -> int:
    meta = checkpoint.read_meta(path, manifest=manifest)
    files = manifest["files"]
    total = sum(f["bytes"] for f in files.values())
    print(f"checkpoint {path}: step {meta.get('step')}, format {manifest.get('format', 1)}, "
          f"written at layout {meta.get('layout', 'unknown')} ({meta.get('world', '?')} ranks)")
    print(f"files: {len(files)}, {total:,} bytes; largest: " + ", ".join(
        f"{rel} {info['bytes']:,}" for rel, info in sorted(
            files.items(), key=lambda item: -item[1]["bytes"])[:4]))
    entries = sharded_checkpoint.tensor_entries(sharded_checkpoint.read_metadata(
        path, manifest))
    for key, md in sorted(entries.items()):
        print(f"  {key}: {tuple(md.size)} {str(md.properties.dtype).removeprefix('torch.')}"
              f", {md.size.numel() * md.properties.dtype.itemsize:,} bytes in "
              f"{len(md.chunks)} shard(s)")
    print("intact: sizes and sha256 of every file match the manifest" if verified else
          "intact: every file has its size (add --verify to check every sha256)")
    return 0


def _export(path: Path, manifest: dict, out: Path) -> int:
    # deferred: pulls in sentencepiece (slow to start, or optional)
    from data_pipeline.tokenizer import copy_tokenizer
    from pretrain.load import run_tokenizer

    meta = checkpoint.read_meta(path, manifest=manifest)
    cfg = _run_config(path)
    tokenizer = run_tokenizer(path.resolve().parent.parent, cfg)  # the run's copy, or the data's
    trained_with = meta.get("fingerprint", {}).get("tokenizer_sha256", tokenizer.sha256)
    if trained_with != tokenizer.sha256:
        raise checkpoint.CheckpointError(
            f"{path} was trained with the tokenizer of sha256 {trained_with}, but "
            f"{tokenizer.path} has {tokenizer.sha256}")
    model_state, _ = sharded_checkpoint.read_full(path, manifest, optimizer=False)
    out.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in model_state.items()},
              out / "model.safetensors", metadata={"step": str(meta["step"])})
    save_config(dataclasses.replace(cfg, model=cfg.model.with_vocab(tokenizer.vocab_size)),
                out / "config.yaml")
    copied = copy_tokenizer(tokenizer.path, out, tokenizer.sha256, replace=True)
    print(f"exported step {meta['step']} of {path}: {out / 'model.safetensors'} "
          f"({len(model_state)} tensors), {out / 'config.yaml'}, {copied}")
    return 0

