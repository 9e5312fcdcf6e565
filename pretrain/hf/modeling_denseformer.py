"""A DenseFormer (or Transformer) exported for Hugging Face transformers.

This file is written into every export directory (`python -m pretrain export-hf`) and loaded
from there with

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

so it imports nothing but torch and transformers. It computes, in plain PyTorch, the function
of `pretrain.model.DenseFormer` in one process: X_0 = embed(tokens); X_i = block_i(Y_{i-1});
Y_i = sum_{j in S_i} alpha[i, j] X_j after the blocks that have a DWA (else Y_i = X_i);
logits = final_norm(Y_d) @ E^T (the LM head tied to the embedding). Which X_j each DWA reads
(S_i) is written into config.json (`dwa_inputs`) by the exporter, so this file needs no
knowledge of the k x p pattern. It holds every X_j for the whole sequence and keeps no KV
cache: `generate` recomputes the prefix each step (`use_cache` is false in the export).

With Attention Residuals (`model.connection: attnres`, config.json `attnres_group` S, the
sub-layers per group; docs/connections.md) each block runs as its two branches, sub-layer
l = 1..2d (2i - 1 block i's attention, 2i its MLP), v_l its branch's output alone. X_0 is the
embedding, X_l = v_l when l opens a group ((l - 1) % S == 0), else X_{l-1} + v_l; consumer
c = 1..2d + 1 (the last: the model output, before the final norm) reads X_j for j in
{0, S, 2S, ... below c} and c - 1, as

    h_c = sum_j a_{c,j} X_j,  a_{c,.} = softmax_j((w_c * g_c) . X_j / sqrt(mean(X_j^2) + eps))

with w_c = attnres_query[c - 1], g_c = attnres_key_norm[c - 1] and eps the model's norm_eps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


class DenseFormerHFConfig(PretrainedConfig):
    """The model section of the training run, as the exporter wrote it."""

    model_type = "denseformer"

    def __init__(self, vocab_size: int = 512, padded_vocab_size: int = 512,
                 hidden_size: int = 64, num_hidden_layers: int = 4, num_attention_heads: int = 4,
                 max_position_embeddings: int = 128, mlp_ratio: int = 4,
                 rope_theta: float = 10000.0, norm_eps: float = 1e-5, skip_gains: bool = False,
                 dwa_inputs: list | None = None, block: str = "gpt",
                 num_key_value_heads: int | None = None, intermediate_size: int | None = None,
                 tie_embeddings: bool = True, dwa_dtype: str = "fp32",
                 attnres_group: int | None = None, **kwargs):
        self.block = block  # "gpt" (the paper's blocks) or "llama"
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.intermediate_size = intermediate_size  # llama: the SwiGLU width
        self.tie_embeddings = tie_embeddings  # llama: False = a separate lm_head
        self.vocab_size, self.padded_vocab_size = vocab_size, padded_vocab_size
        self.hidden_size, self.num_hidden_layers = hidden_size, num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.mlp_ratio, self.rope_theta, self.norm_eps = mlp_ratio, rope_theta, norm_eps
        self.skip_gains = skip_gains
        # dwa_inputs[i - 1]: the j of the X_j that the DWA after block i reads, or None
        self.dwa_inputs = dwa_inputs or [None] * num_hidden_layers
        # "bf16": the DWAs read each X_j but their own block's rounded to bf16 (the trained
        # model's model.dwa_dtype), summing in the stream's dtype
        self.dwa_dtype = dwa_dtype
        # Attention Residuals: sub-layers per group (1: full AttnRes); None without them
        self.attnres_group = attnres_group
        # transformers' own tying stays off: a tied head reads the embedding weight directly.
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


def _rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate x (B, heads, S, head_dim) at `positions` (B, S), rotate-half convention."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                           device=x.device) / head_dim)
    angles = positions.float()[..., None] * inv_freq  # (B, S, head_dim / 2)
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * angles.cos().to(x.dtype) + rotated * angles.sin().to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: DenseFormerHFConfig):
        super().__init__()
        d = config.hidden_size
        self.heads, self.head_dim = config.num_attention_heads, d // config.num_attention_heads
        self.base = config.rope_theta
        # Output features head-major, (head, q|k|v, head_dim), as the trainer lays them out.
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None):
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, self.heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        q, k = _rope(qkv[0], positions, self.base), _rope(qkv[1], positions, self.base)
        out = F.scaled_dot_product_attention(q, k, qkv[2], attn_mask=mask, is_causal=mask is None)
        return self.proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: DenseFormerHFConfig):
        super().__init__()
        hidden = config.mlp_ratio * config.hidden_size
        self.fc_in = nn.Linear(config.hidden_size, hidden, bias=False)
        self.fc_out = nn.Linear(hidden, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class Block(nn.Module):
    """Pre-LN block (LayerNorm without bias, RoPE attention, 4x GELU MLP)."""

    def __init__(self, config: DenseFormerHFConfig):
        super().__init__()
        d, eps = config.hidden_size, config.norm_eps
        self.norm_attn = nn.LayerNorm(d, eps=eps, bias=False)
        self.attn = Attention(config)
        self.norm_mlp = nn.LayerNorm(d, eps=eps, bias=False)
        self.mlp = MLP(config)
        if config.skip_gains:
            self.skip_gain_attn = nn.Parameter(torch.ones(()))
            self.skip_gain_mlp = nn.Parameter(torch.ones(()))
        else:
            self.skip_gain_attn = self.skip_gain_mlp = None

    def attention_branch(self, x, positions, mask):
        return self.attn(self.norm_attn(x), positions, mask)

    def mlp_branch(self, h):
        return self.mlp(self.norm_mlp(h))

    def forward(self, x, positions, mask):
        skip = x if self.skip_gain_attn is None else x * self.skip_gain_attn
        h = skip + self.attn(self.norm_attn(x), positions, mask)
        skip = h if self.skip_gain_mlp is None else h * self.skip_gain_mlp
        return skip + self.mlp(self.norm_mlp(h))


class LlamaAttention(nn.Module):
    """Llama attention under transformers' weight names: q, k, v, o projections, grouped-query
    (each of the num_key_value_heads k/v heads serves heads / kv_heads query heads)."""

    def __init__(self, config: DenseFormerHFConfig):
        super().__init__()
        d, heads = config.hidden_size, config.num_attention_heads
        self.heads, self.kv_heads, self.head_dim = heads, config.num_key_value_heads, d // heads
        self.base = config.rope_theta
        self.q_proj = nn.Linear(d, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, d, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rope(q, positions, self.base), _rope(k, positions, self.base)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: DenseFormerHFConfig):
        super().__init__()
        d, hidden = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """RMSNorm, grouped-query attention with RoPE, RMSNorm, SwiGLU; no biases."""

    def __init__(self, config: DenseFormerHFConfig):
        super().__init__()
        d, eps = config.hidden_size, config.norm_eps
        self.input_layernorm = nn.RMSNorm(d, eps=eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=eps)
        self.mlp = LlamaMLP(config)

    def attention_branch(self, x, positions, mask):
        return self.self_attn(self.input_layernorm(x), positions, mask)

    def mlp_branch(self, h):
        return self.mlp(self.post_attention_layernorm(h))

    def forward(self, x, positions, mask):
        h = x + self.attention_branch(x, positions, mask)
        return h + self.mlp_branch(h)


class LlamaTrunk(nn.Module):
    """Embedding, blocks and final norm under transformers' Llama names (`model.*`)."""

    def __init__(self, config: DenseFormerHFConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaBlock(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)


class DenseFormerForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = DenseFormerHFConfig
    base_model_prefix = "denseformer"
    _no_split_modules = ["Block", "LlamaBlock"]

    def __init__(self, config: DenseFormerHFConfig):
        super().__init__(config)
        d = config.hidden_size
        if config.block == "llama":  # transformers' Llama names, plus dwa_alpha
            self.model = LlamaTrunk(config)
            self.lm_head = None if config.tie_embeddings else nn.Linear(
                d, config.padded_vocab_size, bias=False)
        else:  # the trainer's names
            self.embedding = nn.Embedding(config.padded_vocab_size, d)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
            self.final_norm = nn.LayerNorm(d, eps=config.norm_eps, bias=False)
            self.lm_head = None
        self.dwa_alpha = None
        if any(js is not None for js in config.dwa_inputs):
            self.dwa_alpha = nn.Parameter(torch.zeros(config.num_hidden_layers,
                                                      config.num_hidden_layers + 1))
        self.attnres_query = self.attnres_key_norm = None
        if config.attnres_group is not None:  # one row per consumer 1..2d + 1
            shape = (2 * config.num_hidden_layers + 1, d)
            self.attnres_query = nn.Parameter(torch.zeros(shape))
            self.attnres_key_norm = nn.Parameter(torch.ones(shape))
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """Only for weights a checkpoint lacks (an export holds them all)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def _stored(self, xs: list[torch.Tensor], j: int, i: int) -> torch.Tensor:
        """X_j as the DWA after block i reads it: its own block's live, the others as stored."""
        if self.config.dwa_dtype != "bf16" or j == i:
            return xs[j]
        return xs[j].to(torch.bfloat16).to(xs[j].dtype)

    def _trunk(self) -> tuple[nn.Embedding, nn.ModuleList, nn.Module]:
        """(embedding, blocks, final norm), under either block's names."""
        if self.config.block == "llama":
            return self.model.embed_tokens, self.model.layers, self.model.norm
        return self.embedding, self.blocks, self.final_norm

    def _dwa(self, x0: torch.Tensor, blocks: nn.ModuleList, positions: torch.Tensor,
             mask: torch.Tensor | None) -> torch.Tensor:
        """Y_d: the blocks, each followed by its DWA (if any)."""
        xs, y = [x0], x0
        for i, block in enumerate(blocks, start=1):
            xs.append(block(y, positions, mask))
            js = self.config.dwa_inputs[i - 1]
            y = xs[i] if js is None else sum(self.dwa_alpha[i - 1, j] * self._stored(xs, j, i)
                                             for j in js)
        return y

    def _attnres(self, x0: torch.Tensor, blocks: nn.ModuleList, positions: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
        """h_{2d+1}, the output mix of Attention Residuals (the module docstring)."""
        group, n_sub = self.config.attnres_group, 2 * self.config.num_hidden_layers
        queries = self.attnres_query * self.attnres_key_norm

        def mix(c: int) -> torch.Tensor:
            sources = sorted({*range(0, c, group), c - 1})
            return self._depth_mix(queries[c - 1], [xs[j] for j in sources])

        xs = [x0]
        for sub in range(1, n_sub + 1):
            block, h = blocks[(sub - 1) // 2], mix(sub)
            v = block.attention_branch(h, positions, mask) if sub % 2 else block.mlp_branch(h)
            xs.append(v if (sub - 1) % group == 0 else xs[sub - 1] + v)
        return mix(n_sub + 1)

    def _depth_mix(self, query: torch.Tensor, xs: list[torch.Tensor]) -> torch.Tensor:
        """sum_j a_j X_j, a = softmax_j(query . X_j / rms(X_j)), in fp32 at least."""
        dtype = torch.promote_types(xs[0].dtype, torch.float32)
        v = torch.stack([x.to(dtype) for x in xs])
        r = torch.rsqrt(v.square().mean(-1) + self.config.norm_eps)
        a = torch.softmax((v @ query.to(dtype)) * r, dim=0)
        return torch.einsum("n...,n...h->...h", a, v).to(xs[-1].dtype)

    def get_input_embeddings(self) -> nn.Embedding:
        return self._trunk()[0]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, **kwargs) -> CausalLMOutput:
        """Logits (B, S, vocab_size). `attention_mask` (B, S; 0 = padding, left padding as
        `generate` makes it) moves RoPE positions past the padding and hides padded keys.
        `labels`: the mean next-token loss over positions whose label is not -100."""
        b, s = input_ids.shape
        mask = None
        positions = torch.arange(s, device=input_ids.device).expand(b, s)
        if attention_mask is not None and not bool(attention_mask.all()):
            keep = attention_mask.bool()
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            causal = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).tril()
            mask = causal & keep[:, None, :]
            mask = (mask | torch.eye(s, dtype=torch.bool, device=input_ids.device))[:, None]
        embedding, blocks, final_norm = self._trunk()
        x0 = embedding(input_ids)
        if self.attnres_query is not None:
            y = self._attnres(x0, blocks, positions, mask)
        else:
            y = self._dwa(x0, blocks, positions, mask)
        head = embedding.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(final_norm(y), head)[..., :self.config.vocab_size]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                   labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)

