"""Memory of generation per rank from the model config alone: weights, KV cache, DWA state
(or the X_j of Attention Residuals).

    python -m parallel.memory --config FILE --inference --batch B --context T
        [--prompt P]

Pure arithmetic (torch is not imported). Generation (pretrain/generation.py) runs every rank
as one tensor-parallel group (TP = the number of ranks; no pipeline, no data parallelism),
so all ranks hold the same amounts. For B sequences, a context of T slots (the KV cache's
capacity: the longest prompt plus the new tokens) and a prefill over P prompt tokens
(default T, the most a context of T allows), one rank holds:

- weights: its parameters in fp32 (`parallel.strategies.memory.local_parameters` of the whole model:
  every block, the tied embedding, the final norm, the full alpha matrix). Under bf16
  autocast (generation on a GPU) also `weight_copies`: autocast casts each matmul weight
  (qkv, proj, fc_in, fc_out, and the embedding in the LM head) to bf16 once and keeps that
  copy until the autocast region ends, which is the whole `generate` call.
- kv_cache: 2 x d x B x (n_kv_heads / TP) x T x head_dim elements, allocated in full at the
  prefill, in the qkv projection's output dtype (bf16 under autocast).
- dwa_decode: `DecodeDWAState`, len(pattern.stored) x B x d_model, the residual stream's
  dtype: fp32 also under autocast (a block output is the fp32 input plus a bf16 update).
- dwa_prefill_peak: `PrefillDWAState` at its fullest, `prefill_peak_tensors(pattern)` x B x
  P x d_model, the same dtype. Every TP rank holds the whole residual stream.
- Attention Residuals (`model.connection: attnres`) keep no state between decoding steps
  (the mix is per token): in both `dwa_decode` and `dwa_prefill_peak` they count the X_j
  the block program holds at its fullest, `AttnResLayout.peak_held()` (at most 2d + 1 for
  full AttnRes, N + 1 for N blocks), x B x d_model, over 1 token (a decoding step) or P
  tokens (the prefill).
- logits: the LM head's output for the newest position, B x padded vocabulary (gathered
  over TP, so every rank holds all of it), in the matmul dtype.

The prefill total is weights + weight copies + KV cache + DWA prefill peak + logits; the
decode total the same with the decoding DWA state instead. Not modelled: a block's
transient working set (attention scores, MLP intermediates), the RoPE tables and the alpha
mask (module buffers), the sampler's fp32 copy of the logits, and the allocator's rounding.
Checked against measured bytes at fp32 on CPU: tests/test_inference_memory.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.model.config import DenseFormerConfig
from pretrain.model.dwa_pattern import DWAPattern
from pretrain.model.program import model_program

FP32, BF16 = 4, 2


@dataclass(frozen=True)
class InferencePrecision:
    """Bytes per element of each kind of tensor in generation."""

    name: str
    weights: int  # the parameters (the model is built in fp32)
    weight_copies: int  # autocast's cached low-precision matmul weights; 0 without autocast
    stream: int  # the residual stream: X_j, the DWA states
    matmul: int  # matmul outputs: keys and values, logits

    @classmethod
    def of(cls, dtype: str) -> InferencePrecision:
        """"bf16": autocast on a GPU, as `generate` runs there; "fp32": the CPU."""
        if dtype == "bf16":
            return cls("bf16", FP32, BF16, FP32, BF16)
        if dtype == "fp32":
            return cls("fp32", FP32, 0, FP32, FP32)
        raise ValueError(f"inference dtype must be bf16 or fp32, got {dtype!r}")


@dataclass(frozen=True)
class InferenceMemory:
    """Bytes one rank holds while generating (`total` of the prefill and of a decode step)."""

    rank: int
    weights_bytes: int
    weight_copies_bytes: int
    kv_cache_bytes: int
    dwa_decode_bytes: int
    dwa_prefill_peak_bytes: int
    logits_bytes: int

    @property
    def prefill_total_bytes(self) -> int:
        return self.weights_bytes + self.weight_copies_bytes + self.kv_cache_bytes + \
            self.dwa_prefill_peak_bytes + self.logits_bytes

    @property
    def decode_total_bytes(self) -> int:
        return self.weights_bytes + self.weight_copies_bytes + self.kv_cache_bytes + \
            self.dwa_decode_bytes + self.logits_bytes

    def as_json(self) -> dict:
        return {"rank": self.rank, "weights_bytes": self.weights_bytes,
                "weight_copies_bytes": self.weight_copies_bytes,
                "kv_cache_bytes": self.kv_cache_bytes, "dwa_decode_bytes": self.dwa_decode_bytes,
                "dwa_prefill_peak_bytes": self.dwa_prefill_peak_bytes,
                "logits_bytes": self.logits_bytes,
                "prefill_total_bytes": self.prefill_total_bytes,
                "decode_total_bytes": self.decode_total_bytes}


def prefill_peak_tensors(pattern: DWAPattern) -> int:
    """The most X_j a prefill holds at once: the liveness of the model's block program
    (pretrain/model/program.py), which `DenseFormer.forward_cached` runs with
    `PrefillDWAState`: X_j held from the block that makes it to its last reader."""
    return model_program(pattern).peak_held()


def held_tensors(model: DenseFormerConfig) -> tuple[int, int]:
    """(decoding, prefill peak): how many hidden-size tensors per token and sequence the
    depth connection holds, `len(pattern.stored)` and `prefill_peak_tensors` for the DWA,
    the program's peak for Attention Residuals (both: no state outlives a step)."""
    layout = model.attnres_layout
    if layout is not None:
        return layout.peak_held(), layout.peak_held()
    pattern = model.dwa_pattern
    return len(pattern.stored), prefill_peak_tensors(pattern)


def estimate_inference(model: DenseFormerConfig, parameters: dict[str, list[int]], tp: int,
                       batch: int, context: int, prompt: int | None = None,
                       dtype: str = "bf16") -> list[InferenceMemory]:
    """InferenceMemory of each of the `tp` ranks. `parameters`: one rank's parameter element
    counts by group, `parallel.strategies.memory.local_parameters(model, tp, every block, True,
    True, decay_alphas=False)`: "decay" holds exactly the matmul weights that autocast copies.
    ValueError naming the option if a size is out of range."""
    prompt = context if prompt is None else prompt
    if tp < 1 or model.n_heads % tp or model.padded_vocab_size % tp:
        raise ValueError(f"--world-size: {tp} ranks cannot split the model's {model.n_heads} "
                         f"heads and {model.padded_vocab_size} vocabulary rows evenly "
                         "(generation runs every rank as one TP group)")
    if batch < 1:
        raise ValueError(f"--batch must be >= 1, got {batch}")
    if not 1 <= context <= model.seq_len:
        raise ValueError(f"--context must be in [1, model.seq_len = {model.seq_len}], "
                         f"got {context}")
    if not 1 <= prompt <= context:
        raise ValueError(f"--prompt must be in [1, --context = {context}], got {prompt}")
    bytes_ = InferencePrecision.of(dtype)
    h = model.d_model
    decode_tensors, prefill_tensors = held_tensors(model)
    weights = sum(sum(sizes) for sizes in parameters.values())
    kv = 2 * model.n_layers * batch * (model.kv_heads // tp) * context * model.head_dim
    per_rank = dict(
        weights_bytes=weights * bytes_.weights,
        weight_copies_bytes=sum(parameters["decay"]) * bytes_.weight_copies,
        kv_cache_bytes=kv * bytes_.matmul,
        dwa_decode_bytes=decode_tensors * batch * h * bytes_.stream,
        dwa_prefill_peak_bytes=prefill_tensors * batch * prompt * h * bytes_.stream,
        logits_bytes=batch * model.padded_vocab_size * bytes_.matmul)
    return [InferenceMemory(rank=rank, **per_rank) for rank in range(tp)]


def _mib(n: int) -> str:
    return f"{n / 2**20:12.3f} MiB"


def describe_inference(model: DenseFormerConfig, ranks: list[InferenceMemory], batch: int,
                       context: int, prompt: int, dtype: str) -> list[str]:
    """Human-readable lines: the shape and request, then one table (every rank alike)."""
    arch = model.architecture + (f" (last {model.dwa_window})"
                                 if model.has_dwa and model.dwa_window else "")
    r = ranks[0]
    who = f"ranks 0..{len(ranks) - 1} (one TP group, every rank alike)" if len(ranks) > 1 \
        else "rank 0"
    lines = [f"{model.n_layers} blocks x {model.d_model} {arch}; inference: batch {batch}, "
             f"context {context}, prompt {prompt}, {dtype}, tp {len(ranks)}",
             f"{who}:",
             f"  weights                {_mib(r.weights_bytes)}"]
    if r.weight_copies_bytes:
        lines.append(f"  autocast weight copies {_mib(r.weight_copies_bytes)}")
    state = "AttnRes X_j" if model.attnres_layout is not None else "DWA state"
    lines += [f"  KV cache               {_mib(r.kv_cache_bytes)}",
              f"  {state + ', prefill':<22} {_mib(r.dwa_prefill_peak_bytes)}  (peak)",
              f"  {state + ', decode':<22} {_mib(r.dwa_decode_bytes)}",
              f"  logits                 {_mib(r.logits_bytes)}",
              f"  total at prefill       {_mib(r.prefill_total_bytes)}",
              f"  total at decode        {_mib(r.decode_total_bytes)}"]
    return lines
