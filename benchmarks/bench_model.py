"""Train-step time of DenseFormer 1x1 / 4x5 vs a Transformer of the same shape, and MFU.

All configurations run in one process, interleaved round by round, and are compared by
median step time (CPU throughput drifts over minutes; only ratios within a run mean anything).
MFU is model FLOPs/s (DenseFormerConfig.flops_per_token) over the best fp32 matmul FLOP/s
measured in the same run, between rounds.

    .venv/bin/python benchmarks/bench_model.py [--layers 48 --width 256 --rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pretrain.mfu import measure_matmul_flops
from pretrain.model import DenseFormer, DenseFormerConfig


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    variants = {"transformer": dict(dwa=False), "dense-1x1": dict(dwa_dilation=1, dwa_period=1),
                "dense-4x5": dict(dwa_dilation=4, dwa_period=5)}
    runs = {}
    for name, extra in variants.items():
        cfg = DenseFormerConfig(n_layers=args.layers, d_model=args.width, n_heads=args.heads,
                                vocab_size=args.vocab, seq_len=args.seq, **extra)
        model = DenseFormer(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        runs[name] = (cfg, model, opt, [])
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1))

    def step(model, opt):
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _, model, opt, _ in runs.values():  # warm-up (allocator, optimizer state)
        step(model, opt)
    peaks = []
    for r in range(args.rounds):
        peaks.append(measure_matmul_flops(torch.device("cpu"), size=2048, seconds=1.0))
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            _, model, opt, times = runs[name]
            start = time.perf_counter()
            step(model, opt)
            times.append(time.perf_counter() - start)
    peak = max(peaks)
    base = statistics.median(runs["transformer"][3])
    results = {"shape": vars(args), "matmul_peak_gflops": peak / 1e9, "variants": {}}
    for name, (cfg, _, _, times) in runs.items():
        med = statistics.median(times)
        flops = cfg.flops_per_token() * args.batch * args.seq / med
        results["variants"][name] = {
            "median_step_s": med, "ratio_vs_transformer": med / base,
            "model_gflops": flops / 1e9, "mfu_vs_measured_peak": flops / peak}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{args.layers} blocks x {args.width}, seq {args.seq}, batch {args.batch}, "
          f"vocab {args.vocab}; {args.rounds} interleaved rounds; best fp32 matmul "
          f"{peak / 1e9:.1f} GFLOP/s")
    print(f"{'variant':<12} {'median s':>9} {'vs Transformer':>15} {'GFLOP/s':>8} {'MFU':>6}")
    for name, r in results["variants"].items():
        print(f"{name:<12} {r['median_step_s']:>9.3f} {r['ratio_vs_transformer']:>15.3f} "
              f"{r['model_gflops']:>8.1f} {r['mfu_vs_measured_peak']:>6.1%}")


if __name__ == "__main__":
    main()
