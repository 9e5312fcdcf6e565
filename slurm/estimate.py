"""A rough per-rank memory estimate for the sweep table (`python -m slurm sweep --dry-run`).

It is an estimate, not a measurement: it ignores allocator fragmentation, communication
buffers and the CUDA context, and assumes no activation checkpointing.

    states      = 16 bytes per parameter / tp   (fp32 weights 4 + gradients 4 + AdamW m, v 8)
    activations = per block  s * b * h * (34 + 5 * a * s / h) * bytes / 2
                               (Korthikanti et al. 2022, "Reducing activation recomputation",
                               written for 2-byte activations; divided by tp)
                + per DWA    2 * s * b * h * bytes     (stored block output + the average)
                + logits     s * b * V * (bytes + 8)   (logits, fp32 log-softmax and its grad)

with s the sequence length, b the micro-batch per rank, h the width, a the heads, V the
padded vocabulary and `bytes` 2 for bf16 (GPUs) or 4 for fp32 (CPU).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MemoryEstimate:
    """Bytes per rank."""

    states: float
    activations: float

    @property
    def total(self) -> float:
        return self.states + self.activations

    @property
    def total_gib(self) -> float:
        return self.total / 2**30


def estimate_memory(model, micro_batch: int, activation_bytes: int = 2,
                    tp: int = 1) -> MemoryEstimate:
    """Estimate for one rank; `model` is a DenseFormerConfig."""
    s, b, h, a = model.seq_len, micro_batch, model.d_model, model.n_heads
    states = 16.0 * model.num_params() / tp
    per_block = s * b * h * (34 + 5 * a * s / h) * activation_bytes / 2 / tp
    dwa_blocks = model.n_layers // model.dwa_period if model.dwa else 0
    dwa = dwa_blocks * 2.0 * s * b * h * activation_bytes
    logits = s * b * model.padded_vocab_size * (activation_bytes + 8) / tp
    return MemoryEstimate(states=states,
                          activations=model.n_layers * per_block + dwa + logits)
