"""What Attention Residuals keep for backward, per activation-checkpointing mode: the
activation terms of parallel/strategies/memory.py for `model.connection: attnres`.

Plain arithmetic over the layout (pretrain/model/attnres_layout.py: sub-layers 1..L, L = 2d,
consumers 1..L + 1, groups of S sub-layers, X_j the held running sums). Per token and rank
(the mix is per token: under sequence parallelism it runs on this rank's sequence slice):

- the held X_j: X_0 (the embedding, a stream tensor) and X_1..X_L (branch outputs and their
  group sums: the matmul dtype under autocast, else the stream's);
- per mixed span of consumers (attnres_mix.py `group_prefix`: the n consumers of one group
  that one run mixes, sharing its g completed sums): the logits s and weights a (g x n) and
  the RMS factors r (g), fp32 (the weighted means o_k are freed once merged);
- per merge (`merge_partial`): the per-token w, r and s_p, fp32, and its output h, fp32,
  which is the mix output (counted with the branch that reads it) unless the stream is
  narrower (a bf16 module: the mix output is h cast to bf16);
- the effective queries w_c * g_c, (L + 1, H) in the parameters' dtype, once.

A block runs as its two branches (`ActivationShape.attention_branch`, `mlp_branch`), each
keeping its input, the mix output (a stream tensor: the mix casts to its sources' dtype).

Modes (parallel/strategies/checkpointing.py, units of n blocks = 2n sub-layers):

- `none`: every X_j, every span of a whole group, every block's internals.
- `dwa_block`: a unit recomputes its entry mix, so autograd keeps only the X_j that cross a
  unit boundary (those a consumer after the unit reads: each completed sum and the open
  group's partial sum at each boundary, each stored once) and the output mix (consumer
  L + 1, mixed outside every unit, a span of one). Recomputing a unit holds its blocks'
  internals, its X_j but the last, and the mixes of its consumers (spans end with the unit).
- `block`: as dwa_block, plus each unit's entry (its first consumer's mix output, kept as
  the checkpoint's input) and that mix's own state (a span of one, outside the unit).

A pipeline stage (`attnres_stage_terms`, the program of pretrain/model/attnres_program.py
run by parallel/strategies/stage_model.py) keeps, per micro-batch: the X_j it makes (X_0 too
on the first stage); what it receives, raw X_j or consumer states o_c and their fp32 lse
(n, tokens), held as its inputs, and widened to the stream's dtype on receipt where that is
narrower and something keeps the widened tensor; the mixes' state as above over the sources
it reads (a received state stands for the completed sums before the boundary; merging it
with the stage's own prefix, `merge_states`, keeps that prefix's o, a per-token weight, and
the prefix's lse where the merged lse is read); the states and lse it sends; and its
branches, counted as the two halves (`ActivationShape.attention_branch`, `mlp_branch`) plus
each branch's input, the mix output: all their internals with `none`; with `block` (the
pipeline checkpoints each branch, `StageModule._checkpointed`) the inputs and one branch's
recomputation. The last stage also holds Y_d, its output, until its backward.

Checked against the autograd probe (parallel/strategies/memory_probe.py) in
tests/test_memory_attnres.py, the whole model and each pipeline stage.
"""

from __future__ import annotations

from typing import Protocol

from pretrain.model.attnres_layout import AttnResLayout
from pretrain.model.config import DenseFormerConfig

FP32 = 4


class ActivationShape(Protocol):
    """What these terms read of parallel/strategies/memory.py's `ActivationShape` (which
    calls them: this module stays below it)."""

    tokens: int
    hidden: int
    micro_batch: int
    seq: int
    tp: int
    seq_split: int
    precision: object  # memory.Precision: param, stream, matmul bytes
    stream_tensor: int
    head: int
    block: int
    attention_branch: int
    mlp_branch: int


def _group_first(layout: AttnResLayout, c: int) -> int:
    """The index of the completed sum that opens consumer c's group (X_first)."""
    return (c - 1) // layout.group * layout.group


def mix_state_bytes(layout: AttnResLayout, consumers: range, last: int,
                    shape: ActivationShape) -> int:
    """Bytes the mixes of `consumers` (formed in order by one run whose prefix spans end by
    consumer `last`, 0: one consumer each) save, besides the X_j and the mix outputs."""
    tokens = shape.tokens // shape.seq_split
    width = shape.hidden
    size, made = layout.group, set()
    total = 0
    for c in consumers:
        first = _group_first(layout, c)
        if c not in made:
            end = max(c, min(first + size, last, layout.n_sublayers + 1))
            span = range(c, end + 1)
            made.update(span)
            g, n = first // size + 1, len(span)
            total += (2 * g * n + g) * tokens * FP32  # s, a (g x n) and r (g)
        if c - 1 != first:
            total += 3 * tokens * FP32  # merge: w, r, s_p
            if shape.precision.stream < FP32:  # its fp32 output beside the cast one
                total += tokens * width * FP32
    return total


def held_bytes(held: set[int], shape: ActivationShape) -> int:
    """Bytes of the X_j in `held`: X_0 a stream tensor, the others branch outputs (the
    matmul dtype under autocast)."""
    branch = shape.tokens * shape.hidden * shape.precision.matmul // shape.seq_split
    return sum(shape.stream_tensor if j == 0 else branch for j in held)


def crossing(layout: AttnResLayout, boundary: int) -> set[int]:
    """The X_j (j <= boundary) that a consumer after sub-layer `boundary` reads."""
    return {j for c in range(boundary + 1, layout.n_sublayers + 2)
            for j in layout.sources(c) if j <= boundary}


def attnres_activation_terms(model: DenseFormerConfig, shape: ActivationShape, mode: str,
                             units: list[range]) -> dict[str, int]:
    """Bytes of one micro-batch through a whole AttnRes model (no PP), by term; `units`: the
    checkpoint units' blocks (memory.py `unit_ranges`)."""
    layout = model.attnres_layout
    consumers = range(1, layout.n_sublayers + 2)
    final = layout.n_sublayers + 1
    queries = final * shape.hidden * shape.precision.param
    terms = {"lm_head": shape.head}
    if mode == "none":
        terms["attnres_held"] = held_bytes(set(range(final)), shape)
        terms["attnres_mixes"] = mix_state_bytes(layout, consumers, final, shape) + queries
        terms["blocks"] = model.n_layers * _block_bytes(shape)
        return terms
    held: set[int] = set()
    outside = [final]  # consumers mixed outside every unit
    working = 0
    for unit in units:
        first_sub, last_sub = 2 * unit.start - 1, 2 * unit[-1]
        held |= crossing(layout, last_sub)
        inside = range(first_sub + (mode == "block"), last_sub + 1)
        if mode == "block":
            outside.append(first_sub)
        made = held_bytes(set(range(first_sub, last_sub)), shape)  # all but the last
        unit_working = (len(unit) * _block_bytes(shape) + made
                        + mix_state_bytes(layout, inside, last_sub, shape))
        if mode == "block":
            unit_working -= shape.stream_tensor  # a kept input
        working = max(working, unit_working)
    terms["attnres_held"] = held_bytes(held, shape)
    terms["attnres_mixes"] = queries + sum(mix_state_bytes(layout, range(c, c + 1), 0, shape)
                                           for c in outside)
    if mode == "block":
        terms["checkpoint_boundaries"] = sum(shape.stream_tensor
                                             for u in units)
    terms["recompute_working_set"] = working
    return terms


def _block_bytes(shape: ActivationShape) -> int:
    """Bytes one non-checkpointed block keeps: its two branches and their inputs."""
    return 2 * shape.stream_tensor + shape.attention_branch + shape.mlp_branch


def _span_state(g: int, n: int, tokens: int) -> int:
    """Bytes `group_prefix` saves for n consumers over g sources: s, a (g x n), r (g)."""
    return (2 * g * n + g) * tokens * FP32


def _stage_mixes(layout: AttnResLayout, program, received: set[int],
                 shape: ActivationShape) -> tuple[int, set[int]]:
    """(bytes the mixes of a stage save, the consumers whose received state they merge
    with a prefix of their own): as `mix_state_bytes`, over the sources the stage reads."""
    tokens = shape.tokens // shape.seq_split
    last = 2 * program.last + int(program.is_last)  # the stage's last consumer
    sources = [step.input for step in program.steps] + list(program.outgoing_sources)
    total, mixed, merged = 0, set(), set()
    for src in sources:
        c, span, g = src.index, [], 0
        partial = src.kind == "attnres" and c - 1 != _group_first(layout, c)
        if src.kind == "attnres_state" and c not in mixed:  # every sent state at once
            span = [s.index for s in sources if s.kind == "attnres_state"]
            g = len(src.terms)
        elif src.kind == "attnres" and c not in mixed:
            first = _group_first(layout, c)
            end = max(c, min(first + layout.group, last, layout.n_sublayers + 1))
            span = list(range(c, end + 1))
            g = len(src.terms) - partial  # the partial sum is merged, not mixed
        mixed.update(span)
        if span and g:
            total += _span_state(g, len(span), tokens)
            own = [k for k in span if k in received]
            merged.update(own)
            if own:  # merge_states keeps the prefix's o (the span's) and its weight w, and
                # the prefix's lse where the merged lse is read (a merge, a sent state)
                total += (len(span) * shape.hidden + len(own)) * tokens * FP32
                if src.kind == "attnres_state" or any(
                        k - 1 != _group_first(layout, k) for k in own):
                    total += len(span) * tokens * FP32
        if partial:
            total += 3 * tokens * FP32  # merge_partial: w, r, s_p
            if shape.precision.stream < FP32:
                total += tokens * shape.hidden * FP32
    return total, merged


def attnres_stage_terms(model: DenseFormerConfig, shape: ActivationShape, mode: str,
                        program, boundary_bytes: int) -> dict[str, int]:
    """Bytes of one micro-batch on one pipeline stage, by term; `program` its StageProgram
    (attnres_program.py), `boundary_bytes` the element size of what crosses a boundary
    (parallel.pipeline_dtype). `mode`: `none` or `block` (a branch a checkpoint)."""
    layout = model.attnres_layout
    tokens = shape.tokens // shape.seq_split
    lo, hi = 2 * program.first - 1, 2 * program.last
    received = {item.index for item in program.incoming if item.kind == "state"}
    # The first stage also holds X_0 and the token ids its embedding saves (a view of the
    # loaded (B, S + 1) batch), which `shape.head` counts for the whole model.
    made = set(range(0 if program.is_first else lo, hi + 1))
    # Bytes per element of each X_j: X_0 and the received X_j are the stream's (widened on
    # receipt), and so is a partial sum made on one of them; the others are branch outputs
    # (and their sums) in the matmul dtype.
    raw = {item.index for item in program.incoming if item.kind == "x"}
    p = shape.precision
    itemsize = {j: p.stream for j in raw | {0}}
    for j in sorted(made - {0}):
        itemsize[j] = p.stream if layout.accumulates(j) and itemsize.get(j - 1) == p.stream \
            else p.matmul
    tensor = tokens * shape.hidden
    terms = {"attnres_held": sum(tensor * itemsize[j] for j in made)}
    token_ids = 8 * shape.micro_batch * (shape.seq + 1)
    if program.is_first:
        # Under TP the vocabulary-parallel embedding also saves its shifted ids (int64) and
        # the mask of ids outside this rank's shard (bool).
        terms["token_ids"] = token_ids + (9 * shape.tokens if shape.tp > 1 else 0)
    mixes, merged = _stage_mixes(layout, program, received, shape)
    terms["attnres_mixes"] = mixes + (layout.n_sublayers + 1) * shape.hidden * \
        shape.precision.param  # the effective queries

    # What arrives is held as the stage's inputs; in a narrower dtype than the stream also
    # widened, where something keeps the widened tensor: a raw X_j (the mixes read it), a
    # state merged here (a state a consumer only copies or merges its partial sum into is
    # not kept).
    boundary = tensor * boundary_bytes
    narrow = boundary_bytes != p.stream
    terms["received"] = sum(
        item.index * tokens * FP32 if item.kind == "lse" else
        boundary + (shape.stream_tensor if narrow and (item.kind == "x" or item.index in merged)
                    else 0)
        for item in program.incoming)
    # What leaves besides what is held anyway: the states and their lse, and a copy of an
    # X_j whose dtype the boundary's is not.
    terms["sent"] = sum(
        item.index * tokens * FP32 if item.kind == "lse" else boundary
        for item in program.outgoing
        if item.kind != "x" or itemsize[item.index] != boundary_bytes)

    # Each branch's input is its mix output: kept by the branch (`none`) or as the input of
    # its checkpoint (`block`, the pipeline's `_checkpointed`).
    inputs = (hi - lo + 1) * shape.stream_tensor
    n_blocks = program.last - program.first + 1
    if mode == "none":
        terms["blocks"] = inputs + n_blocks * (shape.attention_branch + shape.mlp_branch)
    else:
        terms["checkpoint_boundaries"] = inputs
        terms["recompute_working_set"] = max(shape.attention_branch, shape.mlp_branch)
    if program.is_last:
        # Y_d, the stage's output, which the schedule holds until its backward, besides
        # what the head keeps.
        terms["lm_head"] = shape.head - token_ids + shape.stream_tensor
    return terms
