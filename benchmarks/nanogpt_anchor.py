"""The anchors of benchmarks/bench_model.py: a plain nanoGPT-style model, and DWAs for it.

- `AnchorGPT`: a GPT in the style of nanoGPT's `model.py` (learned positions, pre-LN blocks
  of causal self-attention through `scaled_dot_product_attention` and a 4x GELU MLP, no
  biases, LM head tied to the embedding), written here so that the benchmark has a model
  that owes nothing to this project; with `rope=True` it has our architecture's positions
  (RoPE in plain ops, no learned positions). With a `dwa` object it calls
  `dwa.init_accumulators(X_0)` once and `x = dwa(x, i)` after block i (0-based), the
  interface of the official DenseFormer code's `DWAModules`, so the official class runs in
  it unchanged
  (`bench_model.py --official PATH`).
- `ReferenceDWA`: a clean-room DWA in the style of the official code, written from the
  paper's description of it, not from its source: one preallocated buffer per residue
  class, each X_j written into its slot in place, each DWA one `tensordot` of its alphas
  (one parameter vector per DWA) with the filled part of its class's buffer. Autograd then
  gives every DWA a gradient for every slot it read (an outer product alpha x dY, summed
  into the slots one prefix at a time), which is the traffic our buffered DWA avoids.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Rotary(nn.Module):
    """RoPE as most plain implementations write it: x * cos + rotate_half(x) * sin."""

    def __init__(self, head_dim: int, seq: int, base: float = 10000.0):
        super().__init__()
        freqs = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), freqs).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        t = x.shape[-2]
        return x * self.cos[:t] + torch.cat((-x2, x1), dim=-1) * self.sin[:t]


class SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, rotary: Rotary | None = None):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.rotary = rotary  # one module shared by every block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=2))
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, 4 * width, bias=False)
        self.proj = nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, rotary: Rotary | None = None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width, bias=False)
        self.attn = SelfAttention(width, heads, rotary)
        self.ln_2 = nn.LayerNorm(width, bias=False)
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class AnchorGPT(nn.Module):
    """nanoGPT-style LM; `model(tokens, targets)` returns the mean cross entropy. With
    `rope`, RoPE on queries and keys (`Rotary`) instead of learned positions."""

    def __init__(self, layers: int, width: int, heads: int, seq: int, vocab: int,
                 dwa: nn.Module | None = None, rope: bool = False):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.rotary = Rotary(width // heads, seq) if rope else None
        self.wpe = None if rope else nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads, self.rotary) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width, bias=False)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in nanoGPT
        self.dwa = dwa

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        x = self.run_blocks(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        if self.dwa is not None:
            self.dwa.init_accumulators(x)
        for i, block in enumerate(self.blocks):
            x = block(x)
            if self.dwa is not None:
                x = self.dwa(x, i)
        return x


class _WriteSlot(torch.autograd.Function):
    """Put x into slot n of a class buffer; return slots 0..n as a tensor that shares the
    buffer's memory but has its own version counter (so the writes of later slots go
    unnoticed by autograd: the reason this style breaks activation checkpointing). In
    backward the gradient of slots 0..n splits into the earlier slots' and x's."""

    @staticmethod
    def forward(ctx, buffer, earlier, n: int, x):
        buffer[n].copy_(x)
        ctx.n = n
        filled = buffer.new_empty(0)
        return filled.set_(buffer.untyped_storage(), buffer.storage_offset(),
                           (n + 1, *buffer.shape[1:]), buffer.stride())

    @staticmethod
    def backward(ctx, grad):
        n = ctx.n
        return None, (grad[:n] if n else None), None, grad[n]


class ReferenceDWA(nn.Module):
    """Clean-room DWAs in the style of the official code (see the module docstring), for
    blocks numbered from 0 as `AnchorGPT` calls them: block b's output is X_{b+1}."""

    def __init__(self, n_blocks: int, dilation: int, period: int):
        super().__init__()
        self.n_blocks, self.dilation, self.period = n_blocks, dilation, period
        self.alphas = nn.ParameterList()
        self.index: dict[int, int] = {}  # block -> its alpha vector
        for i in range(1, n_blocks + 1):
            if i % period == 0:
                alpha = torch.zeros(i // dilation + 1)  # |S_i|: j = i mod k, ..., i
                alpha[-1] = 1.0
                self.index[i] = len(self.alphas)
                self.alphas.append(nn.Parameter(alpha))
        self.filled: list = []

    def init_accumulators(self, x0: torch.Tensor) -> None:
        k, d = self.dilation, self.n_blocks
        sizes = [len(range(r, d + 1, k)) for r in range(k)]
        buffers = [x0.new_zeros((n, *x0.shape)) for n in sizes]
        self.filled = [(buffer, None) for buffer in buffers]
        self._append(0, x0)

    def _append(self, j: int, x: torch.Tensor) -> torch.Tensor:
        r = j % self.dilation
        buffer, earlier = self.filled[r]
        filled = _WriteSlot.apply(buffer, earlier, j // self.dilation, x)
        self.filled[r] = (buffer, filled)
        return filled

    def forward(self, x: torch.Tensor, block: int) -> torch.Tensor:
        i = block + 1
        filled = self._append(i, x)
        if i % self.period:
            return x
        return torch.tensordot(self.alphas[self.index[i]], filled, dims=1)


def official_dwa_class(path: str):
    """`DWAModules` from a checkout of the official DenseFormer code at `path` (the
    directory that holds the `denseformer` package)."""
    import importlib
    import sys

    sys.path.insert(0, path)
    try:
        return importlib.import_module("denseformer").DWAModules
    except (ImportError, AttributeError) as err:
        raise ValueError(f"no denseformer.DWAModules under {path} ({err}); give the "
                         "directory of a DenseFormer checkout") from None
    finally:
        sys.path.remove(path)
