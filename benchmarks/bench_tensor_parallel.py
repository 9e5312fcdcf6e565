"""Step time of tensor-parallel training (TP=2, with and without SP) against TP=1.

Runs the real CLI (`pretrain train`, under torchrun for TP=2) on a prepared dataset and
compares median step times from each run's metrics.jsonl (steps after a warm-up). Runs are
sequential processes, so machine drift between them shows up in the ratios: repeat and
compare. On a 2-core CPU, TP=2 puts two ranks (one thread each) on the cores TP=1 uses with
two threads, plus gloo collectives: expect it slower, not faster.

    .venv/bin/python benchmarks/bench_tensor_parallel.py --data data/demo [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(data: str, steps: int, tp: int, sp: bool, out: Path) -> float:
    sets = [f"data.path={data}", f"run.dir={out}", f"train.steps={steps}",
            "tracking.enabled=false", "train.eval_every=0", "data.val_batches=1",
            "optim.warmup_steps=2",
            f"parallel.tp={tp}", f"parallel.sequence_parallel={'true' if sp else 'false'}"]
    cmd = [sys.executable, "-m", "pretrain", "train", "--config", str(ROOT / "configs/tiny.yaml"),
           *[a for s in sets for a in ("--set", s)]]
    if tp > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(tp), *cmd[1:]]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True,
                   env={"OMP_NUM_THREADS": str(2 // tp), "PATH": "/usr/bin:/bin"})
    rates = [json.loads(line)["tokens_per_s"] for line in (out / "metrics.jsonl").open()
             if '"tokens_per_s"' in line]
    return statistics.median(rates[5:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="data/demo")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = run(args.data, args.steps, 1, False, Path(tmp) / "tp1")
        print(f"tiny config ({args.steps} steps): TP=1 {base:.0f} tokens/s")
        for tp, sp in [(2, False), (2, True)]:
            rate = run(args.data, args.steps, tp, sp, Path(tmp) / f"tp{tp}-{sp}")
            print(f"TP={tp}{' + SP' if sp else ''}: {rate:.0f} tokens/s, step time "
                  f"{base / rate:.2f}x TP=1's")


if __name__ == "__main__":
    main()
