"""Data parallelism at DP = 2: torch DDP (`parallel.dp_reduction: ddp`) against the flat
all-reduce after the backward (`flat`), in the same run.

Two gloo ranks on this machine, one thread each, build the trainer's engine for both paths
(same model, seed and data) and alternate them round by round: each round times `--steps`
training steps of each path (forward + backward of `--microbatches` micro-batches, reduction,
AdamW); medians over rounds of rank 0. Memory is measured with each path alone in a fresh
pair of processes (freed memory stays resident, so two engines in one process would hide
each other's peaks): the RSS high-water mark over 3 steps minus the RSS before the engine
was built, against the model's gradient size (the flat path allocates one more
gradient-sized buffer).

On a 2-core CPU the all-reduce cannot overlap compute much (gloo shares the cores); the
figure that carries over to GPUs is the memory, and on GPUs the overlap.

    .venv/bin/python benchmarks/bench_dp.py [--layers 8 --width 256 --rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from host_memory import status_kib  # noqa: E402


def _engine(args: argparse.Namespace, mode: str):
    import torch

    from parallel.primitives.layout import setup_layout
    from pretrain.config import load_config
    from pretrain.engine import build_engine

    overrides = [f"model.n_layers={args.layers}", f"model.d_model={args.width}",
                 f"model.n_heads={max(1, args.width // 64)}", "model.vocab_size=4096",
                 f"model.seq_len={args.seq}", f"train.batch_size={2 * args.batch}",
                 f"parallel.microbatches={args.microbatches}", "optim.warmup_steps=1",
                 f"parallel.dp_reduction={mode}"]
    cfg = load_config(None, overrides, world_size=2)
    layout = setup_layout(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.timeout_s)
    engine = build_engine(cfg.model, cfg, layout, torch.float32)
    gen = torch.Generator().manual_seed(layout.dp_rank)
    tokens = torch.randint(0, 4096, (args.batch, args.seq + 1), generator=gen)

    def step() -> None:
        engine.forward_backward(tokens[:, :-1], tokens[:, 1:], args.microbatches)
        engine.update()

    return engine, step


def timing(args: argparse.Namespace) -> dict:
    """Both paths in these 2 processes, interleaved rounds: s/step medians of rank 0."""
    import torch

    steps = {mode: _engine(args, mode)[1] for mode in ("ddp", "flat")}
    times = {mode: [] for mode in steps}
    for step in steps.values():  # warm-up: gradients and AdamW state allocated
        step()
    for _ in range(args.rounds):
        for mode, step in steps.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[mode].append((time.perf_counter() - start) / args.steps)
    return {f"{mode}_s_per_step": statistics.median(values) for mode, values in times.items()}


def memory(args: argparse.Namespace, mode: str) -> dict:
    """One path alone in these 2 processes: the resident-memory high-water mark over a few
    steps, minus the RSS before the engine was built (model, gradients, AdamW state,
    activations and whatever the reduction allocates)."""
    before = status_kib("VmRSS")
    engine, step = _engine(args, mode)
    for _ in range(3):
        step()
    grad_bytes = sum(p.numel() * 4 for p in engine.model.parameters())
    return {"params": grad_bytes // 4, "grad_mib": grad_bytes / 2**20,
            "peak_mib": (status_kib("VmHWM") - before) / 1024}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="per rank")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per path per round")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from tests.distributed import run_distributed_test

    def spawn(fn, **kwargs) -> dict:
        return run_distributed_test(fn, world_size=2, timeout_s=1800, set_up_groups=False,
                                    args=args, **kwargs)[0]

    result = spawn(timing)
    for mode in ("ddp", "flat"):
        measured = spawn(memory, mode=mode)
        result.update(params=measured["params"], grad_mib=measured["grad_mib"])
        result[f"{mode}_peak_mib"] = measured["peak_mib"]
    result["ddp_over_flat"] = result["ddp_s_per_step"] / result["flat_s_per_step"]
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"DP=2, {args.layers} x {args.width}, {result['params'] / 1e6:.1f}M parameters "
          f"(gradients {result['grad_mib']:.0f} MiB), {args.microbatches} micro-batches of "
          f"{args.batch // args.microbatches} x {args.seq}; medians of {args.rounds} rounds")
    for mode in ("ddp", "flat"):
        print(f"  {mode:<5} {result[f'{mode}_s_per_step']:.3f} s/step, peak memory of the "
              f"engine and its steps {result[f'{mode}_peak_mib']:.0f} MiB per rank")
    print(f"  ddp / flat step time: {result['ddp_over_flat']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
