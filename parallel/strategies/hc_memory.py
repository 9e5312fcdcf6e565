"""What Hyper-Connections keep for backward, per activation-checkpointing mode: the
activation terms of parallel/strategies/memory.py for `model.connection: hc` and `mhc` (the
whole model, and each pipeline stage).

Plain arithmetic over the layout (pretrain/model/hc_program.py: sub-layers c = 1..L, L = 2d,
X_{c-1} the n-stream state (T, n, H) that sub-layer c reads, X_0 the embedding copied into
the n streams, one contiguous state like the others). Per token and rank, in the stream's dtype (the
mixes run with autocast off, pretrain/model/hc_mix.py; under sequence parallelism on this
rank's slice of the sequence, without it on the whole sequence on every TP rank):

- `hc_held`: the states that something keeps: with `none` X_0..X_{L-1}, each saved by its
  sub-layer's read and write (and, dynamic HC and mHC, its `_RMSProjection`), n stream
  tensors each; the model output's sum over the streams saves nothing, so X_L
  is not kept (the final norm keeps Y_d, in `lm_head`). With `block` and `dwa_block` the
  units' inputs X_{2a-2}, kept by the checkpoints.
- `hc_mixes`, per sub-layer, what its weights keep besides the state: the read's pre
  (T, n), the write's destination-major mix (T, n, n) (a contiguous copy: Ar^T for HC, the
  Sinkhorn output's token-major layout for mHC) and post (T, n): static weights too, expanded
  to every token and copied (`_per_token`). Dynamic HC adds the projection of the streams
  y (T n, n + 2), its tanh z (T, n, n + 2) and the RMS factors (T n), which the fused CPU
  kernel's function saves (`_DynamicRead`; the separate torch functions that run on a GPU
  also keep the n + 2 gains, 4 (n + 2) bytes a sub-layer more).
  mHC adds, with m = n^2 + 2n: the projection's x proj (T, m) and RMS factor (T), its
  output z (T, m) and the m gains that the addcmul saves, the sigmoid of the post logits
  beside post = 2 sigmoid (pre is its sigmoid's own output), and the logits that the
  Sinkhorn function saves to recompute its iterates (T, m; the fp32 copy of the (T, n^2)
  res logits when the stream is narrower).
- `blocks`: each sub-layer's branch internals (`ActivationShape.attention_branch`,
  `mlp_branch`, as Attention Residuals count them) plus its input h_c (the read's output,
  which the branch's norm saves) and its output T_c(h_c) in the stream's dtype (the write
  saves it: a copy when the branch computes in a narrower dtype), two stream tensors.

Modes (parallel/strategies/checkpointing.py, units of n blocks = 2n sub-layers): a unit's
first read and its write are one step, so every unit recomputes its entry mix from the state
it receives and `block` and `dwa_block` are the same. `none` keeps everything above.
`block`/`dwa_block` keep the units' input states (`hc_held`) and the LM head; nothing runs
outside the units but the output sum. Recomputing a unit holds its sub-layers' mixes and
branches and the 2n - 1 states it makes before its last.

A pipeline stage (`hc_stage_terms`: blocks first..last, sub-layers 2 first - 1 .. 2 last,
the program of hc_program.py run by parallel/strategies/stage_model.py) keeps per micro-batch
the state it receives, X_{2 first - 2} (n stream tensors in the boundary's dtype, and its
copy widened to the stream's dtype when that is wider: the first sub-layer saves it), or on
the first stage X_0 and the token ids; the states X_{2 first - 1} .. X_{2 last - 1}; its
sub-layers' mixes and branches as above, except that with `block` (the pipeline checkpoints
each branch, `StageModule._checkpointed`: the mixes stay outside) only each branch's input
and output and one branch's recomputation; the state it sends, X_{2 last}, in the boundary's
dtype; on the last stage the head and Y_d, its output.

Checked against the autograd probe (parallel/strategies/memory_probe.py) in
tests/test_memory_hc.py, the whole model and each pipeline stage.
"""

from __future__ import annotations

from pretrain.model.config import DenseFormerConfig
from pretrain.model.hc_program import HCLayout

FP32 = 4


def state_bytes(layout: HCLayout, shape) -> int:
    """Bytes of one state X_j: n stream tensors."""
    return shape.stream_tensor * layout.streams


def mix_bytes(layout: HCLayout, c: int, shape) -> int:
    """Bytes sub-layer c's weights keep besides the state X_{c-1} (module docstring)."""
    n, e = layout.streams, shape.precision.stream
    tokens = shape.tokens // shape.seq_split
    total = tokens * (2 * n + n * n) * e  # pre, mix, post
    if layout.kind == "mhc":
        m = layout.n_weights
        logits = tokens * m * e if e >= FP32 else tokens * n * n * FP32
        total += (tokens * (2 * m + 1 + n) + m) * e + logits
    elif layout.dynamic:
        total += tokens * n * (2 * (n + 2) + 1) * e
    return total


def sublayer_bytes(model: DenseFormerConfig, shape, c: int) -> int:
    """Bytes sub-layer c's branch keeps, with its input h_c and its output."""
    branch = shape.attention_branch if c % 2 else shape.mlp_branch
    return branch + 2 * shape.stream_tensor


def hc_activation_terms(model: DenseFormerConfig, shape, mode: str,
                        units: list[range]) -> dict[str, int]:
    """Bytes of one micro-batch through a whole HC or mHC model (no PP), by term; `units`:
    the checkpoint units' blocks (memory.py `unit_ranges`)."""
    layout = model.hc_layout
    subs = range(1, layout.n_sublayers + 1)
    terms = {"lm_head": shape.head}
    if mode == "none":
        terms["hc_held"] = len(subs) * state_bytes(layout, shape)
        terms["hc_mixes"] = sum(mix_bytes(layout, c, shape) for c in subs)
        terms["blocks"] = sum(sublayer_bytes(model, shape, c) for c in subs)
        return terms
    held, working = 0, 0
    for unit in units:
        first, last = 2 * unit.start - 1, 2 * unit[-1]
        held += state_bytes(layout, shape)
        inner = range(first, last + 1)
        working = max(working, sum(mix_bytes(layout, c, shape) + sublayer_bytes(model, shape, c)
                                   for c in inner)
                      + (len(inner) - 1) * state_bytes(layout, shape))
    terms["hc_held"] = held
    terms["recompute_working_set"] = working
    return terms


def hc_stage_terms(model: DenseFormerConfig, shape, mode: str, program,
                   boundary_bytes: int) -> dict[str, int]:
    """Bytes of one micro-batch on one pipeline stage, by term (module docstring); `program`
    its StageProgram (hc_program.py), `boundary_bytes` the element size of the state that
    crosses a boundary (parallel.pipeline_dtype). `mode`: `none` or `block` (each branch a
    checkpoint, `StageModule._checkpointed`)."""
    layout = model.hc_layout
    lo, hi = 2 * program.first - 1, 2 * program.last
    subs = range(lo, hi + 1)
    tokens = shape.tokens // shape.seq_split
    terms = {}
    token_ids = 8 * shape.micro_batch * (shape.seq + 1)
    if program.is_first:
        # The loaded (B, S + 1) batch that the embedding's ids are a view of; under TP the
        # vocabulary-parallel embedding also saves its shifted ids (int64) and the mask of
        # ids outside this rank's shard (bool). `shape.head` counts them for the whole model.
        terms["token_ids"] = token_ids + (9 * shape.tokens if shape.tp > 1 else 0)
    else:
        # X_{lo-1} as it crossed, and widened to the stream's dtype on receipt where that is
        # wider (the widened copy is the state the stage's first sub-layer saves).
        state = layout.streams * tokens * shape.hidden
        terms["received"] = state * boundary_bytes + (
            layout.streams * shape.stream_tensor if boundary_bytes != shape.precision.stream
            else 0)
    # The states the stage's sub-layers read but the received one.
    terms["hc_held"] = (len(subs) - (0 if program.is_first else 1)) * state_bytes(layout, shape)
    terms["hc_mixes"] = sum(mix_bytes(layout, c, shape) for c in subs)
    if mode == "none":
        terms["blocks"] = sum(sublayer_bytes(model, shape, c) for c in subs)
    else:  # each branch's input h_c (the checkpoint's) and output T_c(h_c) (the write's)
        terms["checkpoint_boundaries"] = len(subs) * 2 * shape.stream_tensor
        terms["recompute_working_set"] = max(sublayer_bytes(model, shape, c)
                                             for c in (1, 2)) - 2 * shape.stream_tensor
    if program.is_last:
        # Y_d, the stage's output, which the schedule holds until its backward, besides
        # what the head keeps.
        terms["lm_head"] = shape.head - token_ids + shape.stream_tensor
    else:  # X_hi in the boundary's dtype (nothing on this stage keeps it otherwise)
        terms["sent"] = layout.streams * tokens * shape.hidden * boundary_bytes
    return terms
