"""Train-step time of our Transformer and DenseFormers against a nanoGPT-style anchor and a
reference DWA; the DWAs alone against their memory-traffic floor; MFU.

One process, `--threads` threads (default 1), every configuration interleaved round by
round (the order reversed every other round, so drift hits each alike); medians, the best
step, and ratios taken within each round. Configurations, all of one shape (48 blocks x 256,
seq 256, batch 4, vocabulary 8192 by default), each one full train step (forward, backward,
AdamW) on the same tokens:

- ours: `transformer`, `dense-1x1`, `dense-4x1`, `dense-4x5` (pretrain.model.DenseFormer),
  and the other depth connections: `attnres-full`, `attnres-block8` (Attention Residuals),
  `mudd`, `mudd-static` (MUDD, qkvr streams), `hc`, `mhc` (dynamic Hyper-Connections and
  mHC, n = 4 streams);
  with `--llama` also `llama-transformer`, `llama-1x1`, `llama-4x5` (Llama-style blocks,
  SwiGLU width 8/3 x width rounded to 64: about the gpt block's parameter count), whose
  ratio is also given to the llama Transformer;
- `anchor`: a nanoGPT-style model of the same shape, `anchor-rope`: it with RoPE in plain
  ops instead of learned positions (our architecture), and `reference-KxP`: the anchor with
  the clean-room reference DWA in the official code's style (benchmarks/nanogpt_anchor.py);
  `official-KxP` with `--official PATH`, the official `DWAModules` from a checkout.

The process keeps freed memory for the next step as the trainer does on a CPU
(pretrain/cpu_memory.py; a MALLOC_* setting in the environment leaves malloc alone).
Each round also measures the fp32 matmul peak (MFU: model FLOP/s over the median peak of
the rounds) and a memory copy bandwidth. The DWA-alone section runs the same DWAs with every
block replaced by a scalar multiply: forward + backward time minus that of no DWA, against
the time the bytes the buffered DWA must move would take at the copy bandwidth
(`buffered_traffic` in pretrain/model/dwa_layout.py; docs/design.md#bytes-moved-by-the-dwas).

    .venv/bin/python benchmarks/bench_model.py [--rounds 5 --threads 1] [--llama] [--json]
        [--only mudd,mudd-static] [--no-dwa-alone]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from nanogpt_anchor import AnchorGPT, ReferenceDWA, official_dwa_class  # noqa: E402

from pretrain.cpu_memory import keep_freed_memory  # noqa: E402
from pretrain.mfu import measure_matmul_flops  # noqa: E402
from pretrain.model import DenseFormer, DenseFormerConfig  # noqa: E402
from pretrain.model.dwa_layout import buffered_traffic  # noqa: E402

PATTERNS = {"1x1": (1, 1), "4x1": (4, 1), "4x5": (4, 5)}
# The other depth connections (docs/connections.md), same shape.
CONNECTIONS = {"attnres-full": dict(connection="attnres"),
               "attnres-block8": dict(connection="attnres", attnres_blocks=8),
               "mudd": dict(connection="mudd"),
               "mudd-static": dict(connection="mudd", mudd_dynamic=False),
               "hc": dict(connection="hc", hc_streams=4),
               "mhc": dict(connection="mhc", hc_streams=4)}
LLAMA_PATTERNS = (None, "1x1", "4x5")
LLAMA_BLOCK = dict(block="llama", ffn_multiple_of=64)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("layers", 48), ("width", 256), ("heads", 4), ("seq", 256),
                          ("batch", 4), ("vocab", 8192), ("rounds", 5), ("threads", 1)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--official", metavar="PATH",
                   help="also run the official DWAModules from this DenseFormer checkout")
    p.add_argument("--llama", action="store_true", help="also Llama-style blocks")
    p.add_argument("--no-dwa-alone", action="store_true", help="skip the DWA-alone section")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--only", metavar="NAMES", type=lambda v: set(v.split(",")),
                   help="only these train-step rows, comma-separated (the transformer is "
                        "always run: the ratios are to it), e.g. --only mudd,hc")
    args = p.parse_args(argv)
    if min(args.layers, args.width, args.rounds, args.threads) < 1:
        p.error("--layers, --width, --rounds and --threads must be >= 1")
    args.official_cls = None
    if args.official:
        try:
            args.official_cls = official_dwa_class(args.official)
        except ValueError as err:
            p.error(f"--official: {err}")
    return args


def config(args, pattern: str | None, **block) -> DenseFormerConfig:
    k, p = PATTERNS.get(pattern, (1, 1))
    return DenseFormerConfig(n_layers=args.layers, d_model=args.width, n_heads=args.heads,
                             vocab_size=args.vocab, seq_len=args.seq, dwa=pattern is not None,
                             dwa_dilation=k, dwa_period=p, **block)


def dwa_modules(args, style: str, pattern: str):
    k, p = PATTERNS[pattern]
    cls = ReferenceDWA if style == "reference" else args.official_cls
    return cls(args.layers, k, p)


def train_steps(args) -> dict:
    """{name: (flops per token, one train step)} for every configuration."""
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1),
                           generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step_of(model, loss_fn):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            loss_fn(inputs, targets).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    def wanted(name: str) -> bool:
        return not args.only or name == "transformer" or name in args.only

    steps = {}
    for pattern in (None, *PATTERNS):
        name = "transformer" if pattern is None else f"dense-{pattern}"
        if not wanted(name):
            continue
        model = DenseFormer(config(args, pattern))
        steps[name] = (model.config.flops_per_token(), step_of(model, model.loss))
    for name, connection in CONNECTIONS.items():
        if not wanted(name):
            continue
        model = DenseFormer(config(args, None, **connection))
        steps[name] = (model.config.flops_per_token(), step_of(model, model.loss))
    for pattern in LLAMA_PATTERNS if args.llama else ():
        if not wanted(f"llama-{pattern or 'transformer'}"):
            continue
        model = DenseFormer(config(args, pattern, **LLAMA_BLOCK))
        steps[f"llama-{pattern or 'transformer'}"] = (
            model.config.flops_per_token(), step_of(model, model.loss))
    styles = ["reference"] + (["official"] if args.official_cls else [])
    for style, pattern in [(None, None)] + [(s, p) for s in styles for p in PATTERNS]:
        if not wanted("anchor" if style is None else f"{style}-{pattern}"):
            continue
        dwa = None if style is None else dwa_modules(args, style, pattern)
        model = AnchorGPT(args.layers, args.width, args.heads, args.seq, args.vocab, dwa)
        steps["anchor" if style is None else f"{style}-{pattern}"] = (
            config(args, pattern).flops_per_token(), step_of(model, model))
        if style is None and wanted("anchor-rope"):
            model = AnchorGPT(args.layers, args.width, args.heads, args.seq, args.vocab,
                              rope=True)
            steps["anchor-rope"] = (config(args, None).flops_per_token(), step_of(model, model))
    return steps


class Scale(nn.Module):
    """A stand-in block: y * gain (the DWA-alone section)."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.tensor(0.999))

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return y * self.gain


def dwa_alone_runs(args) -> dict:
    """{name: forward + backward of the DWAs with scalar-multiply blocks}."""
    x0 = torch.randn(args.batch, args.seq, args.width, requires_grad=True)

    def ours(pattern):
        model = DenseFormer(config(args, pattern))
        model.blocks = nn.ModuleList(Scale() for _ in range(args.layers))
        return lambda: model.run_blocks(x0).sum().backward()

    def anchored(style, pattern):
        model = AnchorGPT(1, 8, 1, 1, 8, dwa_modules(args, style, pattern))
        model.blocks = nn.ModuleList(Scale() for _ in range(args.layers))
        return lambda: model.run_blocks(x0).sum().backward()

    runs = {"no DWA": ours(None)}
    styles = ["reference"] + (["official"] if args.official_cls else [])
    for pattern in PATTERNS:
        runs[f"ours-{pattern}"] = ours(pattern)
        for style in styles:
            runs[f"{style}-{pattern}"] = anchored(style, pattern)
    return runs


def copy_bandwidth(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Best bytes/s of a large tensor copy (a read and a write of every byte)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2 * nbytes / (time.perf_counter() - start))
    return best


def interleaved(runs: dict, rounds: int, between=None,
                clock=time.perf_counter) -> dict[str, list[float]]:
    """Seconds of each run per round (after one warm-up each), order reversed every other
    round; `between()` runs at the start of each round."""
    for fn in runs.values():
        fn()
    times = {name: [] for name in runs}
    for r in range(rounds):
        if between is not None:
            between()
        for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            start = clock()
            runs[name]()
            times[name].append(clock() - start)
    return times


def median_ratio(series: list[float], base: list[float]) -> float:
    """The median of the per-round ratios series[r] / base[r]: a slowdown of the machine
    between rounds hits both alike and cancels, one disturbed round does not move it."""
    return statistics.median(t / b for t, b in zip(series, base, strict=True))


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    memory_line = keep_freed_memory()  # as the trainer runs on a CPU
    peaks, bandwidths = [], []

    def measure():
        peaks.append(measure_matmul_flops(torch.device("cpu"), size=2048, seconds=1.0))
        bandwidths.append(copy_bandwidth())

    steps = train_steps(args)
    if args.only:
        unknown = args.only - steps.keys()
        if unknown:
            raise SystemExit(f"--only: unknown rows {sorted(unknown)}; known: {sorted(steps)}")
        steps = {n: s for n, s in steps.items() if n in args.only | {"transformer"}}
    times = interleaved({n: fn for n, (_, fn) in steps.items()}, args.rounds, measure)
    peak, bandwidth = statistics.median(peaks), statistics.median(bandwidths)
    tokens = args.batch * args.seq
    results = {"shape": {k: v for k, v in vars(args).items() if k != "official_cls"},
               "matmul_peak_gflops": {"median": peak / 1e9, "best": max(peaks) / 1e9},
               "copy_gbytes_per_s": bandwidth / 1e9, "cpu_memory": memory_line,
               "variants": {}, "dwa_alone": {}}

    for name, series in times.items():
        med = statistics.median(series)
        results["variants"][name] = {
            "median_step_s": med, "best_step_s": min(series), "tokens_per_s": tokens / med,
            "ratio_vs_transformer": median_ratio(series, times["transformer"]),
            "mfu": steps[name][0] * tokens / med / peak}
        if name.startswith("llama-"):
            results["variants"][name]["ratio_vs_llama_transformer"] = median_ratio(
                series, times["llama-transformer"])
    if not args.no_dwa_alone:
        alone = interleaved(dwa_alone_runs(args), args.rounds)
        none = statistics.median(alone.pop("no DWA"))
        tensor_bytes = tokens * args.width * 4  # one fp32 hidden-size tensor
        for name, series in alone.items():
            row = results["dwa_alone"][name] = {
                "ms": (statistics.median(series) - none) * 1e3}
            if name.startswith("ours-"):  # bytes as docs/design.md counts them
                traffic = buffered_traffic(config(args, name[5:]).dwa_pattern)
                for key, parts in (("ours", ("forward", "backward")),
                                   ("floor", ("floor_forward", "floor_backward"))):
                    moved = sum(traffic[part] for part in parts) * tensor_bytes
                    row[f"{key}_mib"] = moved / 2**20
                    row[f"{key}_ms_at_bandwidth"] = moved / bandwidth * 1e3
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        report(args, results)


def report(args, results: dict) -> None:
    peak = results["matmul_peak_gflops"]
    print(f"{args.layers} blocks x {args.width}, seq {args.seq}, batch {args.batch}, vocab "
          f"{args.vocab}; {args.rounds} interleaved rounds, {args.threads} thread(s); fp32 "
          f"matmul peak {peak['median']:.1f} GFLOP/s (median; best {peak['best']:.1f}); copy "
          f"{results['copy_gbytes_per_s']:.1f} GB/s\n{results['cpu_memory']}")
    print(f"{'variant':<17} {'median s':>9} {'best s':>8} {'tokens/s':>9} "
          f"{'vs Transformer':>15} {'MFU':>6} {'vs llama Transformer':>21}")
    for name, r in results["variants"].items():
        llama = r.get("ratio_vs_llama_transformer")
        print(f"{name:<17} {r['median_step_s']:>9.3f} {r['best_step_s']:>8.3f} "
              f"{r['tokens_per_s']:>9.0f} {r['ratio_vs_transformer']:>15.3f} {r['mfu']:>6.1%}"
              + ("" if llama is None else f" {llama:>21.3f}"))
    if results["dwa_alone"]:
        print("\nDWAs alone (blocks replaced by a scalar multiply), forward + backward; bytes "
              "and times at the copy bandwidth: the buffered DWA's traffic and the floor")
        print(f"{'variant':<15} {'ms':>7} {'MiB':>7} {'ms at GB/s':>11} {'floor MiB':>10} "
              f"{'floor ms':>9}")
        for name, r in results["dwa_alone"].items():
            if "ours_mib" not in r:
                print(f"{name:<15} {r['ms']:>7.1f}")
                continue
            print(f"{name:<15} {r['ms']:>7.1f} {r['ours_mib']:>7.0f} "
                  f"{r['ours_ms_at_bandwidth']:>11.1f} {r['floor_mib']:>10.0f} "
                  f"{r['floor_ms_at_bandwidth']:>9.1f}")


if __name__ == "__main__":
    main()
