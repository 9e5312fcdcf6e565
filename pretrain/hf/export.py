"""`python -m pretrain export-hf (--run DIR | --checkpoint PATH) --out DIR`: a trained model
as a Hugging Face model directory.

The model comes through `pretrain.load_model` (every check it makes: tokenizer sha256,
vocabulary) and leaves as `config.json`, `generation_config.json`, `model.safetensors`
(fp32, the trainer's parameter names), `modeling_denseformer.py` (this package's
`modeling_denseformer.py`, copied verbatim: it imports only torch and transformers) and the
run's tokenizer file, so that

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

gives the same logits as the trainer's model, and `generate` and lm-eval's `hf` model work.
Beside the tokenizer (a `tokenizer.json`, or a sentencepiece `tokenizer.model`, which
transformers 5 converts on loading) the export writes `tokenizer_config.json`: no BOS added,
as in training, and EOS (also the padding token) as our tokenizer found it, so
`AutoTokenizer` gives the ids that training saw. The directory is written beside --out and
renamed into place. A MUDD model (`model.connection: mudd`) is refused (exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
from pathlib import Path

import sentencepiece as spm

from pretrain.config import ConfigError

MODELING_FILE = "modeling_denseformer.py"


def add_parser(subparsers) -> None:
    """The `export-hf` subcommand and its options."""
    parser = subparsers.add_parser(
        "export-hf", help="write a Hugging Face model directory (remote code) of a run's newest "
        "checkpoint, a checkpoint or an export")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--run", help="run directory: its newest complete checkpoint")
    where.add_argument("--checkpoint", help="a checkpoint, or a directory of `checkpoint export`")
    parser.add_argument("--out", required=True, help="directory to create (must not exist, or "
                        "be empty)")


def cmd_export_hf(args: argparse.Namespace) -> int:
    out = Path(args.out)
    path = Path(args.run or args.checkpoint)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError("--out", f"{out} exists and is not an empty directory")
    export_hf(path, out)
    print(f"wrote {out}: AutoModelForCausalLM.from_pretrained({str(out)!r}, "
          "trust_remote_code=True)")
    return 0


def hf_config(model_cfg, tokenizer):
    """The DenseFormerHFConfig of a trainer's model shape (`DenseFormerConfig`)."""
    # deferred: pulls in torch, transformers (slow to start, or optional)
    from pretrain.hf.modeling_denseformer import DenseFormerHFConfig

    pattern = model_cfg.dwa_pattern
    dwa_inputs = [list(pattern.inputs[i]) if i in pattern.inputs else None
                  for i in range(1, model_cfg.n_layers + 1)]
    special = {name: value for name, value in (("eos_token_id", tokenizer.eos_id),
                                               ("bos_token_id", tokenizer.bos_id))
               if value is not None}
    layout = model_cfg.attnres_layout  # Attention Residuals: the export needs the group size
    config = DenseFormerHFConfig(
        vocab_size=model_cfg.vocab_size, padded_vocab_size=model_cfg.padded_vocab_size,
        hidden_size=model_cfg.d_model, num_hidden_layers=model_cfg.n_layers,
        num_attention_heads=model_cfg.n_heads, max_position_embeddings=model_cfg.seq_len,
        mlp_ratio=model_cfg.mlp_ratio, rope_theta=model_cfg.rope_base,
        norm_eps=model_cfg.norm_eps, skip_gains=model_cfg.skip_gains, dwa_inputs=dwa_inputs,
        block=model_cfg.block, num_key_value_heads=model_cfg.kv_heads,
        intermediate_size=model_cfg.ffn_width, tie_embeddings=model_cfg.tie_embeddings,
        dwa_dtype=model_cfg.dwa_dtype, attnres_group=None if layout is None else layout.group,
        use_cache=False, pad_token_id=tokenizer.eos_id, **special)
    config.architectures = ["DenseFormerForCausalLM"]
    config.auto_map = {"AutoConfig": "modeling_denseformer.DenseFormerHFConfig",
                       "AutoModelForCausalLM": "modeling_denseformer.DenseFormerForCausalLM"}
    config.denseformer = dataclasses.asdict(model_cfg)  # the trainer's model section
    return config


def export_hf(path: Path, out: Path) -> Path:
    """Write the Hugging Face directory of the model at `path` (run, checkpoint or export)
    to `out`; returns `out`."""
    # deferred: pulls in torch (slow to start, or optional)
    import torch
    import torch.distributed as dist

    # deferred: pulls in sentencepiece, torch, transformers (slow to start, or optional)
    from parallel.primitives import groups
    from pretrain.hf.llama_weights import to_hf
    from pretrain.hf.modeling_denseformer import DenseFormerForCausalLM
    from pretrain.load import load_model

    ours = not dist.is_initialized()  # the 1-rank world load_model starts is ours to end
    try:
        model, tokenizer = load_model(path, device="cpu")
    finally:
        if ours:
            groups.destroy()
    cfg = model.config
    if cfg.mudd_layout is not None or cfg.hc_layout is not None:  # refused before writing
        raise ConfigError("model.connection", f"{cfg.depth_connection}: export-hf does not "
                          "support it (the exported modeling code implements the DWA and "
                          "Attention Residuals only); use the native checkpoint (`generate`, "
                          "`evaluate`)")
    state = {name: value.detach().float() for name, value in model.named_parameters()}
    if cfg.block == "llama" and cfg.depth_connection == "none" and not cfg.skip_gains:
        hf_model = llama_model(cfg, state, tokenizer)  # plain transformers, no remote code
    else:
        hf_model = DenseFormerForCausalLM(hf_config(cfg, tokenizer))
        if cfg.block == "llama":
            state = to_hf(state, cfg, trim_vocab=False)
            if cfg.tie_embeddings:
                del state["lm_head.weight"]  # the exported code reads the embedding itself
        hf_model.load_state_dict(state, strict=True)
        hf_model.generation_config.use_cache = False  # no KV cache in the exported code
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with torch.no_grad():
            hf_model.save_pretrained(tmp)
        if isinstance(hf_model, DenseFormerForCausalLM):
            shutil.copyfile(Path(__file__).with_name(MODELING_FILE), tmp / MODELING_FILE)
        shutil.copyfile(tokenizer.path, tmp / tokenizer.path.name)
        (tmp / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(tokenizer),
                                                              indent=1) + "\n")
        if out.exists():
            out.rmdir()  # empty, as cmd_export_hf checked
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def llama_model(cfg, state: dict, tokenizer):
    """A transformers LlamaForCausalLM holding a llama-block Transformer's weights."""
    # deferred: pulls in transformers (slow to start, or optional)
    from transformers import LlamaConfig, LlamaForCausalLM

    # deferred: pulls in torch (slow to start, or optional)
    from pretrain.hf.llama_weights import to_hf

    special = {name: value for name, value in (("eos_token_id", tokenizer.eos_id),
                                               ("bos_token_id", tokenizer.bos_id))
               if value is not None}
    config = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_width,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.seq_len,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_base,
        tie_word_embeddings=cfg.tie_embeddings, pad_token_id=tokenizer.eos_id, **special)
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config)
    model.load_state_dict(to_hf(state, cfg, trim_vocab=True), strict=True)
    return model


def _tokenizer_config(tokenizer) -> dict:
    """What `AutoTokenizer` needs beside the tokenizer file: for a tokenizer.json the class,
    and the special tokens our Tokenizer found (`data_pipeline.tokenizer.HF_EOS_TOKENS`, a
    sentencepiece model's own), none added."""
    config = {"add_bos_token": False, "add_eos_token": False}
    if tokenizer.path.name == "tokenizer.json":
        # deferred: pulls in tokenizers (slow to start, or optional)
        from tokenizers import Tokenizer as RustTokenizer

        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        token_text = RustTokenizer.from_file(str(tokenizer.path)).id_to_token
    else:
        token_text = spm.SentencePieceProcessor(model_file=str(tokenizer.path)).id_to_piece
    for key, token_id in (("eos_token", tokenizer.eos_id), ("bos_token", tokenizer.bos_id),
                          ("pad_token", tokenizer.eos_id)):
        if token_id is not None:
            config[key] = token_text(token_id)
    return config
