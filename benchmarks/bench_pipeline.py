"""Pipeline parallelism: what crosses each stage boundary, and the step time PP=2 vs PP=1.

1. Table (no ranks started): d=48, PP=4 with an explicit even split (12 blocks per stage),
   DenseFormer 1x1 / 4x1 / 4x5 and a Transformer, transfer modes raw and optimal (and the
   lower bound sum_r min(|P_r|, |C_r|)): tensors and MiB per boundary per micro-batch at
   width 768, seq 256, micro-batch 8, fp32, per TP rank.
2. Step time at a tiny shape on CPU: forward + backward of one batch in M micro-batches,
   PP=1 (one process, one thread) vs PP=2 (two processes, one thread each, 1F1B), for a
   Transformer and DenseFormer 1x1 in both modes; plus the time to send one step's boundary
   tensors alone (forward activations; the backward sends gradients of the same size).
   Rounds alternate PP=1 and PP=2; medians. CPU throughput drifts: compare within a run.

    .venv/bin/python benchmarks/bench_pipeline.py [--layers 8 --width 128 --rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TABLE_MODELS = {"transformer": dict(dwa=False), "dense-1x1": dict(dwa_dilation=1, dwa_period=1),
                "dense-4x1": dict(dwa_dilation=4, dwa_period=1),
                "dense-4x5": dict(dwa_dilation=4, dwa_period=5)}


def boundary_table(layers: int = 48, pp: int = 4, width: int = 768, seq: int = 256,
                   micro_batch: int = 8, vocab: int = 50304) -> dict:
    """{model: plan report (parallel.strategies.plan.PipelinePlan.report)} with an even split."""
    from parallel.strategies.plan import build_plan
    from pretrain.model.config import DenseFormerConfig

    out = {}
    for name, extra in TABLE_MODELS.items():
        cfg = DenseFormerConfig(n_layers=layers, d_model=width, n_heads=12, vocab_size=vocab,
                                seq_len=seq, **extra)
        plan = build_plan(cfg, pp, split=[layers // pp] * pp)
        out[name] = plan.report(micro_batch)
    return out


def print_table(table: dict, micro_batch: int, width: int, seq: int) -> None:
    first = next(iter(table.values()))
    print(f"boundary tensors per micro-batch (micro-batch {micro_batch}, seq {seq}, width "
          f"{width}, fp32: {micro_batch * seq * width * 4 / 2**20:.0f} MiB per tensor); "
          f"stages {first['stages']}")
    print(f"{'model':<12} {'after block':>11} {'raw':>5} {'optimal':>8} {'bound':>6} "
          f"{'raw MiB':>8} {'optimal MiB':>12}")
    for name, rep in table.items():
        for b in rep["boundaries"]:
            size = b["bytes_per_microbatch"]
            print(f"{name:<12} {b['after_block']:>11} {b['raw']:>5} {b['optimal']:>8} "
                  f"{b['bound']:>6} {size['raw'] / 2**20:>8.0f} {size['optimal'] / 2**20:>12.0f}")


# ---------------------------------------------------------------------------------------------
# Step time


def tiny_config(args, **extra):
    from pretrain.model.config import DenseFormerConfig

    return DenseFormerConfig(n_layers=args["layers"], d_model=args["width"], n_heads=4,
                             vocab_size=args["vocab"], seq_len=args["seq"], **extra)


TIMED = {"transformer": (dict(dwa=False), "optimal"),
         "dense-1x1 raw": (dict(dwa_dilation=1, dwa_period=1), "raw"),
         "dense-1x1 optimal": (dict(dwa_dilation=1, dwa_period=1), "optimal")}


def time_pp1(args: dict) -> dict[str, float]:
    """Median step time (s) of the single-process micro-batch loop, one thread."""
    import torch

    from parallel.primitives import groups
    from pretrain.model import DenseFormer

    torch.set_num_threads(1)
    groups.ensure_initialized()
    tokens = torch.randint(0, args["vocab"], (args["batch"], args["seq"] + 1))
    m = args["microbatches"]
    out = {}
    for name, (extra, _) in TIMED.items():
        model = DenseFormer(tiny_config(args, **extra))
        times = []
        for step in range(args["steps"] + 1):
            start = time.perf_counter()
            for part in tokens.chunk(m):
                (model.loss(part[:, :-1], part[:, 1:]) / m).backward()
            model.zero_grad(set_to_none=True)
            if step:  # the first is a warm-up
                times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    return out


def time_pp2(args: dict) -> dict[str, dict]:
    """On each of two pipeline ranks: median step time, and the time to send one step's
    forward boundary tensors alone."""
    import torch
    import torch.distributed as dist

    from parallel.strategies.pipeline import PipelineRunner

    m = args["microbatches"]
    tokens = torch.randint(0, args["vocab"], (args["batch"], args["seq"] + 1),
                           generator=torch.Generator().manual_seed(0))
    out = {}
    for name, (extra, mode) in TIMED.items():
        runner = PipelineRunner(tiny_config(args, **extra), microbatches=m,
                                micro_batch=args["batch"] // m, transfer=mode)
        times = []
        for step in range(args["steps"] + 1):
            dist.barrier()
            start = time.perf_counter()
            runner.train_step(tokens[:, :-1], tokens[:, 1:])
            runner.model.zero_grad(set_to_none=True)
            dist.barrier()
            if step:
                times.append(time.perf_counter() - start)
        count = runner.plan.counts[0][mode]
        state = torch.randn(count, args["batch"] // m, args["seq"], args["width"])
        dist.barrier()
        start = time.perf_counter()
        for _ in range(m):
            if runner.pp_rank == 0:
                dist.send(state, group=runner.pp_group, group_dst=1)
            else:
                dist.recv(state, group=runner.pp_group, group_src=0)
        dist.barrier()
        out[name] = {"step_s": statistics.median(times), "tensors": count,
                     "send_s": time.perf_counter() - start,
                     "mib_per_step": count * state[0].numel() * 4 * m / 2**20}
    return out


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="timed steps per round and model")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p.parse_args()


def main() -> None:
    from tests.distributed import run_distributed_test

    args = parse_args()
    table = boundary_table()
    shape = {k: getattr(args, k) for k in ("layers", "width", "seq", "vocab", "batch",
                                           "microbatches", "steps")}
    pp1, pp2 = {name: [] for name in TIMED}, {name: [] for name in TIMED}
    sends = {name: [] for name in TIMED}
    info = {}
    for _ in range(args.rounds):
        for name, t in time_pp1(shape).items():
            pp1[name].append(t)
        ranks = run_distributed_test(time_pp2, 2, 900, pp=2, args=shape)
        for name, r in ranks[0].items():
            pp2[name].append(max(rank[name]["step_s"] for rank in ranks))
            sends[name].append(r["send_s"])
            info[name] = r
    m = args.microbatches
    timing = {name: {"pp1_s": statistics.median(pp1[name]), "pp2_s": statistics.median(pp2[name]),
                     "send_s": statistics.median(sends[name]),
                     "tensors": info[name]["tensors"], "mib_per_step": info[name]["mib_per_step"]}
              for name in TIMED}
    if args.json:
        print(json.dumps({"table": table, "timing": timing, "shape": shape}))
        return
    print_table(table, 8, 768, 256)
    print(f"\nstep time, {args.layers} blocks x {args.width}, seq {args.seq}, batch {args.batch} "
          f"in {m} micro-batches (1F1B ideal PP=2/PP=1: (M + 1) / 2M = {(m + 1) / (2 * m):.3f})")
    print(f"{'model':<18} {'tensors':>7} {'MiB/step':>9} {'PP=1 s':>8} {'PP=2 s':>8} "
          f"{'PP2/PP1':>8} {'send s':>8}")
    for name, t in timing.items():
        print(f"{name:<18} {t['tensors']:>7} {t['mib_per_step']:>9.1f} {t['pp1_s']:>8.3f} "
              f"{t['pp2_s']:>8.3f} {t['pp2_s'] / t['pp1_s']:>8.3f} {t['send_s']:>8.4f}")


if __name__ == "__main__":
    main()
