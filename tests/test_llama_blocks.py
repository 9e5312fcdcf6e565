"""Llama-style blocks (`model.block: llama`): the DWA is unchanged, the parameter count is
the hand count, and what TP cannot split is refused by name. Equivalence across layouts is in
tests/test_tensor_parallel.py (TP = 2 and 4, with and without SP, grouped-query attention
with an untied head), tests/test_hf_import.py (against transformers' Llama, at TP = 2 and
PP = 2) and tests/test_zero.py (ZeRO-1 and ZeRO-3, slow)."""

from __future__ import annotations

import pytest
import torch

LLAMA = dict(block="llama", n_layers=3, d_model=64, n_heads=4, n_kv_heads=2, vocab_size=300,
             seq_len=16, tie_embeddings=False)


def test_identity_alpha_denseformer_equals_the_llama_transformer_bitwise():
    from pretrain.model import DenseFormer, DenseFormerConfig

    transformer = DenseFormer(DenseFormerConfig(**LLAMA, dwa=False), seed=3)
    dense = DenseFormer(DenseFormerConfig(**LLAMA, dwa_dilation=1, dwa_period=1), seed=3)
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(dense(tokens), transformer(tokens))


def test_parameter_count_equals_a_hand_count():
    from pretrain.model import DenseFormer, DenseFormerConfig

    cfg = DenseFormerConfig(**LLAMA, dwa_dilation=1, dwa_period=1)
    h, kv_width, ffn, vocab = 64, 2 * 16, 256, 384  # 8/3 x 64 = 170 -> 256; 300 -> 384 rows
    assert cfg.ffn_width == ffn and cfg.padded_vocab_size == vocab
    per_block = h * (h + 2 * kv_width) + h * h + 3 * h * ffn + 2 * h  # qkv, o, SwiGLU, norms
    alphas = sum(i + 1 for i in range(1, 4))  # 1x1: block i reads X_0..X_i
    expected = 3 * per_block + h + alphas + 2 * vocab * h  # final norm; untied head
    assert cfg.num_params() == DenseFormer(cfg).num_params() == expected


@pytest.mark.parametrize("overrides, key, message", [
    (["model.n_kv_heads=3"], "model.n_kv_heads", "3 key/value heads do not divide n_heads=4"),
    (["model.n_kv_heads=2", "parallel.tp=4"], "parallel.tp", "does not divide the 2 key/value"),
    (["model.block=mamba"], "model.block", "mamba"),
])
def test_bad_llama_configs_are_refused_naming_the_key(overrides, key, message):
    from pretrain.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, ["model.vocab_size=300", "model.n_heads=4", "model.d_model=64",
                           *overrides], world_size=4)
    assert err.value.key == key


@pytest.mark.parametrize("fields,expected", [
    # Llama 2 7B: 4096 wide, 32 heads, SwiGLU width 11008 (8/3 x 4096 rounded up to 256).
    (dict(n_layers=32, d_model=4096, n_heads=32, vocab_size=32000), 6_738_415_616),
    # Llama 3 8B: grouped-query attention with 8 key/value heads, its own SwiGLU width.
    (dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, vocab_size=128256,
          ffn_hidden_size=14336), 8_030_261_248)])
def test_published_llama_parameter_counts(fields, expected):
    """The counts Meta publishes (and transformers' LlamaForCausalLM gives) for these shapes."""
    from pretrain.model import DenseFormerConfig

    cfg = DenseFormerConfig(block="llama", tie_embeddings=False, dwa=False,
                            vocab_pad_multiple=1, **fields)
    assert cfg.num_params() == expected
    assert cfg.ffn_width == fields.get("ffn_hidden_size", 11008)
