"""Generation speed of DenseFormer 1x1 / 4x5 against a Transformer of the same shape.

All models run in one process, interleaved round by round (the order alternates), and are
compared by median tokens/s: prefill (the prompt's tokens through the cached forward) and
decode (one new token per sequence per step), with the KV cache and without it (the full
forward over the whole sequence at every step, `use_cache=False`). Greedy, no EOS: every
sequence gets exactly --new tokens (--uncached-new without the cache, which costs a full
forward per token). Also the bytes held per sequence while decoding: the KV cache (at the
full context, prompt + new) against the DWA state (the current token's X_j that later DWAs
of the same step read), both measured on the cache objects.

    .venv/bin/python benchmarks/bench_generate.py [--layers 48 --width 256 --batches 1 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.generation import KVCache, generate  # noqa: E402
from pretrain.model import DenseFormer, DenseFormerConfig  # noqa: E402

VARIANTS = {"transformer": dict(dwa=False), "dense-1x1": dict(dwa_dilation=1, dwa_period=1),
            "dense-4x5": dict(dwa_dilation=4, dwa_period=5)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--new", type=int, default=128, help="new tokens per sequence, cached")
    p.add_argument("--uncached-new", type=int, default=8,
                   help="new tokens per sequence without the cache (0: skip)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p.parse_args(argv)


def state_bytes(model, prompt: torch.Tensor) -> tuple[int, int]:
    """(KV cache bytes, DWA decode-state bytes) per sequence, measured after a prefill of
    `prompt` (1, P) and one decoding step, the KV cache scaled to the full context."""
    cache = KVCache(len(model.blocks), prompt.shape[1] + 1)
    cache.positions = torch.arange(prompt.shape[1])[None]
    cache.is_causal = True
    logits = model.forward_cached(prompt, cache)
    cache.length = prompt.shape[1]
    cache.positions, cache.is_causal = torch.tensor([[prompt.shape[1]]]), False
    model.forward_cached(logits[:, -1].argmax(-1, keepdim=True), cache)
    dwa = cache.dwa_decode.nbytes if cache.dwa_decode is not None else 0
    return cache.nbytes, dwa


def run_once(model, prompts: list[list[int]], new: int, use_cache: bool) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) of one greedy generation."""
    timings: dict = {}
    generate(model, prompts, new, greedy=True, use_cache=use_cache, timings=timings)
    batch, width = len(prompts), len(prompts[0])
    decoded = batch * timings["decode_steps"]
    return batch * width / timings["prefill_s"], decoded / timings["decode_s"]


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    context = args.prompt + max(args.new, args.uncached_new)
    models = {}
    for name, extra in VARIANTS.items():
        cfg = DenseFormerConfig(n_layers=args.layers, d_model=args.width, n_heads=args.heads,
                                vocab_size=args.vocab, seq_len=context, **extra)
        models[name] = DenseFormer(cfg).eval()
    prompts = torch.randint(3, args.vocab, (max(args.batches), args.prompt)).tolist()
    modes = [("cache", args.new, True)] + (
        [("no-cache", args.uncached_new, False)] if args.uncached_new else [])
    samples = {(b, name, mode): ([], []) for b in args.batches for name in models
               for mode, _, _ in modes}
    for model in models.values():  # warm-up
        run_once(model, prompts[:1], 2, True)
    for r in range(args.rounds):
        for b in args.batches:
            for mode, new, use_cache in modes:
                order = list(models) if r % 2 == 0 else list(reversed(models))
                for name in order:
                    prefill, decode = run_once(models[name], prompts[:b], new, use_cache)
                    samples[(b, name, mode)][0].append(prefill)
                    samples[(b, name, mode)][1].append(decode)
    prompt_one = torch.tensor(prompts[:1])
    results = {"shape": vars(args), "runs": [], "bytes_per_sequence": {}}
    for name, model in models.items():
        kv, dwa = state_bytes(model, prompt_one)
        kv_full = kv * context // (args.prompt + 1)  # the cache grows linearly with slots
        results["bytes_per_sequence"][name] = {"kv_cache": kv_full, "dwa_state": dwa}
    for (b, name, mode), (prefills, decodes) in samples.items():
        base = samples[(b, "transformer", mode)]
        results["runs"].append({
            "batch": b, "model": name, "mode": mode,
            "prefill_tok_s": statistics.median(prefills),
            "decode_tok_s": statistics.median(decodes),
            "decode_vs_transformer": statistics.median(base[1]) / statistics.median(decodes)})
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{args.layers} blocks x {args.width}, vocab {args.vocab}, prompt {args.prompt}, "
          f"{args.new} new tokens cached ({args.uncached_new} uncached); {args.rounds} "
          f"interleaved rounds, medians")
    print(f"{'batch':>5} {'model':<12} {'mode':<9} {'prefill tok/s':>13} {'decode tok/s':>12} "
          f"{'decode time vs Transformer':>27}")
    for run in results["runs"]:
        print(f"{run['batch']:>5} {run['model']:<12} {run['mode']:<9} "
              f"{run['prefill_tok_s']:>13.0f} {run['decode_tok_s']:>12.1f} "
              f"{run['decode_vs_transformer']:>27.3f}")
    print(f"bytes per sequence at context {context} (fp32):")
    for name, sizes in results["bytes_per_sequence"].items():
        share = sizes["dwa_state"] / sizes["kv_cache"]
        print(f"  {name:<12} KV cache {sizes['kv_cache'] / 2**20:8.2f} MiB, DWA state "
              f"{sizes['dwa_state'] / 2**10:8.1f} KiB ({share:.2%} of the KV cache)")


if __name__ == "__main__":
    main()
