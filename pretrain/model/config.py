"""DenseFormerConfig: the shape of a DenseFormer (or Transformer) language model.

Index conventions (DESIGN.md section 2), used everywhere in `pretrain.model`:
blocks are numbered 1..d; X_0 is the embedding output; block i maps Y_{i-1} to X_i; the DWA
after block i (if any) produces Y_i = sum_{j in S_i} alpha[i, j] X_j. `model.blocks[i - 1]` is
block i and row i - 1 of the (d, d + 1) alpha matrix is the DWA after block i.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class ModelConfigError(ValueError):
    """A model field holds an invalid value; `key` names the field."""

    def __init__(self, key: str, message: str):
        super().__init__(f"model.{key}: {message}")
        self.key = key


@dataclass
class DenseFormerConfig:
    n_layers: int = 4
    d_model: int = 64
    n_heads: int = 4
    vocab_size: int = 256
    seq_len: int = 128
    # Depth weighted averages: dilation k, period p ("k x p"); dwa=False is a plain Transformer.
    dwa: bool = True
    dwa_dilation: int = 1
    dwa_period: int = 1
    # Last-K baseline: a DWA reads only X_j with j > i - dwa_window (None: all of S_i).
    dwa_window: int | None = None
    # Initial alpha off the diagonal (connect-to-last uses 1e-4; DenseFormer 0, so that the
    # model equals a Transformer at init).
    dwa_init_offdiag: float = 0.0
    # Skips-with-gains baseline: a learned scalar gain on each residual connection.
    skip_gains: bool = False
    mlp_ratio: int = 4
    dropout: float = 0.0
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # The embedding/LM-head rows are padded to this multiple, independent of TP, so that
    # every layout shares one padded vocabulary; padded ids are never predicted.
    vocab_pad_multiple: int = 128

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ModelConfigError naming the first field with an invalid value."""
        for key in ("n_layers", "d_model", "n_heads", "vocab_size", "seq_len", "mlp_ratio",
                    "dwa_dilation", "dwa_period", "vocab_pad_multiple"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelConfigError(key, f"must be an integer >= 1, got {value!r}")
        if self.d_model % self.n_heads:
            raise ModelConfigError(
                "n_heads", f"{self.n_heads} heads do not divide d_model={self.d_model}")
        if (self.d_model // self.n_heads) % 2:
            raise ModelConfigError(
                "n_heads", f"head size {self.d_model // self.n_heads} must be even for RoPE")
        if self.dwa_window is not None and (
                not isinstance(self.dwa_window, int) or self.dwa_window < 1):
            raise ModelConfigError("dwa_window", f"must be null or >= 1, got {self.dwa_window!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ModelConfigError("dropout", f"must be in [0, 1), got {self.dropout!r}")
        if self.dwa and self.skip_gains:
            raise ModelConfigError("skip_gains", "is a Transformer baseline: set dwa=false")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def padded_vocab_size(self) -> int:
        m = self.vocab_pad_multiple
        return math.ceil(self.vocab_size / m) * m

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count from the shape alone (tied embedding counted once)."""
        from pretrain.model.dwa import dwa_mask

        h = self.d_model
        per_block = (3 + 1 + 2 * self.mlp_ratio) * h * h + 2 * h  # qkv, proj, mlp, 2 norms
        if self.skip_gains:
            per_block += 2
        n = self.n_layers * per_block + h  # + final norm
        if self.dwa:
            n += int(dwa_mask(self).sum())
        if not non_embedding:
            n += self.padded_vocab_size * h
        return n

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward = 3x forward).

        6 * (matmul params, LM head included) + 12 * d * seq * d_model for attention scores
        and values (nanoGPT/PaLM convention, causal mask not discounted) + 6 * d_model *
        (number of alpha connections) for the DWAs (one multiply-add per connection).
        """
        from pretrain.model.dwa import dwa_mask

        h = self.d_model
        matmul = self.n_layers * (4 + 2 * self.mlp_ratio) * h * h + self.padded_vocab_size * h
        attention = 12.0 * self.n_layers * self.seq_len * h
        dwa = int(dwa_mask(self).sum()) * h if self.dwa else 0
        return 6.0 * matmul + attention + 6.0 * dwa
