"""Train-step time of our Transformer and DenseFormers against two anchors, and MFU.

Configurations, all of one shape (`--layers` x `--width`, `--heads`, `--seq`, `--batch`,
`--vocab`), one process, `--threads` torch threads (default 1, so a shared machine's other
work moves the figures less), interleaved round by round (the order reversed every other
round), one optimizer step (forward, backward, AdamW) per configuration per round:

- ours: `transformer`, `dense-1x1`, `dense-4x1`, `dense-4x5` (pretrain.model.DenseFormer);
  with `--llama` also `llama-transformer`, `llama-1x1`, `llama-4x5` (Llama-style blocks,
  SwiGLU width 8/3 x width rounded to 64: about the gpt block's parameter count);
- `anchor`: a plain nanoGPT-style Transformer written here (pre-LN, LayerNorm without bias,
  fused QKV, causal SDPA, RoPE, 4x GELU MLP, tied head; torch.nn layers only);
- `reference-KxP`: the anchor with a clean-room DWA in the style of the official DenseFormer
  code, written from the paper's description (labelled as such: not the official code):
  every block output appended to a per-residue-class list, and after each block with a DWA
  one `torch.tensordot` of its weights with a `torch.stack` of the outputs it reads.

Reported per configuration: median and best s/step, tokens/s, the ratio of its median to our
Transformer's and to the Transformer of its own block (for the llama rows), and MFU: model
FLOPs (DenseFormerConfig.flops_per_token) per second over the best matmul FLOP/s measured
between the rounds at the same thread count. `--dwa-only` replaces every block by a scalar
multiply, so the time left is the DWAs' (and the head's). `--json` prints the results as JSON.

    .venv/bin/python benchmarks/bench_model.py [--layers 48 --width 256] [--llama] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pretrain.mfu import measure_matmul_flops  # noqa: E402
from pretrain.model import DenseFormer, DenseFormerConfig  # noqa: E402

OURS = {"transformer": dict(dwa=False), "dense-1x1": dict(dwa_dilation=1, dwa_period=1),
        "dense-4x1": dict(dwa_dilation=4, dwa_period=1),
        "dense-4x5": dict(dwa_dilation=4, dwa_period=5)}
REFERENCE = {"reference-1x1": (1, 1), "reference-4x1": (4, 1), "reference-4x5": (4, 5)}
LLAMA = {"llama-transformer": dict(dwa=False), "llama-1x1": OURS["dense-1x1"],
         "llama-4x5": OURS["dense-4x5"]}
LLAMA_BLOCK = dict(block="llama", ffn_multiple_of=64)


class AnchorBlock(nn.Module):
    """nanoGPT's block with RoPE and no biases."""

    def __init__(self, width: int, heads: int, seq: int):
        super().__init__()
        self.heads = heads
        self.norm_attn = nn.LayerNorm(width, bias=False)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.norm_mlp = nn.LayerNorm(width, bias=False)
        self.fc_in = nn.Linear(width, 4 * width, bias=False)
        self.fc_out = nn.Linear(4 * width, width, bias=False)
        head_dim = width // heads
        inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(seq).float(), inv_freq).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def rope(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        s = x.shape[-2]
        return x * self.cos[:s] + torch.cat([-x2, x1], dim=-1) * self.sin[:s]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm_attn(x)).view(b, s, 3, self.heads, -1).unbind(2)
        q, k, v = self.rope(q.transpose(1, 2)), self.rope(k.transpose(1, 2)), v.transpose(1, 2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, h))
        return x + self.fc_out(F.gelu(self.fc_in(self.norm_mlp(x))))


class Anchor(nn.Module):
    """The nanoGPT-style anchor; with `dwa` = (k, p), the clean-room reference DWA."""

    def __init__(self, args, dwa: tuple[int, int] | None = None):
        super().__init__()
        self.embedding = nn.Embedding(args.vocab, args.width)
        self.blocks = nn.ModuleList(AnchorBlock(args.width, args.heads, args.seq)
                                    for _ in range(args.layers))
        self.final_norm = nn.LayerNorm(args.width, bias=False)
        self.dilation, self.period = dwa or (1, 1)
        self.alphas = None
        if dwa is not None:  # alpha_i over X_0..X_i, identity at init
            self.alphas = nn.ParameterList(
                nn.Parameter(F.one_hot(torch.tensor(i), i + 1).float())
                for i in range(1, args.layers + 1))
        self.block_fn = None  # --dwa-only: a scalar multiply instead of every block

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        k, p = self.dilation, self.period
        stored = [[] for _ in range(k)]  # per residue class j mod k: X_j in order
        if self.alphas is not None:
            stored[0].append(x)
        for i, block in enumerate(self.blocks, start=1):
            x = self.block_fn(x) if self.block_fn else block(x)
            if self.alphas is None:
                continue
            stored[i % k].append(x)
            if i % p == 0:  # a DWA after block i reads X_j for j <= i, j = i mod k
                reads = stored[i % k]
                weights = self.alphas[i - 1][i % k::k]
                x = torch.tensordot(weights, torch.stack(reads), dims=1)
        logits = F.linear(self.final_norm(x), self.embedding.weight)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--llama", action="store_true", help="also Llama-style blocks")
    p.add_argument("--dwa-only", action="store_true",
                   help="blocks replaced by a scalar multiply: the DWAs' own cost")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p.parse_args()


def build(args) -> dict:
    """name -> (model, optimizer, FLOPs per token)."""
    runs = {}
    ours = {**OURS, **({n: {**e, **LLAMA_BLOCK} for n, e in LLAMA.items()} if args.llama
                       else {})}
    for name, extra in ours.items():
        cfg = DenseFormerConfig(n_layers=args.layers, d_model=args.width, n_heads=args.heads,
                                vocab_size=args.vocab, seq_len=args.seq, **extra)
        model = DenseFormer(cfg)
        if args.dwa_only:
            model.blocks = nn.ModuleList(_Scale() for _ in model.blocks)
        runs[name] = (model, cfg.flops_per_token())
    base = DenseFormerConfig(n_layers=args.layers, d_model=args.width, n_heads=args.heads,
                             vocab_size=args.vocab, seq_len=args.seq, dwa=False)
    for name, dwa in {"anchor": None, **REFERENCE}.items():
        model = Anchor(args, dwa)
        if args.dwa_only:
            model.block_fn = _Scale()
        ours = OURS["transformer" if dwa is None else f"dense-{dwa[0]}x{dwa[1]}"]
        runs[name] = (model, DenseFormerConfig(**{**vars(base), **ours}).flops_per_token())
    return {name: (model, torch.optim.AdamW(model.parameters(), lr=1e-4), flops)
            for name, (model, flops) in runs.items()}


class _Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    runs = build(args)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1))

    def step(model, opt) -> None:
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for model, opt, _ in runs.values():  # warm-up: allocator, optimizer state
        step(model, opt)
    times = {name: [] for name in runs}
    peaks = []
    for r in range(args.rounds):
        peaks.append(measure_matmul_flops(torch.device("cpu"), size=1024, seconds=0.5))
        for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            model, opt, _ = runs[name]
            start = time.perf_counter()
            step(model, opt)
            times[name].append(time.perf_counter() - start)
    peak = max(peaks)
    tokens_per_step = args.batch * args.seq
    base = statistics.median(times["transformer"])
    results = {"shape": vars(args), "threads": torch.get_num_threads(),
               "matmul_peak_gflops": peak / 1e9, "configurations": {}}
    for name, (_, _, flops) in runs.items():
        median = statistics.median(times[name])
        results["configurations"][name] = {
            "median_s_per_step": median, "best_s_per_step": min(times[name]),
            "tokens_per_s": tokens_per_step / median, "vs_our_transformer": median / base,
            "vs_own_block_transformer": median / statistics.median(
                times["llama-transformer" if name.startswith("llama") else "transformer"]),
            "mfu": math.nan if args.dwa_only else flops * tokens_per_step / median / peak}
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"{args.layers} blocks x {args.width}, seq {args.seq}, batch {args.batch}, vocab "
          f"{args.vocab}; {args.threads} thread(s); {args.rounds} interleaved rounds; best "
          f"matmul {peak / 1e9:.1f} GFLOP/s{'; DWA only' if args.dwa_only else ''}")
    print(f"{'configuration':<17} {'median s':>9} {'best s':>8} {'tokens/s':>9} "
          f"{'vs ours':>8} {'vs block':>9} {'MFU':>6}")
    for name, r in results["configurations"].items():
        mfu = "n/a" if math.isnan(r["mfu"]) else f"{r['mfu']:.1%}"
        print(f"{name:<17} {r['median_s_per_step']:>9.4f} {r['best_s_per_step']:>8.4f} "
              f"{r['tokens_per_s']:>9.0f} {r['vs_our_transformer']:>8.3f} "
              f"{r['vs_own_block_transformer']:>9.3f} {mfu:>6}")


if __name__ == "__main__":
    main()
