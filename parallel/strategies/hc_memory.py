"""What Hyper-Connections keep for backward, per activation-checkpointing mode: the
activation terms of parallel/strategies/memory.py for `model.connection: hc` and `mhc` (the
whole model, one pipeline stage).

Plain arithmetic over the layout (pretrain/model/hc_program.py: sub-layers c = 1..L, L = 2d,
X_{c-1} the n-stream state (T, n, H) that sub-layer c reads, X_0 the embedding expanded into
the n streams, a view of one (T, H) tensor). Per token and rank, in the stream's dtype (the
mixes run with autocast off, pretrain/model/hc_mix.py; under sequence parallelism on this
rank's slice of the sequence, without it on the whole sequence on every TP rank):

- `hc_held`: the states that something keeps: with `none` X_0..X_{L-1}, each saved by its
  sub-layer's read and write (and, dynamic HC, its `_RMSProjection`), X_0 one stream
  tensor and the others n; the model output's sum over the streams saves nothing, so X_L
  is not kept (the final norm keeps Y_d, in `lm_head`). With `block` and `dwa_block` the
  units' inputs X_{2a-2}, kept by the checkpoints.
- `hc_mixes`, per sub-layer, what its weights keep besides the state: the read's pre
  (T, n), the write's destination-major mix (T, n, n) (a contiguous copy: Ar^T for HC, the
  Sinkhorn output's token-major layout for mHC) and post (T, n): static weights too, expanded
  to every token and copied (`_per_token`). Dynamic HC adds its `_RMSProjection`'s x proj
  (T n, n + 2) and RMS factor (T n), the tanh output (T, n, n + 2) and the (n + 2) gains.
  mHC adds, with m = n^2 + 2n: the projection's x proj (T, m) and RMS factor (T), its
  output z (T, m) and the m gains that the addcmul saves, the sigmoid of the post logits
  beside post = 2 sigmoid (pre is its sigmoid's own output), and the logits that the
  Sinkhorn function saves to recompute its iterates (T, m; the fp32 copy of the (T, n^2)
  res logits when the stream is narrower); and at sub-layer 1 the flattened copy of X_0
  (T, n H) that its projection reads (a flatten of the expanded streams is a copy).
- `blocks`: each sub-layer's branch internals (`ActivationShape.attention_branch`,
  `mlp_branch`, as Attention Residuals count them, less the repeated k and v that
  `attention_branch` counts under grouped-query attention and fp32 SDPA does not keep)
  plus its input h_c (the read's output, which the branch's norm saves) and its output
  T_c(h_c) in the stream's dtype (the write saves it: a copy when the branch computes in a
  narrower dtype), two stream tensors.

Modes (parallel/strategies/checkpointing.py, units of n blocks = 2n sub-layers): a unit's
first read and its write are one step, so every unit recomputes its entry mix from the state
it receives and `block` and `dwa_block` are the same. `none` keeps everything above.
`block`/`dwa_block` keep the units' input states (`hc_held`) and the LM head; nothing runs
outside the units but the output sum. Recomputing a unit holds its sub-layers' mixes and
branches and the 2n - 1 states it makes before its last (the first unit's mHC also the
flattened copy of X_0).

Checked against the autograd probe (parallel/strategies/memory_probe.py) in
tests/test_memory_hc.py.
"""

from __future__ import annotations

from parallel.strategies.mudd_memory import _gqa_repeats
from pretrain.model.config import DenseFormerConfig
from pretrain.model.hc_program import HCLayout

FP32 = 4


def state_bytes(layout: HCLayout, j: int, shape) -> int:
    """Bytes of the state X_j: one stream tensor for X_0 (n views of it), n for the others."""
    return shape.stream_tensor * (1 if j == 0 else layout.streams)


def mix_bytes(layout: HCLayout, c: int, shape) -> int:
    """Bytes sub-layer c's weights keep besides the state X_{c-1} (module docstring)."""
    n, e = layout.streams, shape.precision.stream
    tokens = shape.tokens // shape.seq_split
    total = tokens * (2 * n + n * n) * e  # pre, mix, post
    if layout.kind == "mhc":
        m = layout.n_weights
        logits = tokens * m * e if e >= FP32 else tokens * n * n * FP32
        total += (tokens * (2 * m + 1 + n) + m) * e + logits
        if c == 1:
            total += layout.streams * shape.stream_tensor
    elif layout.dynamic:
        total += (tokens * n * (2 * (n + 2) + 1) + n + 2) * e
    return total


def sublayer_bytes(model: DenseFormerConfig, shape, c: int) -> int:
    """Bytes sub-layer c's branch keeps, with its input h_c and its output (the attention
    without the repeated k and v of grouped-query attention, which fp32 SDPA does not keep:
    mudd_memory.py)."""
    branch = shape.attention_branch - _gqa_repeats(model, shape) if c % 2 \
        else shape.mlp_branch
    return branch + 2 * shape.stream_tensor


def hc_activation_terms(model: DenseFormerConfig, shape, mode: str,
                        units: list[range]) -> dict[str, int]:
    """Bytes of one micro-batch through a whole HC or mHC model (no PP), by term; `units`:
    the checkpoint units' blocks (memory.py `unit_ranges`)."""
    layout = model.hc_layout
    subs = range(1, layout.n_sublayers + 1)
    terms = {"lm_head": shape.head}
    if mode == "none":
        terms["hc_held"] = sum(state_bytes(layout, c - 1, shape) for c in subs)
        terms["hc_mixes"] = sum(mix_bytes(layout, c, shape) for c in subs)
        terms["blocks"] = sum(sublayer_bytes(model, shape, c) for c in subs)
        return terms
    held, working = 0, 0
    for unit in units:
        first, last = 2 * unit.start - 1, 2 * unit[-1]
        held += state_bytes(layout, first - 1, shape)
        inner = range(first, last + 1)
        working = max(working, sum(mix_bytes(layout, c, shape) + sublayer_bytes(model, shape, c)
                                   for c in inner)
                      + (len(inner) - 1) * state_bytes(layout, 1, shape))
    terms["hc_held"] = held
    terms["recompute_working_set"] = working
    return terms
