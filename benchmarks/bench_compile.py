"""`train.compile`: compile time and step time of each mode against eager, in one process.

For each model (DenseFormer 1x1 and 4x5 by default) the trainer's engine is built three
times from the same seed (`train.compile` none, blocks, model; `--backend`, default
inductor) and trained on the same batch: the first step of a compiled mode pays the
compilation (reported as its first-step time minus the eager median), then rounds alternate
the modes and each times `--steps` steps; medians. One thread by default (`--threads`).

    .venv/bin/python benchmarks/bench_compile.py [--layers 8 --width 256 --rounds 3] [--json]
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

MODELS = {"dense-1x1": [], "dense-4x5": ["model.dwa_dilation=4", "model.dwa_period=5"]}
MODES = ("none", "blocks", "model")


def measure(args: argparse.Namespace) -> dict:
    import torch

    from parallel.primitives.layout import setup_layout
    from pretrain.config import load_config
    from pretrain.engine import build_engine

    torch.set_num_threads(args.threads)
    base = [f"model.n_layers={args.layers}", f"model.d_model={args.width}",
            f"model.n_heads={max(1, args.width // 64)}", "model.vocab_size=4096",
            f"model.seq_len={args.seq}", f"train.batch_size={args.batch}",
            f"train.compile_backend={args.backend}", "optim.warmup_steps=1"]
    tokens = torch.randint(0, 4096, (args.batch, args.seq + 1),
                           generator=torch.Generator().manual_seed(0))
    out = {}
    for name, extra in MODELS.items():
        steps, first = {}, {}
        for mode in MODES:
            cfg = load_config(None, [*base, *extra, f"train.compile={mode}"])
            layout = setup_layout(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.timeout_s)
            engine = build_engine(cfg.model, cfg, layout, torch.float32)

            def step(engine=engine) -> None:
                engine.forward_backward(tokens[:, :-1], tokens[:, 1:], 1)
                engine.update()

            start = time.perf_counter()
            step()  # compiles
            first[mode] = time.perf_counter() - start
            steps[mode] = step
        times = {mode: [] for mode in MODES}
        for r in range(args.rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                start = time.perf_counter()
                for _ in range(args.steps):
                    steps[mode]()
                times[mode].append((time.perf_counter() - start) / args.steps)
        medians = {mode: statistics.median(values) for mode, values in times.items()}
        out[name] = {mode: {"s_per_step": medians[mode],
                            "vs_eager": medians[mode] / medians["none"],
                            "compile_s": first[mode] - medians["none"]} for mode in MODES}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from tests.distributed import run_distributed_test

    result = run_distributed_test(measure, world_size=1, timeout_s=3600, args=args)[0]
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{args.layers} x {args.width}, seq {args.seq}, batch {args.batch}, backend "
          f"{args.backend}, {args.threads} thread(s), medians of {args.rounds} rounds")
    for name, modes in result.items():
        for mode, r in modes.items():
            print(f"  {name:<10} {mode:<7} {r['s_per_step']:.3f} s/step  x{r['vs_eager']:.3f}"
                  + (f"  compile {r['compile_s']:.1f} s" if mode != "none" else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
