"""`python -m pretrain import-hf HF_DIR --out DIR [--dwa KxP] [--seq-len N]`: a Hugging Face
Llama model as one of our runs, ready for `load_model` and `train.init_from`.

HF_DIR is a model directory as `save_pretrained` writes it: `config.json` (read and checked
by pretrain/hf/llama_config.py), `model.safetensors` or shards named by
`model.safetensors.index.json`, and a tokenizer (`tokenizer.json`, or a sentencepiece
`tokenizer.model`). DIR becomes a run directory: `config.yaml` whose model section builds
the same network with Llama-style blocks, the tokenizer, and `checkpoints/step-00000000`, a
checkpoint in the trainer's own format (weights, a fresh optimizer's empty state, the
fingerprint that `train.init_from` checks). With `--dwa KxP` the model is a DenseFormer whose
DWAs are the identity (alpha[i, i] = 1, every other weight 0), so it computes exactly the
Transformer's function until training moves the alphas.

Weights keep their values (fp32); the embedding gets zero rows up to the padded vocabulary
(`model.vocab_pad_multiple`), whose logits the model masks. A tokenizer with more ids than
the model's vocabulary is refused; fewer is fine (released models reserve rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
from pathlib import Path

from data_pipeline import DataError
from pretrain.checkpoint import Retention
from pretrain.config import Config, ConfigError, config_to_dict, save_config
from pretrain.hf.llama_config import ImportRefused, model_section

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
IMPORT_WARMUP_STEPS = 10  # optim.warmup_steps of the imported config.yaml


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "import-hf", help="a Hugging Face Llama directory as a run directory with one "
        "checkpoint (a Transformer, or with --dwa a DenseFormer with identity DWAs)")
    parser.add_argument("hf_dir", help="Hugging Face model directory (config.json, "
                        "safetensors weights, tokenizer)")
    parser.add_argument("--out", required=True, help="run directory to create (must not exist "
                        "or be empty)")
    parser.add_argument("--dwa", default=None, metavar="KxP",
                        help="make it a DenseFormer of dilation K and period P, e.g. 1x1, 4x5")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="context of the run (default: max_position_embeddings)")


def parse_dwa(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    k, sep, p = text.lower().partition("x")
    if not sep or not k.isdigit() or not p.isdigit() or int(k) < 1 or int(p) < 1:
        raise ConfigError("--dwa", f"must be KxP with positive integers, e.g. 4x5, got {text!r}")
    return int(k), int(p)


def cmd_import_hf(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError("--out", f"{out} exists and is not an empty directory")
    path = import_hf(Path(args.hf_dir), out, parse_dwa(args.dwa), args.seq_len)
    print(f"wrote {path}; continue training with --set train.init_from={out} (data prepared "
          f"with `prepare --tokenizer {args.hf_dir}`), or load it with load_model({str(out)!r})")
    return 0


def read_weights(hf_dir: Path) -> dict:
    """{Hugging Face name: tensor} of every safetensors file of the directory; ImportRefused
    naming a file that cannot be read (truncated, not safetensors)."""
    # deferred: pulls in safetensors (slow to start, or optional)
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = hf_dir / WEIGHTS_INDEX
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ImportRefused(index, "weight_map", f"is unreadable ({err})") from None
    elif (hf_dir / WEIGHTS).is_file():
        files = [WEIGHTS]
    else:
        raise ImportRefused(hf_dir, WEIGHTS, f"is missing (and so is {WEIGHTS_INDEX}): only "
                            "safetensors weights are read")
    state = {}
    for name in files:
        try:
            state.update(load_file(str(hf_dir / name)))
        except (OSError, SafetensorError) as err:
            raise ImportRefused(hf_dir / name, "safetensors", f"cannot be read ({err}): "
                                "truncated or not a safetensors file") from None
    return state


def check_shapes(hf: dict, model, cfg, hf_dir: Path) -> None:
    """ImportRefused naming the first weight whose shape differs from what config.json
    describes (the shape our model's weights take in transformers' layout)."""
    # deferred: pulls in torch (slow to start, or optional)
    from pretrain.hf.llama_weights import to_hf

    ours = {name: param.detach() for name, param in model.named_parameters()}
    expected = {name: tuple(t.shape) for name, t in to_hf(ours, cfg, trim_vocab=True).items()}
    for name, tensor in hf.items():
        if name in expected and tuple(tensor.shape) != expected[name]:
            raise ImportRefused(hf_dir, name, f"has shape {tuple(tensor.shape)}, but "
                                f"config.json describes {expected[name]}")


def import_hf(hf_dir: Path, out: Path, dwa: tuple[int, int] | None = None,
              seq_len: int | None = None) -> Path:
    """Write the run directory `out` of the Hugging Face model at `hf_dir`; its checkpoint."""
    # deferred: pulls in torch (slow to start, or optional)
    import torch
    import torch.distributed as dist

    # deferred: pulls in megatron-core, sentencepiece, torch (slow to start, or optional)
    from data_pipeline.tokenizer import copy_tokenizer, find_tokenizer_file, load_tokenizer
    from parallel.primitives import groups
    from pretrain.hf.llama_weights import from_hf
    from pretrain.model import DenseFormer, DenseFormerConfig
    from pretrain.model.state import load_full_model_state
    from pretrain.optim import build_optimizer
    from pretrain.run_checkpoint import save_run
    from pretrain.run_dir import fingerprint

    model_cfg = DenseFormerConfig(**model_section(hf_dir, dwa, seq_len))
    tokenizer_file = find_tokenizer_file(hf_dir)
    if tokenizer_file is None:
        raise ImportRefused(hf_dir, "tokenizer", "no tokenizer.json or tokenizer.model")
    try:
        tokenizer = load_tokenizer(tokenizer_file)
    except DataError as err:
        raise ImportRefused(tokenizer_file, "tokenizer", str(err)) from None
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ImportRefused(tokenizer_file, "vocab_size", f"the tokenizer has "
                            f"{tokenizer.vocab_size} ids, but config.json's vocab_size is "
                            f"{model_cfg.vocab_size}: ids {model_cfg.vocab_size} and up would "
                            "fall outside the model")
    cfg = dataclasses.replace(Config(), model=model_cfg)
    cfg.run.name = f"import-{hf_dir.name}"
    # Continued pretraining starts a fresh AdamW on trained weights: its first steps, before
    # the moment estimates settle, would move them the most. A warm-up in the config itself,
    # whatever train.steps the run sets (5% of a short run rounds to none).
    cfg.optim.warmup_steps = IMPORT_WARMUP_STEPS
    ours = not dist.is_initialized()
    groups.ensure_initialized(tp=1)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model = DenseFormer(model_cfg, seed=cfg.train.seed)
        weights = read_weights(hf_dir)
        check_shapes(weights, model, model_cfg, hf_dir)
        state = from_hf(weights, model_cfg, hf_dir)
        if model.dwa_alpha is not None:  # identity DWAs: the model's own initial alphas
            state["dwa_alpha"] = model.dwa_alpha.detach().clone()
        load_full_model_state(model, state)
        (tmp / "checkpoints").mkdir(parents=True)
        save_config(cfg, tmp / "config.yaml")
        copy_tokenizer(tokenizer.path, tmp)
        meta = {"step": 0, "loader": None, "mlflow_run_id": None, "layout": "tp1-pp1-dp1",
                "parallel": dataclasses.asdict(cfg.parallel), "world": 1,
                "config": cfg.run.name, "imported_from": str(hf_dir.resolve()),
                "fingerprint": fingerprint(config_to_dict(cfg)["model"], tokenizer.sha256,
                                           cfg.train.seed)}
        engine = _Weights(model, build_optimizer(model, cfg.optim))
        with torch.no_grad():
            save_run(engine, tmp / "checkpoints", 0, meta, Retention(keep=0), rank=0, world=1)
        if out.exists():
            out.rmdir()  # empty, as cmd_import_hf checked
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if ours:
            groups.destroy()
    return out / "checkpoints" / "step-00000000"


class _Weights:
    """What `save_run` asks of an engine, for a model that has not trained."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def sharded_state(self) -> dict:
        # deferred: pulls in torch (slow to start, or optional)
        from pretrain import sharded_checkpoint

        return sharded_checkpoint.local_state(self.model, self.optimizer)
