"""Text generation: the KV cache, the sampling loop, and the uncached reference.

    completions = generate(model, [[2, 17, 5], [2, 9]], max_new_tokens=20, greedy=True)

Prompts of different lengths share one batch, left-padded: row b has `pad_b` padding slots,
then its prompt, so the last column is every row's newest token. Its tokens sit at positions
`slot - pad_b` (what RoPE sees, as in training) and attend to no padding slot. Every block keeps
the keys and values of all slots (`KVCache`); the DWAs need only the current tokens' block
outputs, which the model keeps itself (`DenseFormer.forward_cached`,
pretrain/model/dwa_inference.py).

A row stops at its EOS (finish_reason "eos"; the EOS is not part of the completion) or when it
has `max_new_tokens` new tokens, or else reaches the model's context `seq_len` (both "length").
`use_cache=False` runs the training forward (`model(tokens)`, no padding) over each row's
whole sequence at every step: the reference the cached path is tested against.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

FINISH_EOS = "eos"
FINISH_LENGTH = "length"


@dataclass
class Completion:
    tokens: list[int]  # the new ids, without the EOS that ended them
    finish_reason: str  # FINISH_EOS or FINISH_LENGTH


class LayerKVCache:
    """One block's keys and values, (B, heads on this TP rank, capacity, head_dim), allocated
    at the first append; the step's positions and mask come from the owning KVCache."""

    def __init__(self, owner: KVCache):
        self.owner = owner
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    positions = property(lambda self: self.owner.positions)
    mask = property(lambda self: self.owner.mask)
    is_causal = property(lambda self: self.owner.is_causal)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' k, v (B, heads, S, head_dim); all filled slots' k, v."""
        if self.keys is None:
            b, h, _, d = k.shape
            self.keys = k.new_zeros((b, h, self.owner.capacity, d))
            self.values = v.new_zeros((b, h, self.owner.capacity, d))
        start = self.owner.length
        stop = start + k.shape[2]
        self.keys[:, :, start:stop] = k
        self.values[:, :, start:stop] = v
        return self.keys[:, :, :stop], self.values[:, :, :stop]


class KVCache:
    """What a cached forward keeps between steps: every block's keys and values for
    `capacity` slots, the model's decoding DWA state (`dwa_decode`, set by the model), and the
    current step's RoPE positions (B, S), attention mask and causality flag."""

    def __init__(self, n_layers: int, capacity: int):
        self.capacity = capacity
        self.length = 0  # slots filled
        self.layers = [LayerKVCache(self) for _ in range(n_layers)]
        self.dwa_decode = None
        self.positions: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        self.is_causal = False

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values held (this TP rank's heads)."""
        return sum(t.numel() * t.element_size() for layer in self.layers
                   for t in (layer.keys, layer.values) if t is not None)


class _Batch:
    """Left-padded prompts and the per-row bookkeeping of positions and visible slots."""

    def __init__(self, prompts: list[list[int]], capacity: int, seq_len: int,
                 device: torch.device):
        self.width = max(len(p) for p in prompts)
        self.pads = torch.tensor([self.width - len(p) for p in prompts], device=device)
        self.tokens = torch.tensor([[0] * (self.width - len(p)) + p for p in prompts],
                                   device=device)
        self.padded = bool(self.pads.any())
        self.seq_len = seq_len
        slots = torch.arange(capacity, device=device)
        self.key_visible = slots[None, :] >= self.pads[:, None]  # (B, capacity)

    def positions(self, start: int, stop: int) -> torch.Tensor:
        """RoPE positions (B, stop - start) of slots [start, stop); padding and rows already
        past their context clamp into the table (their outputs are never used)."""
        slots = torch.arange(start, stop, device=self.pads.device)
        return (slots[None, :] - self.pads[:, None]).clamp(0, self.seq_len - 1)

    def prefill_mask(self) -> torch.Tensor | None:
        """(B, 1, P, P): causal and no padding key; a padding query sees itself (no empty
        row, which would make NaNs); None without padding (plain causal attention)."""
        if not self.padded:
            return None
        p = self.width
        causal = torch.ones(p, p, dtype=torch.bool, device=self.pads.device).tril()
        itself = torch.eye(p, dtype=torch.bool, device=self.pads.device)
        return (causal & (self.key_visible[:, None, :p] | itself))[:, None]

    def decode_mask(self, stop: int) -> torch.Tensor | None:
        """(B, 1, 1, stop): the slots the newest token sees; None without padding."""
        return self.key_visible[:, None, None, :stop] if self.padded else None


def context_budgets(lengths: list[int], seq_len: int, max_new_tokens: int | None) -> list[int]:
    """New tokens each prompt may get: max_new_tokens, or what is left of the context; a
    ValueError naming the problem if a prompt is empty or the request does not fit."""
    for n, length in enumerate(lengths):
        if length == 0:
            raise ValueError(f"prompt {n} is empty")
        if length > seq_len:
            raise ValueError(f"prompt {n} has {length} tokens, more than the model's context "
                             f"of {seq_len}")
    if max_new_tokens is None:
        return [seq_len - length for length in lengths]
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    longest = max(lengths)
    if longest + max_new_tokens > seq_len:
        raise ValueError(f"max_new_tokens {max_new_tokens} runs past the model's context: the "
                         f"longest prompt has {longest} tokens and seq_len is {seq_len} (at "
                         f"most {seq_len - longest} new tokens)")
    return [max_new_tokens] * len(lengths)


def sample_next(logits: torch.Tensor, generator: torch.Generator | None, greedy: bool,
                temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None) -> torch.Tensor:
    """The next id of each row of logits (B, V). Sampling draws exactly one uniform number
    per row (inverse CDF), so a row's draw does not depend on the other rows' logits."""
    logits = logits.float()
    if greedy:
        return logits.argmax(dim=-1)
    uniform = torch.rand((logits.shape[0], 1), generator=generator, device=logits.device)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the most likely tokens until their mass reaches top_p (always the first).
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(outside, 0))
    cdf = probs.cumsum(dim=-1)
    chosen = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True)
    return chosen.clamp(max=logits.shape[-1] - 1).squeeze(-1)


def _check_options(greedy: bool, temperature: float, top_k: int | None,
                   top_p: float | None) -> None:
    if greedy:
        return
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (or use greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def _autocast(device: torch.device):
    """bf16 autocast on GPUs, as in training (pretrain/train.py compute_dtype); none on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _CachedSteps:
    """Logits of each row's newest token: a prefill, then one token per row per step."""

    def __init__(self, model, prompts: list[list[int]], capacity: int, device: torch.device):
        self.model = model
        self.cache = KVCache(len(model.blocks), capacity)
        self.batch = _Batch(prompts, capacity, model.config.seq_len, device)

    def first(self) -> torch.Tensor:
        batch, cache = self.batch, self.cache
        cache.positions = batch.positions(0, batch.width)
        cache.mask, cache.is_causal = batch.prefill_mask(), not batch.padded
        logits = self.model.forward_cached(batch.tokens, cache)
        cache.length = batch.width
        return logits[:, -1]

    def next(self, tokens: torch.Tensor) -> torch.Tensor:
        cache, start = self.cache, self.cache.length
        cache.positions = self.batch.positions(start, start + 1)
        cache.mask, cache.is_causal = self.batch.decode_mask(start + 1), False
        logits = self.model.forward_cached(tokens[:, None], cache)
        cache.length = start + 1
        return logits[:, -1]


class _UncachedSteps:
    """The reference: the training forward over each unfinished row's whole sequence, rows
    of equal length in one call, at every step."""

    def __init__(self, model, prompts: list[list[int]], device: torch.device):
        self.model, self.device = model, device
        self.sequences = [list(p) for p in prompts]
        self.active = [True] * len(prompts)

    def first(self) -> torch.Tensor:
        logits = None
        by_length: dict[int, list[int]] = {}
        for b, sequence in enumerate(self.sequences):
            if self.active[b]:
                by_length.setdefault(len(sequence), []).append(b)
        for rows in by_length.values():
            tokens = torch.tensor([self.sequences[b] for b in rows], device=self.device)
            last = self.model(tokens)[:, -1]
            if logits is None:
                logits = last.new_zeros((len(self.sequences), last.shape[-1]))
            logits[rows] = last
        return logits

    def next(self, tokens: torch.Tensor) -> torch.Tensor:
        for b, token in enumerate(tokens.tolist()):
            self.sequences[b].append(token)
        return self.first()


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int | None = None, *,
             greedy: bool = False, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, seed: int = 0, eos_id: int | None = None,
             use_cache: bool = True, timings: dict | None = None,
             on_step: Callable[[list[Completion]], None] | None = None) -> list[Completion]:
    """Continue each prompt (a list of token ids) with `model` (a DenseFormer, any TP size:
    every TP rank gets the same logits and so the same tokens); one Completion per prompt.

    `max_new_tokens` None fills each row's context. Sampling (not `greedy`) is reproducible
    for the same seed, prompts and batch. `timings`, if given, receives prefill_s,
    first_token_s (the call's start to the first token on the host), decode_s (wall seconds,
    device synchronised) and decode_steps. `on_step`, if given, is called with the
    completions after every step's tokens are added (to stream them)."""
    if not prompts:
        raise ValueError("no prompts")
    vocab = model.config.vocab_size
    for n, prompt in enumerate(prompts):
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {n} holds ids outside [0, {vocab}): {bad[:5]}")
    budgets = context_budgets([len(p) for p in prompts], model.config.seq_len, max_new_tokens)
    _check_options(greedy, temperature, top_k, top_p)
    device = next(model.parameters()).device
    generator = None if greedy else torch.Generator(device=device).manual_seed(seed)
    steps = (_CachedSteps(model, prompts, max(len(p) for p in prompts) + max(budgets), device)
             if use_cache else _UncachedSteps(model, prompts, device))
    completions = [Completion([], FINISH_LENGTH if budget == 0 else "") for budget in budgets]
    was_training = model.training
    model.eval()
    try:
        with _autocast(device):
            started = time.perf_counter()
            logits = steps.first()
            _sync(device)
            prefilled = time.perf_counter()
            decode_steps = 0
            first_token = None
            while any(not c.finish_reason for c in completions):
                chosen = sample_next(logits, generator, greedy, temperature, top_k, top_p)
                _record(completions, chosen.tolist(), budgets, eos_id)
                if first_token is None:
                    first_token = time.perf_counter()
                if on_step is not None:
                    on_step(completions)
                if isinstance(steps, _UncachedSteps):
                    steps.active = [not c.finish_reason for c in completions]
                if all(c.finish_reason for c in completions):
                    break
                logits = steps.next(chosen)
                decode_steps += 1
            _sync(device)
    finally:
        model.train(was_training)
    if timings is not None:
        timings.update(prefill_s=prefilled - started, first_token_s=(first_token or prefilled)
                       - started,
                       decode_s=time.perf_counter() - prefilled, decode_steps=decode_steps)
    return completions


def _record(completions: list[Completion], tokens: list[int], budgets: list[int],
            eos_id: int | None) -> None:
    """Add each unfinished row's new token, or finish the row (EOS, or its budget full)."""
    for completion, token, budget in zip(completions, tokens, budgets, strict=True):
        if completion.finish_reason:
            continue
        if token == eos_id:
            completion.finish_reason = FINISH_EOS
            continue
        completion.tokens.append(token)
        if len(completion.tokens) == budget:
            completion.finish_reason = FINISH_LENGTH


def prompt_ids(tokenizer, text: str) -> list[int]:
    """The ids a text prompt is generated from: the end-of-document id first (training data
    has one before every document but the first of a sample; no BOS), then the text's."""
    if not text:
        raise ValueError("the prompt is empty")
    prefix = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    return prefix + tokenizer.encode(text)
