"""What MUDD keeps for backward, per activation-checkpointing mode: the activation terms of
parallel/strategies/memory.py for `model.connection: mudd` (the whole model, one pipeline
stage).

Plain arithmetic over the layout (pretrain/model/mudd_program.py: blocks 1..d, X_0 the
embedding, mix M_i after block i forms the C_i streams of block i + 1, C_d = 1). Per token
and rank (the mix is per token: under sequence parallelism it runs on this rank's slice):

- `mudd_buffers`: the token-major buffer of X_0..X_d (pretrain/model/mudd_mix.py), d + 1
  stream tensors outside autograd, a second copy of each X_j.
- `mudd_grad_buffers`: its gradient buffer, the same size, made by the first mix's backward
  (M_d's, right after the loss's) and held to the end of backward: it exists only in
  backward, but then beside nearly every kept tensor, so it is in the total (the probe
  cannot see it in a forward; tests/test_memory_mudd.py measures it after a backward).
- `mudd_held`: the X_j themselves (their own storage, beside the buffer's copy) that
  something keeps: X_0 (block 1's input in every mode), a checkpointed unit's inputs (the X_j
  its mixes read, held as `Store` results, which are views of X_j), and, dynamic, the X_i
  whose weights-MLP runs outside every unit (its RMSNorm saves X_i when the stream is fp32).
- `mudd_mixes`: per dynamic mix outside every unit, what its weights-MLP saves (fp32 with
  autocast off): the RMS factor (T), the normalised X_i (T, H), the hidden pre-activation
  and GELU output (T, K_i) and the weights A_i (T, C_i, i + 1) that `Mix` saves (K_i =
  C_i (i + 1)); and the fp32 copy of X_i its RMSNorm reads when the stream is narrower. The
  static mix saves nothing (its weights are a parameter).
- each block's input: the mix output M_{i-1}, one (T, C, H) storage of C stream tensors (the
  streams are its views; under qkvr the q, k, v norms save three of them, which keeps all
  four), X_0 for block 1 (in `mudd_held`).
- a block's internals: under r the Transformer block's, counted as its two branches
  (`ActivationShape.attention_branch`, `mlp_branch`) plus the inner residual H; under qkvr
  the attention reads three normalised inputs (`Attention.project_qkv`): three norms'
  outputs and statistics, q and k after RoPE, v (its own projection's output, not a view of
  a fused qkv output), the attention output and its (tokens, H) copy, the log-sum-exp, and
  the rows of the fused QKV weight each projection multiplies by, copied when they are not
  contiguous (more than one key/value group on the rank), in the matmul dtype.

Modes (parallel/strategies/checkpointing.py, units of n blocks): `none` keeps everything
above. `block`: per unit its entry (M_{a-1}'s output, kept by the checkpoint; X_0 for the
first unit) and the X_j its later mixes read (X_0..X_{a-1} when n > 1); the mixes that form
the entries run outside the units (their state kept). `dwa_block`: a unit recomputes its
entry mix from X_0..X_{a-1}, its inputs; only the output mix M_d runs outside. Recomputing a
unit holds its blocks' internals, the outputs of its mixes and their state (the X_i of its
inner mixes too).

Checked against the autograd probe (parallel/strategies/memory_probe.py, which counts the
buffer and the streams a checkpoint keeps in a tuple) in tests/test_memory_mudd.py.
"""

from __future__ import annotations

from pretrain.model.config import DenseFormerConfig
from pretrain.model.mudd_program import MuddLayout

FP32 = 4


def _input_bytes(layout: MuddLayout, i: int, shape) -> int:
    """Bytes of block i's input kept beside X_0: M_{i-1}'s C streams (none for block 1)."""
    return 0 if i == 1 else layout.n_streams(i - 1) * shape.stream_tensor


def _mix_state(layout: MuddLayout, i: int, shape) -> int:
    """Bytes M_i's dynamic weights save besides X_i itself (0 static)."""
    if not layout.dynamic:
        return 0
    tokens = shape.tokens // shape.seq_split
    k = layout.width(i)
    wide = shape.precision.stream < FP32  # RMSNorm reads a fp32 copy of X_i
    return tokens * FP32 * (1 + (2 if wide else 1) * shape.hidden + 3 * k)


def _qkvr_attention(model: DenseFormerConfig, shape) -> int:
    """Bytes the three-input attention half keeps besides its inputs (module docstring)."""
    p, s = shape.precision, shape.tokens * shape.hidden
    kv = s * model.kv_heads // model.n_heads
    elements = s + kv + kv + s + s  # q, k after RoPE, v; the output and its copy
    rows = (model.n_heads + 2 * model.kv_heads) * model.head_dim
    copies = rows * model.d_model * p.matmul // shape.tp \
        if model.kv_heads // shape.tp > 1 else 0
    lse = FP32 * shape.tokens * (model.n_heads // shape.tp)
    return elements * p.matmul // shape.tp + copies + lse + 3 * shape._norm_half


def _gqa_repeats(model: DenseFormerConfig, shape) -> int:
    """Bytes of the repeated k and v that `ActivationShape.attention_branch` counts under
    grouped-query attention and fp32 SDPA on torch 2.13 does not keep (measured: it takes
    k and v as they are); the DWA's estimate keeps them, within its tolerance."""
    s = shape.tokens * shape.hidden
    kv = s * model.kv_heads // model.n_heads
    return 2 * (s - kv) * shape.precision.matmul // shape.tp


def block_bytes(model: DenseFormerConfig, shape) -> int:
    """Bytes one non-checkpointed block keeps besides its input: H and its two halves."""
    layout = model.mudd_layout
    attention = _qkvr_attention(model, shape) if layout.streams == "qkvr" \
        else shape.attention_branch - _gqa_repeats(model, shape)
    return shape.stream_tensor + attention + shape.mlp_branch


def mudd_activation_terms(model: DenseFormerConfig, shape, mode: str,
                          units: list[range]) -> dict[str, int]:
    """Bytes of one micro-batch through a whole MUDD model (no PP), by term; `units`: the
    checkpoint units' blocks (memory.py `unit_ranges`)."""
    layout = model.mudd_layout
    d = layout.n_layers
    x = shape.stream_tensor
    buffer = (d + 1) * x
    terms = {"lm_head": shape.head, "mudd_buffers": buffer, "mudd_grad_buffers": buffer}
    # X_i is itself what a dynamic mix's RMSNorm saves when the stream is fp32.
    saves_x = layout.dynamic and shape.precision.stream == FP32
    block = block_bytes(model, shape)
    if mode == "none":
        terms["mudd_held"] = (1 + (d if saves_x else 0)) * x
        terms["mudd_mixes"] = sum(_mix_state(layout, i, shape) for i in range(1, d + 1))
        terms["blocks"] = sum(block + _input_bytes(layout, i, shape) for i in range(1, d + 1))
        return terms
    held, outside, entries, working = {0}, [d], 0, 0
    for unit in units:
        a, b = unit.start, unit[-1]
        if mode == "dwa_block" or b > a:
            held |= set(range(a))  # the X_j the unit's mixes read, as its inputs
        recomputed = mode == "dwa_block" and a > 1
        if mode == "block" and a > 1:
            outside.append(a - 1)
            entries += _input_bytes(layout, a, shape)
        inner = range(a - 1 if recomputed else a, b)  # the mixes the unit runs
        unit_working = len(unit) * block + sum(
            _mix_state(layout, i, shape) + (x if saves_x and i >= a else 0)
            + _input_bytes(layout, i + 1, shape) for i in inner)
        working = max(working, unit_working)
    if saves_x:
        held |= set(outside)
    terms["mudd_held"] = len(held) * x
    terms["mudd_mixes"] = sum(_mix_state(layout, i, shape) for i in outside)
    if mode == "block":
        terms["checkpoint_boundaries"] = entries
    terms["recompute_working_set"] = working
    return terms
