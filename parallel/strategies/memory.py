"""Memory per rank from the config alone: parameters, gradients, optimizer state, activations.

    python -m parallel.memory (--config FILE | --run DIR) [--set key=value ...]
        [--world-size N] [--json] [--inference --batch B --context T [--prompt P]]

Pure arithmetic (no model is built, torch is not imported), fast for the paper shapes; the
sweep dry run (`python -m slurm sweep --dry-run`) shows its largest per-rank total.
Which X_j the DWAs keep comes from the model config's `DWAPattern` (`stored`, `inputs`).
For every rank of the TP x DP x PP grid (rank = tp + TP (dp + DP pp)) it prints:

- parameters, gradients and AdamW state after ZeRO partitioning (parallel/strategies/zero.py).
  Without ZeRO: fp32 parameters and gradients (bf16 runs autocast), AdamW's two fp32 moments. With
  ZeRO (DeepSpeed): parameters and gradients in the training dtype, plus an fp32 master copy
  and the two moments, 12 bytes per element of this rank's partition. Stages 1 and 2
  partition each weight-decay group's flat buffer (padded to a multiple of 2 x DP elements);
  stage 2 also the gradients; stage 3 also the parameters (each tensor split into DP pieces).
- activations of the micro-batches in flight (one without PP; min(PP - s, M) on pipeline
  stage s under 1F1B), per activation-checkpointing mode (parallel/strategies/checkpointing.py):
  the stored X_j (the DWA buffers), checkpoint boundaries (unit inputs), every block's
  internals when nothing is recomputed, the LM head (the chunked loss keeps the gradients
  it computes in its forward, dL/dh and dL/dW, never the logits), received cross-stage
  tensors under PP, and one unit's recompute working set.
- for Attention Residuals (`model.connection: attnres`) instead of the DWA buffers: the held
  X_j and the mixes' saved state per checkpointing mode (parallel/strategies/attnres_memory.py),
  per pipeline stage also the boundary tensors it receives and sends (the lse in fp32).
- for MUDD (`model.connection: mudd`) its buffer of X_0..X_d and the buffer's gradient,
  the X_j kept beside it, the dynamic mixes' saved state and the blocks'
  (parallel/strategies/mudd_memory.py); per pipeline stage the buffer's slots 0..last and
  the raw X_j or static partial sums it receives and sends.
- for Hyper-Connections (`model.connection: hc` or `mhc`) the n-stream states kept (every
  sub-layer's input state, or the checkpoint units'), the per-token weights the mixes save
  and the sub-layers' branches (parallel/strategies/hc_memory.py); per pipeline stage the
  one state it receives and sends.
- under bf16 autocast, the bf16 copies of the block weights that autocast caches for the
  whole step (`autocast_weight_copies`), and on the last stage the chunked loss's working
  set (`loss_working_set`), both in the total.

A block keeps (11 + 2 r) hidden-size tensors when it is not checkpointed (r = mlp_ratio):
its input, the two LayerNorm outputs, the residual h, q and k after RoPE, the qkv output
(3, v is a view of it), the attention output and the contiguous copy of it that the output
projection reads, the MLP's up-projection and GELU outputs (r each); under TP everything but
the LayerNorm region is split; under sequence parallelism that region too. Plus LayerNorm
statistics and the attention log-sum-exp. Llama blocks (`model.block: llama`) keep SwiGLU's
four ffn-wide tensors (gate, up, silu, product) instead of two, narrower k and v under
grouped-query attention (plus, in a narrower matmul dtype, the copies SDPA's CPU path
repeats them into: `ActivationShape.gqa_repeats`), and one more tensor per RMSNorm.
The LM head keeps Y_d, the norm's statistics, dL/dh (B x S x H) and dL/dW (V / TP x H).
Checked against autograd (parallel/strategies/memory_probe.py) at fp32 on CPU, exactly:
tests/test_memory.py. Under autocast the residual stream and LayerNorm inputs stay fp32 and
the matmul operands are bf16; with DeepSpeed's bf16 everything is.

JSON (`--json`, stdout holds only the document):
    {"ranks": [{"rank": r, "tp_rank": t, "pp_rank": s, "dp_rank": q, "params_bytes": ..,
                "grads_bytes": .., "optimizer_bytes": .., "activation_bytes": ..,
                "autocast_copies_bytes": .., "loss_working_set_bytes": ..,
                "total_bytes": ..}, ...]}

`--run DIR` reads a run directory's config.yaml instead of --config, and a null vocabulary
from the run's tokenizer as `pretrain.load` finds it (that imports torch). `--inference`
estimates generation instead (parallel/strategies/inference_memory.py: every rank in one TP group of
--world-size ranks, default 1): weights, KV cache, the DWA state at prefill and at decode,
and the logits of B sequences in a context of T slots; bf16 autocast with --device cuda,
fp32 with cpu. Its JSON:
    {"inference": {"batch", "context", "prompt", "dtype", "tp"}, "ranks": [{"rank",
     "weights_bytes", "weight_copies_bytes", "kv_cache_bytes", "dwa_decode_bytes",
     "dwa_prefill_peak_bytes", "logits_bytes", "prefill_total_bytes",
     "decode_total_bytes"}, ...]}
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from parallel.strategies.attnres_memory import attnres_activation_terms, attnres_stage_terms
from parallel.strategies.config import ParallelSection
from parallel.strategies.hc_memory import hc_activation_terms, hc_stage_terms
from parallel.strategies.mudd_memory import mudd_activation_terms, mudd_stage_terms
from parallel.strategies.plan import (
    boundary_dtype_bytes,
    build_plan,
    micro_batch_size,
    resolved_dtype,
)
from pretrain.model.config import DenseFormerConfig

FP32 = 4


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of tensor."""

    param: int  # model parameters (and their gradients)
    stream: int  # residual stream: X_j, Y_i, block inputs, LayerNorm inputs
    matmul: int  # matmul operands and outputs, attention, MLP activations
    dwa: int | None = None  # the X_j the DWAs store (model.dwa_dtype); None: as `stream`

    @classmethod
    def of(cls, dtype: str, zero_stage: int, dwa_dtype: str = "fp32") -> "Precision":
        if dtype == "fp32":
            param, stream, matmul = FP32, FP32, FP32
        elif zero_stage > 0:  # DeepSpeed's bf16: the module itself is bf16
            param, stream, matmul = 2, 2, 2
        else:  # autocast
            param, stream, matmul = FP32, FP32, 2
        return cls(param, stream, matmul, min(stream, 2) if dwa_dtype == "bf16" else stream)


@dataclass
class RankMemory:
    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    activations: dict[str, int] = field(default_factory=dict)  # breakdown, for the text
    # bf16 copies of the fp32 matmul weights that autocast casts once and keeps for the step
    autocast_copies_bytes: int = 0
    # what the chunked loss allocates for one chunk on top of the kept activations
    loss_working_set_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + \
            self.activation_bytes + self.autocast_copies_bytes + self.loss_working_set_bytes

    def as_json(self) -> dict:
        return {"rank": self.rank, "tp_rank": self.tp_rank, "pp_rank": self.pp_rank,
                "dp_rank": self.dp_rank, "params_bytes": self.params_bytes,
                "grads_bytes": self.grads_bytes, "optimizer_bytes": self.optimizer_bytes,
                "activation_bytes": self.activation_bytes,
                "autocast_copies_bytes": self.autocast_copies_bytes,
                "loss_working_set_bytes": self.loss_working_set_bytes,
                "total_bytes": self.total_bytes}

    def dominant(self) -> tuple[str, float]:
        terms = {"parameters": self.params_bytes, "gradients": self.grads_bytes,
                 "optimizer state": self.optimizer_bytes, "activations": self.activation_bytes,
                 "autocast weight copies": self.autocast_copies_bytes,
                 "loss working set": self.loss_working_set_bytes}
        name = max(terms, key=terms.get)
        return name, terms[name] / max(1, self.total_bytes)


# ---------------------------------------------------------------------------------------------
# Parameters, gradients, optimizer state


def local_parameters(model: DenseFormerConfig, tp: int, blocks: range, first: bool, last: bool,
                     decay_alphas: bool) -> dict[str, list[int]]:
    """Element counts of this rank's parameter tensors, by AdamW group ("decay" /
    "no_decay", as pretrain.optim.param_groups), in the model's parameter order."""
    h, ffn = model.d_model, model.ffn_width
    qkv = (model.n_heads + 2 * model.kv_heads) * model.head_dim  # grouped-query: fewer k, v
    mlp_in = 2 if model.block == "llama" else 1  # SwiGLU: gate and up
    decay, no_decay = [], []
    pattern = model.dwa_pattern
    if pattern.inputs:  # every rank holds the full alpha matrix
        (decay if decay_alphas else no_decay).append(math.prod(pattern.alpha_shape))
    if model.attnres_layout is not None:  # AttnRes queries and key norms, on every rank
        per_matrix = model.attnres_layout.n_params(h) // 2
        (decay if decay_alphas else no_decay).extend([per_matrix, per_matrix])
    mudd = model.mudd_layout
    if mudd is not None:
        # MUDD's weights: static, every a_i on every rank (stages apply columns of a_i);
        # dynamic, (a_i, W1_i, W2_i) of the mixes this rank's stages form, M_{first-1}..
        # M_{last-1} per stage and M_d on the last (parallel/strategies/stage_model.py).
        mixes = range(1, model.n_layers + 1) if not mudd.dynamic else sorted(
            {i - 1 for i in blocks if i > 1} | ({model.n_layers} if last else set()))
        for i in mixes:
            k = mudd.width(i)
            (decay if decay_alphas else no_decay).extend(
                [k, k * h, k * k] if mudd.dynamic else [k])
    hc = model.hc_layout
    if hc is not None:  # Hyper-Connections' weights per sub-layer, on every rank
        n, subs = hc.streams, hc.n_sublayers
        sizes = [n * h * hc.n_weights, 3, hc.n_weights] if hc.kind == "mhc" else \
            [n, n * n, n] + ([h * (n + 2), 2] if hc.dynamic else [])
        (decay if decay_alphas else no_decay).extend(subs * size for size in sizes)
    embedding = model.padded_vocab_size * h // tp
    if first or (last and model.tie_embeddings):
        decay.append(embedding)  # the embedding (and the tied LM head)
    for _ in blocks:
        no_decay.append(h)  # norm_attn
        decay.extend([qkv * h // tp, h * h // tp])  # qkv, proj
        no_decay.append(h)  # norm_mlp
        decay.extend([ffn * h // tp] * mlp_in + [ffn * h // tp])  # fc_in (gate, up), fc_out
        if mudd is not None:
            no_decay.extend([h] * mudd.block_norms)  # the key and value inputs' norms
        if model.skip_gains:
            no_decay.extend([1, 1])
    if last:
        no_decay.append(h)  # final norm
        if not model.tie_embeddings:
            decay.append(embedding)  # the untied LM head
    return {"decay": decay, "no_decay": no_decay}


def zero12_partition(numel: int, dp: int) -> int:
    """Elements of one rank's partition of a flat ZeRO-1/2 group (DeepSpeed pads the flat
    buffer to a multiple of 2 x DP elements)."""
    align = 2 * dp
    return math.ceil(numel / align) * align // dp


def state_bytes(groups: dict[str, list[int]], zero_stage: int, dp: int,
                precision: Precision) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes of one rank."""
    tensors = [n for sizes in groups.values() for n in sizes]
    full = sum(tensors)
    if zero_stage == 0:
        return full * precision.param, full * precision.param, 2 * FP32 * full
    if zero_stage == 3:
        partition = sum(math.ceil(n / dp) for n in tensors)
        return (partition * precision.param, partition * precision.param,
                3 * FP32 * partition)
    partition = sum(zero12_partition(sum(sizes), dp) for sizes in groups.values() if sizes)
    grads = partition if zero_stage == 2 else full
    return full * precision.param, grads * precision.param, 3 * FP32 * partition


def autocast_weight_copies(model: DenseFormerConfig, tp: int, n_blocks: int,
                           precision: Precision) -> int:
    """Bytes of autocast's low-precision copies of this rank's block matmul weights (qkv,
    proj, the MLP's): under autocast each fp32 weight is cast once per autocast region (the
    trainer's step) and the copy is cached until it ends. The embedding is not cast, and the
    LM head's cast is the chunked loss's, counted in its working set."""
    if precision.param == precision.matmul:
        return 0
    h, ffn = model.d_model, model.ffn_width
    qkv = (model.n_heads + 2 * model.kv_heads) * model.head_dim
    if model.mudd_layout is not None and model.mudd_layout.streams == "qkvr":
        qkv = 0  # its rows are cast per call, saved by each block (mudd_memory.py)
    mlp = (3 if model.block == "llama" else 2) * ffn * h
    return n_blocks * (qkv * h + h * h + mlp) // tp * precision.matmul


def loss_working_set(model: DenseFormerConfig, shape: "ActivationShape") -> int:
    """Bytes the chunked loss (pretrain/model/loss.py) allocates in its forward beyond what
    it keeps (dL/dh, dL/dW: `ActivationShape.head`), at its largest, the last chunk: the
    chunk's fp32 logits (turned into probabilities and G in place), their matmul-dtype
    product and G's matmul-dtype copy when that dtype is narrower, the head weight cast to
    the matmul dtype, one chunk of dL/dW as the matmul makes it, and dL/dh's chunks before
    they are joined and widened. Under sequence parallelism also the gathered sequence."""
    p = shape.precision
    tokens = shape.tokens  # of the whole sequence: under SP the loss gathers it
    chunk = min(model.loss_chunk_tokens, tokens)
    vocab = shape.padded_vocab // shape.tp
    narrow = p.matmul < FP32
    logits = chunk * vocab * (FP32 + (2 * p.matmul if narrow else 0))
    cast = p.matmul if p.matmul != p.param else 0
    own_chunk = narrow or chunk < tokens  # else the one dL/dW chunk is dL/dW itself
    weight = vocab * shape.hidden * (cast + (p.matmul if own_chunk else 0))
    parts = tokens * shape.hidden * p.matmul
    grad_hidden = (parts if p.matmul != p.stream else 0) + (parts if chunk < tokens else 0)
    gathered = tokens * shape.hidden * p.stream if shape.sequence_parallel else 0
    return logits + weight + grad_hidden + gathered


# ---------------------------------------------------------------------------------------------
# Activations of one micro-batch


@dataclass(frozen=True)
class ActivationShape:
    micro_batch: int
    seq: int
    hidden: int
    heads: int
    mlp_ratio: int
    padded_vocab: int
    vocab: int
    tp: int
    sequence_parallel: bool
    precision: Precision
    kv_heads: int | None = None  # None: heads (no grouped-query attention)
    ffn: int | None = None  # the MLP's hidden width; None: mlp_ratio x hidden
    llama: bool = False  # SwiGLU and RMSNorm (model.block llama)

    @property
    def tokens(self) -> int:  # B x S
        return self.micro_batch * self.seq

    @property
    def seq_split(self) -> int:  # the LayerNorm region is split along S under SP
        return self.tp if self.sequence_parallel else 1

    @property
    def stream_tensor(self) -> int:
        """Bytes of one residual-stream tensor (an X_j, a Y_i, a block input)."""
        return self.tokens * self.hidden * self.precision.stream // self.seq_split

    @property
    def stored_tensor(self) -> int:
        """Bytes of one X_j as the DWA buffers store it (model.dwa_dtype)."""
        dwa = self.precision.dwa or self.precision.stream
        return self.tokens * self.hidden * dwa // self.seq_split

    @property
    def block(self) -> int:
        """Bytes one non-checkpointed block keeps."""
        s, p = self.tokens * self.hidden, self.precision
        norm_region = (2 * p.stream + 2 * p.matmul) * s // self.seq_split  # x, h, 2 LN outs
        ffn = self.tokens * (self.ffn or self.mlp_ratio * self.hidden)
        # The MLP's inputs to its nonlinearity and fc_out: GELU's 2, SwiGLU's 4 (gate, up,
        # silu, product).
        split = (self._attention_elements + (4 if self.llama else 2) * ffn) * p.matmul // self.tp
        split += self.gqa_repeats
        # Per token: mean and rstd of two LayerNorms, or the rstd of two RMSNorms, whose
        # composite form also keeps the normalised input beside its output (one tensor each).
        stats = (2 if self.llama else 4) * FP32 * self.tokens // self.seq_split
        if self.llama:
            norm_region += 2 * p.stream * s // self.seq_split
        lse = FP32 * self.tokens * (self.heads // self.tp)
        return norm_region + split + stats + lse

    @property
    def _attention_elements(self) -> int:
        """Elements the attention keeps (besides the repeated k and v, `gqa_repeats`): q, k
        after RoPE, the qkv output (q, k, v), the attention output and the (tokens, H)
        contiguous copy of it that the output projection reads."""
        s = self.tokens * self.hidden
        kv = s * (self.kv_heads or self.heads) // self.heads  # one k (or v) tensor
        return s + kv + (s + 2 * kv) + s + s

    @property
    def gqa_repeats(self) -> int:
        """Bytes of the copies of k and v repeated to every query head that SDPA's CPU path
        keeps under grouped-query attention in a narrower matmul dtype (bf16: measured);
        fp32 SDPA on torch 2.13 takes k and v as they are (measured), and fused GPU kernels
        need not repeat them."""
        if self.precision.matmul >= FP32:
            return 0
        s = self.tokens * self.hidden
        kv = s * (self.kv_heads or self.heads) // self.heads
        return 2 * (s - kv) * self.precision.matmul // self.tp

    @property
    def attention_branch(self) -> int:
        """Bytes the attention half of a block run alone (an AttnRes branch) keeps besides
        its input: the norm's output and statistics, q and k after RoPE, the qkv output, the
        attention output and the (tokens, H) copy of it that the projection reads, and the
        repeated k and v where they are kept (`gqa_repeats`)."""
        attention = self._attention_elements * self.precision.matmul // self.tp
        return attention + self.gqa_repeats + FP32 * self.tokens * (self.heads // self.tp) + \
            self._norm_half

    @property
    def mlp_branch(self) -> int:
        """Bytes the MLP half of a block run alone keeps besides its input: the norm's
        output and statistics, the MLP's inputs to its nonlinearity and to fc_out."""
        ffn = self.tokens * (self.ffn or self.mlp_ratio * self.hidden)
        return (4 if self.llama else 2) * ffn * self.precision.matmul // self.tp + \
            self._norm_half

    @property
    def _norm_half(self) -> int:
        """One norm's output and statistics (and RMSNorm's normalised input)."""
        s, p = self.tokens * self.hidden // self.seq_split, self.precision
        stats = (1 if self.llama else 2) * FP32 * self.tokens // self.seq_split
        return p.matmul * s + stats + (p.stream * s if self.llama else 0)

    @property
    def head(self) -> int:
        """Bytes the final norm and the chunked LM-head loss keep (plus the token ids): Y_d
        and the norm's statistics, and the loss's gradients computed in its forward
        (pretrain/model/loss.py): dL/dh, a stream tensor of the whole (under sequence
        parallelism gathered) sequence, and dL/dW, the head's (V / TP, H) shard."""
        s, p = self.tokens * self.hidden, self.precision
        normed = p.stream * s // self.seq_split  # Y_d
        if self.llama:  # RMSNorm's composite form keeps the normalised input too
            normed *= 2
        stats = (1 if self.llama else 2) * FP32 * self.tokens // self.seq_split
        grad_hidden = p.stream * s
        grad_weight = p.param * self.padded_vocab // self.tp * self.hidden
        ids = 8 * self.micro_batch * (self.seq + 1)  # a view of the loaded (B, S + 1) batch
        return normed + stats + grad_hidden + grad_weight + ids

def unit_ranges(n_layers: int, every: int, blocks: range | None = None) -> list[range]:
    """Checkpoint units (parallel.strategies.checkpointing.ActivationCheckpointing.units)."""
    blocks = blocks or range(1, n_layers + 1)
    return [range(a, min(a + every, blocks.stop)) for a in range(blocks.start, blocks.stop,
                                                                   every)]


def activation_terms(model: DenseFormerConfig, shape: ActivationShape, mode: str,
                     every: int) -> dict[str, int]:
    """Bytes of one micro-batch through the whole model (no PP), by term."""
    if model.attnres_layout is not None:
        return attnres_activation_terms(model, shape, mode,
                                        unit_ranges(model.n_layers, every))
    if model.mudd_layout is not None:
        return mudd_activation_terms(model, shape, mode, unit_ranges(model.n_layers, every))
    if model.hc_layout is not None:
        return hc_activation_terms(model, shape, mode, unit_ranges(model.n_layers, every))
    pattern = model.dwa_pattern
    terms = {"dwa_buffers": len(pattern.stored) * shape.stored_tensor, "lm_head": shape.head}
    units = unit_ranges(model.n_layers, every)
    if mode == "none":
        terms["blocks"] = model.n_layers * shape.block
        return terms
    kept_inputs, working = 0, 0
    for unit in units:
        entry = unit.start - 1  # the unit's input is Y_entry
        recomputed = mode == "dwa_block" and (pattern.has_dwa(entry)
                                              or entry in pattern.last_reader)
        kept_inputs += 0 if recomputed else 1
        working = max(working, len(unit) * shape.block
                      - (0 if recomputed else shape.stream_tensor))
    terms["checkpoint_boundaries"] = kept_inputs * shape.stream_tensor
    terms["recompute_working_set"] = working
    return terms


def rank_terms(stage_terms, model: DenseFormerConfig, shape: ActivationShape, mode: str,
               programs: list, boundary_bytes: int, in_flight: int) -> dict[str, int]:
    """Bytes on one pipeline rank under 1F1B for a connection with its own `stage_terms`
    (attnres_memory.py, mudd_memory.py, hc_memory.py): `in_flight` micro-batches of its
    stages (`programs`), one micro-batch's terms summed over them shown as "/microbatch" (not
    summed into the total again), and the largest recompute working set."""
    per_term, working = {}, 0
    for program in programs:
        terms = stage_terms(model, shape, mode, program, boundary_bytes)
        working = max(working, terms.pop("recompute_working_set", 0))
        for name, value in terms.items():
            per_term[name] = per_term.get(name, 0) + value
    return {"in_flight_microbatches": in_flight,
            "stages": in_flight * sum(per_term.values()),
            **{f"{name}/microbatch": value for name, value in per_term.items()},
            "recompute_working_set": working}


def pipeline_activation_terms(model: DenseFormerConfig, shape: ActivationShape, mode: str,
                              every: int, pp: int, pp_rank: int, microbatches: int,
                              plan, boundary_bytes: int = FP32) -> dict[str, int]:
    """Bytes on pipeline rank `pp_rank` under 1F1B: its stages' blocks for each micro-batch
    in flight, the tensors each received, and one recompute working set. Approximate (the
    buffered DWA of each stage keeps a copy of every X_j its DWAs read, received or made
    there, as the whole model does). A tensor received in a narrower dtype than the stream
    (`boundary_bytes`: bf16 under parallel.pipeline_dtype compute) is held twice: as
    received, and widened to the stream dtype."""
    in_flight = min(pp - pp_rank, microbatches)
    stage_terms = {"attnres": attnres_stage_terms, "mudd": mudd_stage_terms,
                   "hc": hc_stage_terms, "mhc": hc_stage_terms}.get(model.depth_connection)
    if stage_terms is not None:  # the other connections' own terms, per stage of the rank
        programs = [plan.programs[s] for s in plan.stages_of_rank(pp_rank)]
        return rank_terms(stage_terms, model, shape, mode, programs, boundary_bytes, in_flight)
    received = shape.stream_tensor
    if boundary_bytes != shape.precision.stream:
        received += shape.stream_tensor * boundary_bytes // shape.precision.stream
    per_micro, working = 0, 0
    for s in plan.stages_of_rank(pp_rank):
        first, last = plan.stages[s]
        blocks = range(first, last + 1)
        # The X_j made on this stage that some DWA reads (all such DWAs come after block j),
        # and the received X_j that a DWA here reads (copied into this stage's DWA buffers).
        stored = {j for j in blocks if j in plan.pattern.last_reader}
        stored |= {j for terms in plan.programs[s].dwa_reads().values() for j in terms}
        per_micro += len(stored) * shape.stored_tensor
        if s > 0:
            count = plan.counts[s - 1]
            per_micro += count[plan.transfer] * received
        if s == plan.n_stages - 1:
            per_micro += shape.head
        if mode == "none":
            per_micro += len(blocks) * shape.block
        else:
            units = unit_ranges(model.n_layers, every, blocks)
            per_micro += len(units) * shape.stream_tensor
            working = max(working, max(len(u) for u in units) * shape.block
                          - shape.stream_tensor)
    return {"in_flight_microbatches": in_flight, "stages": in_flight * per_micro,
            "recompute_working_set": working}


# ---------------------------------------------------------------------------------------------
# The estimate


def estimate(parallel: ParallelSection, model: DenseFormerConfig, batch_size: int,
             dtype: str = "auto", world_size: int | None = None, device: str = "cuda",
             decay_alphas: bool = False) -> list[RankMemory]:
    """RankMemory of every rank of the layout: `parallel` the run's parallel section, `model`
    its model config (a null vocab_size raises naming model.vocab_size), `batch_size` and
    `dtype` train.batch_size and train.dtype, `decay_alphas` optim.decay_alphas; train.dtype
    auto resolves as on `device`."""
    p = parallel
    world = world_size or p.tp * p.pp
    dp = world // (p.tp * p.pp)
    precision = Precision.of(resolved_dtype(dtype, device), p.zero_stage, model.dwa_dtype)
    shape = ActivationShape(
        micro_batch=micro_batch_size(p, batch_size, world), seq=model.seq_len,
        hidden=model.d_model, heads=model.n_heads, mlp_ratio=model.mlp_ratio,
        kv_heads=model.kv_heads, ffn=model.ffn_width, llama=model.block == "llama",
        padded_vocab=model.padded_vocab_size, vocab=model.vocab_size, tp=p.tp,
        sequence_parallel=p.sequence_parallel, precision=precision)
    mode, every = p.activation_checkpointing, p.checkpoint_every
    plan = None
    if p.pp > 1:
        plan = build_plan(model, p.pp, p.virtual_stages, p.pp_split, p.pp_transfer)
    ranks = []
    for pp_rank in range(p.pp):
        if plan is None:
            blocks, first, last = range(1, model.n_layers + 1), True, True
            activations = activation_terms(model, shape, mode, every)
        else:
            stages = plan.stages_of_rank(pp_rank)
            blocks = [i for s in stages for i in range(plan.stages[s][0],
                                                       plan.stages[s][1] + 1)]
            first, last = 0 in stages, plan.n_stages - 1 in stages
            activations = pipeline_activation_terms(model, shape, mode, every, p.pp, pp_rank,
                                                    p.microbatches, plan,
                                                    boundary_dtype_bytes(p, dtype, device))
        groups = local_parameters(model, p.tp, blocks, first, last, decay_alphas)
        params, grads, optimizer = state_bytes(groups, p.zero_stage, dp, precision)
        copies = autocast_weight_copies(model, p.tp, len(blocks), precision)
        working = loss_working_set(model, shape) if last else 0
        activation = sum(v for k, v in activations.items() if k.endswith(
            ("buffers", "head", "blocks", "boundaries", "working_set", "stages", "held",
             "mixes")))
        for dp_rank in range(dp):
            for tp_rank in range(p.tp):
                ranks.append(RankMemory(
                    rank=tp_rank + p.tp * (dp_rank + dp * pp_rank), tp_rank=tp_rank,
                    pp_rank=pp_rank, dp_rank=dp_rank, params_bytes=params, grads_bytes=grads,
                    optimizer_bytes=optimizer, activation_bytes=activation,
                    activations=activations, autocast_copies_bytes=copies,
                    loss_working_set_bytes=working))
    return sorted(ranks, key=lambda r: r.rank)


def _gib(n: int) -> str:
    return f"{n / 2**30:8.3f} GiB"


def describe(parallel: ParallelSection, model: DenseFormerConfig,
             ranks: list[RankMemory]) -> list[str]:
    """Human-readable lines: the layout, then one block per distinct rank."""
    p, m = parallel, model
    arch = m.architecture
    lines = [f"{m.n_layers} blocks x {m.d_model} {arch}, seq {m.seq_len}; tp {p.tp}, pp {p.pp}, "
             f"dp {len(ranks) // (p.tp * p.pp)}; ZeRO {p.zero_stage}; activation "
             f"checkpointing {p.activation_checkpointing} (every {p.checkpoint_every})"]
    seen = set()
    for r in ranks:
        key = (r.pp_rank,)
        if key in seen:
            continue
        seen.add(key)
        name, share = r.dominant()
        same = [x.rank for x in ranks if x.pp_rank == r.pp_rank]
        lines.append(f"ranks {same[0]}..{same[-1]} (pipeline stage {r.pp_rank}; every TP/DP "
                     f"rank alike):" if len(same) > 1 else f"rank {r.rank}:")
        lines += [f"  parameters      {_gib(r.params_bytes)}",
                  f"  gradients       {_gib(r.grads_bytes)}",
                  f"  optimizer state {_gib(r.optimizer_bytes)}",
                  f"  activations     {_gib(r.activation_bytes)}"]
        lines += [f"    {k:24s} {_gib(v) if k != 'in_flight_microbatches' else v}"
                  for k, v in r.activations.items()]
        if r.autocast_copies_bytes:
            lines.append(f"  autocast weight copies {_gib(r.autocast_copies_bytes)}")
        if r.loss_working_set_bytes:
            lines.append(f"  loss working set {_gib(r.loss_working_set_bytes)}")
        lines += [f"  total           {_gib(r.total_bytes)}  (largest: {name}, {share:.0%})"]
    return lines
