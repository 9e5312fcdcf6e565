"""Hugging Face Llama weight names and layouts <-> ours (llama blocks, pretrain/model/layers.py).

| transformers | ours |
|---|---|
| model.embed_tokens.weight (V, H) | embedding.weight (V padded, H): zero rows appended |
| lm_head.weight (V, H) | lm_head.weight (V padded, H), untied heads only |
| model.norm.weight | final_norm.weight |
| model.layers.i.input_layernorm.weight | blocks.i.norm_attn.weight |
| model.layers.i.post_attention_layernorm.weight | blocks.i.norm_mlp.weight |
| model.layers.i.self_attn.{q,k,v}_proj.weight | blocks.i.attn.qkv.weight, rows grouped |
| model.layers.i.self_attn.o_proj.weight | blocks.i.attn.proj.weight |
| model.layers.i.mlp.{gate,up,down}_proj.weight | blocks.i.mlp.{gate,up,fc_out}.weight |

Our QKV rows are (key/value group g, [its n_heads / n_kv_heads query heads, its key head,
its value head], head_dim), so that a tensor-parallel shard holds whole groups; query head
j of group g is transformers' head g * (n_heads / n_kv_heads) + j, the head its `repeat_kv`
pairs with key/value head g. The exported modeling code (modeling_denseformer.py) names a
llama-block model's weights as transformers does, plus `dwa_alpha`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pretrain.hf.llama_config import ImportRefused

LAYER = {"input_layernorm.weight": "norm_attn.weight",
         "post_attention_layernorm.weight": "norm_mlp.weight",
         "self_attn.o_proj.weight": "attn.proj.weight",
         "mlp.gate_proj.weight": "mlp.gate.weight", "mlp.up_proj.weight": "mlp.up.weight",
         "mlp.down_proj.weight": "mlp.fc_out.weight"}
QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
IGNORED = ("rotary_emb.inv_freq",)  # a buffer older checkpoints carry


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], weight.shape[1])])


def from_hf(hf: dict[str, torch.Tensor], cfg, hf_dir: Path) -> dict[str, torch.Tensor]:
    """Our full state (fp32) of a Llama state dict; ImportRefused naming a missing or
    unexpected weight."""
    hf = {k: v for k, v in hf.items() if not k.endswith(IGNORED)}
    padded, kv, group, d = (cfg.padded_vocab_size, cfg.kv_heads, cfg.n_heads // cfg.kv_heads,
                            cfg.head_dim)
    taken: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise ImportRefused(hf_dir, name, "is missing from the safetensors weights")
        taken.add(name)
        return hf[name].float()

    ours = {"embedding.weight": _pad_rows(take("model.embed_tokens.weight"), padded),
            "final_norm.weight": take("model.norm.weight")}
    if not cfg.tie_embeddings:
        ours["lm_head.weight"] = _pad_rows(take("lm_head.weight"), padded)
    elif "lm_head.weight" in hf:
        taken.add("lm_head.weight")  # the tied copy transformers may save
    for i in range(cfg.n_layers):
        prefix = f"model.layers.{i}."
        for theirs, name in LAYER.items():
            ours[f"blocks.{i}.{name}"] = take(prefix + theirs)
        q, k, v = (take(prefix + name) for name in QKV)
        hidden = q.shape[1]
        qkv = torch.cat([q.view(kv, group, d, hidden), k.view(kv, 1, d, hidden),
                         v.view(kv, 1, d, hidden)], dim=1)
        ours[f"blocks.{i}.attn.qkv.weight"] = qkv.reshape(-1, hidden)
    unexpected = sorted(hf.keys() - taken)
    if unexpected:
        raise ImportRefused(hf_dir, unexpected[0], f"is not a weight of a {cfg.n_layers}-layer "
                            f"Llama ({len(unexpected)} such)")
    return ours


def to_hf(ours: dict[str, torch.Tensor], cfg, trim_vocab: bool) -> dict[str, torch.Tensor]:
    """transformers' Llama state of our llama-block state (`dwa_alpha` and the AttnRes
    weights kept as they are); the embedding and head cut to the real vocabulary if
    `trim_vocab`, else padded rows kept. A tied head is written as `lm_head.weight` too
    (transformers' LlamaForCausalLM has one)."""
    rows = cfg.vocab_size if trim_vocab else cfg.padded_vocab_size
    kv, group, d = cfg.kv_heads, cfg.n_heads // cfg.kv_heads, cfg.head_dim
    embedding = ours["embedding.weight"][:rows]
    hf = {"model.embed_tokens.weight": embedding, "model.norm.weight": ours["final_norm.weight"],
          "lm_head.weight": embedding if cfg.tie_embeddings else ours["lm_head.weight"][:rows]}
    for i in range(cfg.n_layers):
        prefix = f"model.layers.{i}."
        for theirs, name in LAYER.items():
            hf[prefix + theirs] = ours[f"blocks.{i}.{name}"]
        qkv = ours[f"blocks.{i}.attn.qkv.weight"]
        qkv = qkv.view(kv, group + 2, d, qkv.shape[1])
        q, k, v = qkv[:, :group], qkv[:, group], qkv[:, group + 1]
        for name, value in zip(QKV, (q, k, v), strict=True):
            hf[prefix + name] = value.reshape(-1, value.shape[-1]).contiguous()
    for name in ("dwa_alpha", "attnres_query", "attnres_key_norm"):  # depth connections
        if name in ours:
            hf[name] = ours[name]
    return hf
