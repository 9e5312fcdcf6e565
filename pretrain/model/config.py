"""DenseFormerConfig: the shape of a DenseFormer (or Transformer) language model.

Index conventions (docs/design.md#index-conventions), used everywhere in `pretrain.model`:
blocks are numbered 1..d; X_0 is the embedding output; block i maps Y_{i-1} to X_i; the DWA
after block i (if any) produces Y_i = sum_{j in S_i} alpha[i, j] X_j. `model.blocks[i - 1]` is
block i and row i - 1 of the (d, d + 1) alpha matrix is the DWA after block i.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from pretrain.model.attnres_layout import AttnResLayout
from pretrain.model.dwa_pattern import DWAPattern, pattern_for_shape
from pretrain.model.hc_program import HCLayout
from pretrain.model.mudd_program import MuddLayout

RANGE = "range"  # the dataclass field metadata key that holds a numeric field's Range


@dataclass(frozen=True)
class Range:
    """The valid values of a numeric field: finite, and within every bound that is set."""

    ge: float | None = None  # value >= ge
    gt: float | None = None  # value > gt
    le: float | None = None  # value <= le
    lt: float | None = None  # value < lt
    also: str = ""  # what a check across fields adds, for the docs ("<= optim.lr")

    def __contains__(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le)
                and (self.lt is None or value < self.lt))

    def __str__(self) -> str:
        low = f"[{_number(self.ge)}" if self.ge is not None else (
            f"({_number(self.gt)}" if self.gt is not None else None)
        high = f"{_number(self.le)}]" if self.le is not None else (
            f"{_number(self.lt)})" if self.lt is not None else None)
        if low and high:
            return f"in {low}, {high}"
        if low:
            return (">= " if low[0] == "[" else "> ") + low[1:]
        if high:
            return ("<= " if high[-1] == "]" else "< ") + high[:-1]
        return "any finite number"

    def problem(self, value: float, nullable: bool = False) -> str | None:
        """None if `value` is valid, else what is wrong with it (`nullable`: null is valid)."""
        if value in self:
            return None
        null = "null or " if nullable else ""
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be {null}a finite number {self}, got {value!r}"
        return f"must be {null}{self}, got {value!r}"


def _number(bound: float) -> str:
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def ranged(default: Any, also: str = "", **bounds: float) -> Any:
    """A dataclass field with `default` whose valid values are Range(**bounds)."""
    return field(default=default, metadata={RANGE: Range(also=also, **bounds)})


def numeric_kind(hint: Any) -> tuple[type | None, bool]:
    """(int or float, nullable) for a numeric type hint such as `int | None`; (None, _) else."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) \
        else (hint,)
    nullable = type(None) in args
    # a Literal alternative ("auto") is checked as such, not as a number
    kinds = [a for a in args if a is not type(None) and typing.get_origin(a) is not Literal]
    if len(kinds) == 1 and kinds[0] in (int, float):
        return kinds[0], nullable
    return None, nullable


class ConfigError(ValueError):
    """An invalid configuration value; `key` is the dotted key, e.g. "model.n_heads"."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


class ModelConfigError(ValueError):
    """A model field holds an invalid value; `key` names the field."""

    def __init__(self, key: str, message: str):
        super().__init__(f"model.{key}: {message}")
        self.key = key


@dataclass
class DenseFormerConfig:
    n_layers: int = ranged(4, ge=1)
    d_model: int = ranged(64, ge=1)
    n_heads: int = ranged(4, ge=1, also="divides d_model into an even head size")
    # None: not known yet (a run config takes it from the data's tokenizer, with_vocab);
    # what needs the vocabulary (padded_vocab_size, num_params, the model) refuses it.
    vocab_size: int | None = ranged(None, ge=1)
    seq_len: int = ranged(128, ge=1)
    # The depth connection (docs/connections.md): none (a Transformer's residual stream),
    # dwa (DenseFormer's depth weighted averages), attnres (Attention Residuals), mudd
    # (MUltiway Dynamic Dense connections), hc (Hyper-Connections) or mhc
    # (manifold-constrained Hyper-Connections). null: the shorthand `dwa` decides (true: dwa,
    # false: none).
    connection: Literal["none", "dwa", "attnres", "mudd", "hc", "mhc"] | None = None
    # Depth weighted averages: dilation k, period p ("k x p"); dwa=False is a plain Transformer.
    dwa: bool = True
    dwa_dilation: int = ranged(1, ge=1)
    dwa_period: int = ranged(1, ge=1)
    # Last-K baseline: a DWA reads only X_j with j > i - dwa_window (None: all of S_i).
    dwa_window: int | None = ranged(None, ge=1)
    # Initial alpha off the diagonal (connect-to-last uses 1e-4; DenseFormer 0, so that the
    # model equals a Transformer at init); at most the diagonal's 1.
    dwa_init_offdiag: float = ranged(0.0, ge=0, le=1)
    # The dtype the DWAs keep the block outputs X_j (and, in backward, their output
    # gradients) in: fp32 is the residual stream's own (the paper's numerics); bf16 halves
    # those bytes. Sums are fp32 either way (pretrain/model/dwa.py).
    dwa_dtype: Literal["fp32", "bf16"] = "fp32"
    # Who computes the DWAs (pretrain/model/dwa_impl.py): auto is the Triton kernels on a
    # CUDA device and torch elsewhere; triton needs the `triton` extra.
    dwa_impl: Literal["auto", "triton", "torch"] = "auto"
    # Attention Residuals: null is full AttnRes (each sub-layer attends over every earlier
    # sub-layer output); N is block AttnRes over N groups of sub-layers (N divides 2 x n_layers).
    attnres_blocks: int | None = ranged(None, ge=1, also="divides 2 x n_layers")
    # MUDD (MUltiway Dynamic Dense connections): null is true (per-token weights); false is
    # the static ablation. Streams: qkvr mixes the query, key, value and residual inputs of
    # each block apart; r the residual alone (pretrain/model/mudd.py). null: qkvr.
    mudd_dynamic: bool | None = None
    mudd_streams: Literal["qkvr", "r"] | None = None
    # Hyper-Connections (hc, mhc): the residual stream's n streams (null: 4).
    hc_streams: int | None = ranged(None, ge=1)
    # hc only: dynamic (input-dependent) weights on top of the static ones (null: true).
    hc_dynamic: bool | None = None
    # mhc only: Sinkhorn-Knopp iterations projecting H_res (null: 20).
    mhc_sinkhorn_iters: int | None = ranged(None, ge=1)
    # Skips-with-gains baseline: a learned scalar gain on each residual connection.
    skip_gains: bool = False
    mlp_ratio: int = ranged(4, ge=1)
    dropout: float = ranged(0.0, ge=0, lt=1)
    # RoPE frequencies are base^(-2i/head_dim): a base <= 1 makes them all 1 or growing.
    rope_base: float = ranged(10000.0, gt=1)
    norm_eps: float = ranged(1e-5, gt=0)  # 0 divides by zero on an all-zero input
    init_std: float = ranged(0.02, gt=0)  # 0 gives identical units that never differ
    # The embedding/LM-head rows are padded to this multiple, independent of TP, so that
    # every layout shares one padded vocabulary; padded ids are never predicted.
    vocab_pad_multiple: int = ranged(128, ge=1)
    # The block: gpt (the paper's: LayerNorm without bias, 4x GELU MLP) or llama (RMSNorm,
    # SwiGLU); both pre-norm with RoPE and no biases (pretrain/model/layers.py).
    block: Literal["gpt", "llama"] = "gpt"
    # Key/value heads (null: n_heads); fewer is grouped-query attention, each serving
    # n_heads / n_kv_heads query heads.
    n_kv_heads: int | None = ranged(None, ge=1, also="divides n_heads; tp divides it")
    # false: a separate LM head instead of the embedding's transpose.
    tie_embeddings: bool = True
    # The MLP's hidden width (null: the block's rule, `ffn_width`): gpt mlp_ratio x d_model,
    # llama 8/3 x d_model rounded up to a multiple of ffn_multiple_of.
    ffn_hidden_size: int | None = ranged(None, ge=1)
    ffn_multiple_of: int = ranged(256, ge=1)
    # Tokens per chunk of the training loss (pretrain/model/loss.py): the logits exist one
    # chunk at a time, (chunk x V / TP) floats, never for the whole micro-batch.
    loss_chunk_tokens: int = ranged(4096, ge=1)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ModelConfigError naming the first field with an invalid value."""
        for f in dataclasses.fields(self):
            valid = f.metadata.get(RANGE)
            if valid is not None:
                _check_numeric(f.name, getattr(self, f.name), _hints()[f.name], valid)
        if self.d_model % self.n_heads:
            raise ModelConfigError(
                "n_heads", f"{self.n_heads} heads do not divide d_model={self.d_model}")
        if (self.d_model // self.n_heads) % 2:
            raise ModelConfigError(
                "n_heads", f"head size {self.d_model // self.n_heads} must be even for RoPE")
        if self.connection not in (None, *CONNECTIONS):
            raise ModelConfigError("connection", f"must be one of {', '.join(CONNECTIONS)} (or "
                                                 f"null), got {self.connection!r}")
        for key, owner in CONNECTION_KEYS.items():
            owners = owner if isinstance(owner, tuple) else (owner,)
            if getattr(self, key) is not None and self.depth_connection not in owners:
                if key == "hc_dynamic" and self.depth_connection == "mhc":
                    raise ModelConfigError(key, "mHC is dynamic by definition: set it to null")
                raise ModelConfigError(key, f"belongs to model.connection={' or '.join(owners)}"
                                            f", but the connection is {self.depth_connection}:"
                                            " set it to null or change the connection")
        if self.attnres_blocks is not None and (2 * self.n_layers) % self.attnres_blocks:
            raise ModelConfigError("attnres_blocks", f"{self.attnres_blocks} blocks do not "
                                   f"divide the {2 * self.n_layers} sub-layers (2 x n_layers)")
        if self.mudd_streams not in (None, "qkvr", "r"):
            raise ModelConfigError("mudd_streams",
                                   f"must be qkvr or r (or null), got {self.mudd_streams!r}")
        if self.mudd_dynamic not in (None, True, False):
            raise ModelConfigError("mudd_dynamic",
                                   f"must be true or false (or null), got {self.mudd_dynamic!r}")
        if self.skip_gains and self.depth_connection != "none":
            raise ModelConfigError("skip_gains", "is a Transformer baseline: set dwa=false "
                                                 "(or connection=none)")
        if self.dwa_dtype not in ("fp32", "bf16"):
            raise ModelConfigError("dwa_dtype", f"must be fp32 or bf16, got {self.dwa_dtype!r}")
        if self.dwa_impl not in ("auto", "triton", "torch"):
            raise ModelConfigError("dwa_impl",
                                   f"must be auto, triton or torch, got {self.dwa_impl!r}")
        if self.dwa_impl == "triton" and importlib.util.find_spec("triton") is None:
            raise ModelConfigError("dwa_impl", "triton is not installed: pip install -e "
                                               "'.[triton]' (or set model.dwa_impl=auto)")
        if self.block not in ("gpt", "llama"):
            raise ModelConfigError("block", f"must be gpt or llama, got {self.block!r}")
        if self.n_heads % self.kv_heads:
            raise ModelConfigError("n_kv_heads", f"{self.kv_heads} key/value heads do not "
                                                 f"divide n_heads={self.n_heads}")

    @property
    def depth_connection(self) -> str:
        """The depth connection in force: `connection`, or the shorthand `dwa` when null."""
        return self.connection or ("dwa" if self.dwa else "none")

    @property
    def has_dwa(self) -> bool:
        return self.depth_connection == "dwa"

    def ignored_dwa_keys(self) -> list[str]:
        """The DWA keys set away from their defaults while another connection is in force
        (they are ignored; the run says so in one line)."""
        if self.depth_connection == "dwa":
            return []
        return [f.name for f in dataclasses.fields(self)
                if f.name in DWA_KEYS and getattr(self, f.name) != f.default]

    def ignored_dwa_note(self) -> str | None:
        """The one `note:` line a run prints when `ignored_dwa_keys()` is not empty."""
        keys = self.ignored_dwa_keys()
        if not keys:
            return None
        return (f"note: {', '.join(f'model.{key}' for key in keys)} "
                f"{'is' if len(keys) == 1 else 'are'} ignored under "
                f"model.connection={self.depth_connection}")

    @property
    def architecture(self) -> str:
        """A short name for logs and reports: "Transformer", "DenseFormer 4x5", "AttnRes
        block 8"."""
        kind = self.depth_connection
        if kind == "dwa":
            return f"DenseFormer {self.dwa_dilation}x{self.dwa_period}"
        if kind == "attnres":
            n = self.attnres_blocks
            return "AttnRes full" if n is None else f"AttnRes block {n}"
        if kind == "mudd":
            layout = self.mudd_layout
            return ("MUDD" + ("" if layout.dynamic else " static")
                    + ("" if layout.streams == "qkvr" else " r"))
        if self.hc_layout is not None:
            return self.hc_layout.name
        return "Transformer"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_heads, or n_heads when it is null."""
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_width(self) -> int:
        """The MLP's hidden width: ffn_hidden_size, else the block's rule."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.block == "llama":  # Llama's SwiGLU rule: 2/3 of 4 x d, rounded up
            m = self.ffn_multiple_of
            return m * math.ceil(int(8 * self.d_model / 3) / m)
        return self.mlp_ratio * self.d_model

    def with_vocab(self, vocab_size: int) -> DenseFormerConfig:
        """A copy with `vocab_size` filled in from a tokenizer of `vocab_size` ids. A model
        vocabulary already set may be larger (released models often reserve rows), never
        smaller: ModelConfigError then, as a token id would fall outside the model."""
        if self.vocab_size is not None and self.vocab_size < vocab_size:
            raise ModelConfigError("vocab_size", f"is {self.vocab_size}, but the tokenizer has "
                                                 f"{vocab_size} ids: ids {self.vocab_size} and "
                                                 "up would fall outside the model")
        return dataclasses.replace(self, vocab_size=self.vocab_size or vocab_size)

    @property
    def padded_vocab_size(self) -> int:
        """vocab_size rounded up to vocab_pad_multiple; ModelConfigError if it is null."""
        if self.vocab_size is None:
            raise ModelConfigError("vocab_size", "is null: pass the vocabulary size of the data "
                                                 "(with_vocab)")
        m = self.vocab_pad_multiple
        return math.ceil(self.vocab_size / m) * m

    @property
    def dwa_pattern(self) -> DWAPattern:
        """The DWA pattern of this shape (pretrain/model/dwa_pattern.py), one object per shape."""
        return pattern_for_shape(self.n_layers, self.dwa_dilation,
                                 self.dwa_period if self.has_dwa else None, self.dwa_window,
                                 self.dwa_init_offdiag)

    @property
    def attnres_layout(self) -> AttnResLayout | None:
        """What each sub-layer of an AttnRes model reads; None under another connection."""
        if self.depth_connection != "attnres":
            return None
        return AttnResLayout(self.n_layers, self.attnres_blocks)

    @property
    def mudd_layout(self) -> MuddLayout | None:
        """The streams and mixes of a MUDD model; None under another connection."""
        if self.depth_connection != "mudd":
            return None
        return MuddLayout(self.n_layers, self.mudd_streams or "qkvr",
                          self.mudd_dynamic is not False)

    @property
    def hc_layout(self) -> HCLayout | None:
        """The Hyper-Connections' shape (hc, mhc); None under another connection."""
        kind = self.depth_connection
        if kind not in ("hc", "mhc"):
            return None
        return HCLayout(kind, self.n_layers, self.hc_streams or 4,
                        kind == "mhc" or self.hc_dynamic is not False,
                        self.mhc_sinkhorn_iters or 20)

    def block_matmul_params(self) -> int:
        """Weights of one block's matmuls: q, k, v, output projection and the MLP."""
        h, kv = self.d_model, self.kv_heads * self.head_dim
        mlp = (3 if self.block == "llama" else 2) * h * self.ffn_width  # SwiGLU: gate, up, down
        return (2 * h + 2 * kv) * h + mlp

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count from the shape alone (a tied embedding counted once; an untied LM
        head counts as embedding)."""
        h = self.d_model
        per_block = self.block_matmul_params() + 2 * h  # + 2 norms
        if self.mudd_layout is not None:
            per_block += self.mudd_layout.block_norms * h  # the key and value inputs' norms
        if self.skip_gains:
            per_block += 2
        n = self.n_layers * per_block + h  # + final norm
        n += self.dwa_pattern.n_connections  # the learned alphas
        if self.attnres_layout is not None:
            n += self.attnres_layout.n_params(h)
        if self.mudd_layout is not None:
            n += self.mudd_layout.n_params(h)
        if self.hc_layout is not None:
            n += self.hc_layout.n_params(h)
        if not non_embedding:
            n += self.padded_vocab_size * h * (1 if self.tie_embeddings else 2)
        return n

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward = 3x forward).

        6 * (matmul params, LM head included) + 12 * d * seq * d_model for attention scores
        and values (nanoGPT/PaLM convention, causal mask not discounted) + 6 * d_model *
        (number of alpha connections) for the DWAs (one multiply-add per connection), or
        for Attention Residuals 6 * d_model * 2 * (sources summed over consumers): a
        multiply-add for each source's logit and one for its share of the sum; for MUDD
        6 * (sum_i C_i (i + 1) d_model (the mixes) + sum_i K_i (d_model + K_i) (the dynamic
        weights' MLP, none when static)), `MuddLayout.mix_macs`; for Hyper-Connections
        6 * (their multiply-adds per token, hc_program.py `HCLayout.n_macs`): per sub-layer
        (n^2 + 2n) H for the input mix and the write, plus n (n + 2) H for dynamic HC's
        projection or n (n^2 + 2n) H for mHC's, plus n H for the output's sum over the n
        streams.
        """
        h = self.d_model
        matmul = self.n_layers * self.block_matmul_params() + self.padded_vocab_size * h
        attention = 12.0 * self.n_layers * self.seq_len * h
        depth = self.dwa_pattern.n_connections * h
        if self.attnres_layout is not None:
            depth += 2 * self.attnres_layout.n_reads() * h
        if self.mudd_layout is not None:
            depth += self.mudd_layout.mix_macs(h)
        if self.hc_layout is not None:
            depth += self.hc_layout.n_macs(h)
        return 6.0 * matmul + attention + 6.0 * depth


CONNECTIONS = ("none", "dwa", "attnres", "mudd", "hc", "mhc")
# Keys of one connection (or of several: a tuple) that must stay null under another (the
# DWA's own keys predate the interface and have defaults: `DWA_KEYS`, ignored with a warning
# instead).
CONNECTION_KEYS = {"attnres_blocks": "attnres", "mudd_dynamic": "mudd", "mudd_streams": "mudd",
                   "hc_streams": ("hc", "mhc"), "hc_dynamic": "hc", "mhc_sinkhorn_iters": "mhc"}
DWA_KEYS = ("dwa_dilation", "dwa_period", "dwa_window", "dwa_init_offdiag", "dwa_dtype",
            "dwa_impl")


@functools.cache
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(DenseFormerConfig)


def _check_numeric(name: str, value: Any, hint: Any, valid: Range) -> None:
    """Raise ModelConfigError unless `value` has the numeric type of `hint` and is in `valid`."""
    kind, nullable = numeric_kind(hint)
    if value is None and nullable:
        return
    accepted = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, accepted):
        noun = "an integer" if kind is int else "a number"
        raise ModelConfigError(name, f"must be {'null or ' if nullable else ''}{noun} {valid}, "
                                     f"got {value!r}")
    problem = valid.problem(value, nullable)
    if problem is not None:
        raise ModelConfigError(name, problem)
