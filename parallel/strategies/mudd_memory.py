"""What MUDD keeps for backward, per activation-checkpointing mode: the activation terms of
parallel/strategies/memory.py for `model.connection: mudd` (the whole model, and each
pipeline stage).

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

A pipeline stage (`mudd_stage_terms`, blocks first..last, the program of mudd_program.py
run by parallel/strategies/stage_model.py) keeps, per micro-batch in flight: its buffer's
slots 0..last and their gradient buffer (slots 0..first-1 too when it receives partial
sums: they are allocated, unused); X_0 on the first stage and, dynamic in fp32, the X_i of
the mixes it forms that were made here (`mudd_held`); what it receives, as it came (raw
X_j, or for static MUDD in `optimal` transfer the partial sums M_i.s), widened on receipt
where narrower and kept (the X_i a dynamic mix reads, a block's input); what it sends and
nothing else keeps (the X_j made here, the partial sums); the state of the mixes it forms,
M_{first-1}..M_{last-1} and M_d on the last stage (dynamic: as above; a partial sum sent
on is formed in plain ops, whose matmul saves the stack of the stage's X_lo..X_last per
stream); its blocks, each with its input: M_{i-1}'s C streams (one storage), none for
block 1 (X_0) or a block whose whole input was received, and a mix that adds received
sums to the stage's own terms makes C separate tensors, of which a qkvr block keeps q, k,
v (its norms' inputs) and a checkpoint all four. With `block` (the pipeline checkpoints
each block) the inputs and one block's recomputation; the mixes run outside. The last
stage also holds Y_d, its output, beside what the head keeps.

Checked against the autograd probe (parallel/strategies/memory_probe.py, which counts the
buffer and the streams a checkpoint keeps in a tuple) in tests/test_memory_mudd.py, the
whole model and each pipeline stage.
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


def block_bytes(model: DenseFormerConfig, shape) -> int:
    """Bytes one non-checkpointed block keeps besides its input: H and its two halves."""
    layout = model.mudd_layout
    attention = _qkvr_attention(model, shape) if layout.streams == "qkvr" \
        else shape.attention_branch
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


def mudd_stage_terms(model: DenseFormerConfig, shape, mode: str, program,
                     boundary_bytes: int) -> dict[str, int]:
    """Bytes of one micro-batch on one pipeline stage, by term (module docstring); `program`
    its StageProgram (mudd_program.py), `boundary_bytes` the element size of what crosses a
    boundary (parallel.pipeline_dtype). `mode`: `none` or `block` (each block a
    checkpoint)."""
    layout = model.mudd_layout
    d, first, last = layout.n_layers, program.first, program.last
    x = shape.stream_tensor
    p = shape.precision
    received = {(item.index, item.kind) for item in program.incoming
                if item.kind.startswith("mudd_")}
    summed = {i for i, _ in received}  # the mixes whose received partial sums it adds
    lo = first if received else 0  # the first buffer slot its mixes read
    mixes = list(range(max(first - 1, 1), last)) + ([d] if program.is_last else [])
    slots = (last + 1) * x  # slots 0..last, allocated whatever is received
    terms = {"mudd_buffers": slots, "mudd_grad_buffers": slots}
    token_ids = 8 * shape.micro_batch * (shape.seq + 1)
    if program.is_first:  # as attnres_memory.attnres_stage_terms: the (B, S + 1) batch's
        # view, and under TP the shifted ids and the out-of-shard mask
        terms["token_ids"] = token_ids + (9 * shape.tokens if shape.tp > 1 else 0)
    # X_0 (block 1's input), and the X_i made here that a dynamic mix's RMSNorm saves.
    saves_x = layout.dynamic and p.stream == FP32
    held = ({0} if program.is_first else set()) | (
        {i for i in mixes if i >= first} if saves_x else set())
    terms["mudd_held"] = len(held) * x
    terms["mudd_mixes"] = sum(_mix_state(layout, i, shape) for i in mixes)
    # A static partial sum sent on is formed in plain ops (`functional_mix`): its matmul
    # saves the stack of the stage's X_lo..X_last, per stream.
    partial_out = [item for item in program.outgoing if item.kind.startswith("mudd_")]
    terms["mudd_mixes"] += len(partial_out) * (last - lo + 1) * x
    # What arrives is held as the stage's inputs, widened on receipt where narrower and
    # something keeps the widened tensor (the X_i a dynamic mix reads, a block's input).
    boundary = shape.tokens * shape.hidden * boundary_bytes // shape.seq_split
    narrow = boundary_bytes != p.stream
    kept_wide = {("x", first - 1)} if layout.dynamic else {
        (i, k) for i, k in received if i == first - 1}
    terms["received"] = sum(
        boundary + (x if narrow and (item.kind == "x" and ("x", item.index) in kept_wide
                                     or (item.index, item.kind) in kept_wide) else 0)
        for item in program.incoming)
    # What leaves besides what is kept anyway: the X_j made here that nothing saves, the
    # partial sums; each a copy when the boundary's dtype is not the stream's.
    sent_x = [item for item in program.outgoing if item.kind == "x"
              and (first <= item.index or narrow) and (item.index not in held or narrow)]
    terms["sent"] = (len(sent_x) + len(partial_out)) * boundary
    # Each block's input: M_{i-1}'s streams, one storage formed from the buffer (C stream
    # tensors); X_0 for block 1 (held); received sums as they came (block `first`); C
    # separate sums (received + own terms), of which a block keeps those it normalises
    # (not R under qkvr) and a checkpoint all (its input tuple).
    inputs = 0
    for i in range(first, last + 1):
        if i == 1 or (i == first and received):
            continue
        if i - 1 in summed and mode == "none" and layout.streams == "qkvr":
            inputs += 3 * x
        else:
            inputs += _input_bytes(layout, i, shape)
    n_blocks = last - first + 1
    block = block_bytes(model, shape)
    if mode == "none":
        terms["blocks"] = inputs + n_blocks * block
    else:
        terms["checkpoint_boundaries"] = inputs
        terms["recompute_working_set"] = block
    if program.is_last:  # Y_d, the stage's output, beside what the head keeps
        terms["lm_head"] = shape.head - token_ids + x
    return terms
