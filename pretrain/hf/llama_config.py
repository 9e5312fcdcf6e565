"""What a Hugging Face Llama `config.json` says, as our model section, or why it cannot be.

`model_section(hf_dir, dwa)` reads `config.json` (transformers 4.x and 5.x spellings: RoPE
base as `rope_theta` or `rope_parameters.rope_theta`) and returns the `model` keys of a run
config that builds the same network with Llama-style blocks (`model.block: llama`). Every
option we do not implement is refused by name (`ImportRefused`, exit 2 in the CLI): another
architecture, a RoPE scaling type, attention or MLP biases, an activation other than SiLU,
a head size other than hidden / heads, tensor-parallel pretraining slices.
"""

from __future__ import annotations

import json
from pathlib import Path

from pretrain.config import ConfigError

ARCHITECTURES = ("LlamaForCausalLM",)


class ImportRefused(ConfigError):
    """A Hugging Face directory we cannot import exactly; names the file and the key."""

    def __init__(self, path: Path, key: str | None, message: str):
        """`key` None: the file itself is the problem (`path` names it, once)."""
        super().__init__(str(path) if key is None else f"{path}: {key}", message)


def read_config(hf_dir: Path) -> tuple[Path, dict]:
    path = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():
        raise ImportRefused(Path(hf_dir), None, "is not a directory")
    try:
        return path, json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ImportRefused(path, None, "is missing: not a Hugging Face model "
                            "directory") from None
    except ValueError as err:
        raise ImportRefused(path, None, f"is not JSON ({err})") from None


def _rope_base(path: Path, hf: dict) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    kind = params.get("rope_type") or (scaling or {}).get("rope_type") or (
        scaling or {}).get("type") or "default"
    if kind != "default":
        key = "rope_parameters.rope_type" if params else "rope_scaling"
        raise ImportRefused(path, key, f"is {kind!r}; only plain RoPE (default) is implemented")
    base = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    return float(base)


def model_section(hf_dir: Path, dwa: tuple[int, int] | None = None,
                  seq_len: int | None = None) -> dict:
    """The `model` keys of the imported network (a DenseFormer with identity DWAs of
    dilation x period `dwa`, else a Transformer); `seq_len` caps max_position_embeddings."""
    path, hf = read_config(hf_dir)
    architectures = hf.get("architectures") or [hf.get("model_type")]
    if not any(a in ARCHITECTURES for a in architectures):
        raise ImportRefused(path, "architectures", f"is {architectures}; only "
                            f"{', '.join(ARCHITECTURES)} is implemented")
    refused = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
               "pretraining_tp": 1}
    for key, supported in refused.items():
        if hf.get(key, supported) != supported:
            raise ImportRefused(path, key, f"is {hf[key]!r}; only {supported!r} is implemented")
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    if hf.get("head_dim") not in (None, hidden // heads):
        raise ImportRefused(path, "head_dim", f"is {hf['head_dim']}, not hidden_size / "
                            f"num_attention_heads = {hidden // heads}")
    positions = int(hf.get("max_position_embeddings", 2048))
    section = {
        "block": "llama",
        "n_layers": int(hf["num_hidden_layers"]),
        "d_model": hidden,
        "n_heads": heads,
        "n_kv_heads": int(hf.get("num_key_value_heads") or heads),
        "ffn_hidden_size": int(hf["intermediate_size"]),
        "vocab_size": int(hf["vocab_size"]),
        "seq_len": min(positions, seq_len) if seq_len else positions,
        "rope_base": _rope_base(path, hf),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "dropout": 0.0,
        "dwa": dwa is not None,
    }
    if dwa is not None:
        section.update(dwa_dilation=dwa[0], dwa_period=dwa[1], dwa_init_offdiag=0.0)
    return section
