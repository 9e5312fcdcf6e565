"""`python -m slurm.inference_speed --run DIR`: generation speed of a trained run, logged to
its MLflow run (the sweep launcher runs it after training when the sweep has `inference:`).

Loads the run's newest checkpoint (`pretrain.load_model`), generates greedily from `--batch`
random prompts of `--prompt` tokens for `--new-tokens` tokens with the KV cache, once to warm
up and then `--rounds` times, and logs the medians as `inference/prefill_tokens_per_s` and
`inference/decode_tokens_per_s` (prompt and generated tokens per second of wall time, device
synchronised: the timings of `pretrain.generation.generate`) at the checkpoint's step.
Exit status 2 when the run has no checkpoint or was trained without MLflow.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from pretrain.lm_eval_cli import checkpoint_run
from pretrain.tracking import bounded_http_requests, mlflow_client


def measure(model, batch: int, prompt: int, new_tokens: int, rounds: int) -> dict[str, float]:
    """Median prefill and decode tokens/s of `rounds` greedy generations (after a warm-up)."""
    # deferred: pulls in torch (slow to start, or optional)
    import torch

    # deferred: pulls in torch (slow to start, or optional)
    from pretrain.generation import generate

    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = torch.randint(0, vocab, (batch, prompt), generator=generator).tolist()
    prefill, decode = [], []
    for round_ in range(rounds + 1):
        timings: dict = {}
        generate(model, prompts, new_tokens, greedy=True, timings=timings)
        if round_:  # the first round warms up
            prefill.append(batch * prompt / timings["prefill_s"])
            decode.append(batch * timings["decode_steps"] / max(timings["decode_s"], 1e-9))
    return {"inference/prefill_tokens_per_s": statistics.median(prefill),
            "inference/decode_tokens_per_s": statistics.median(decode)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slurm.inference_speed",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="run directory")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    # deferred: pulls in MLflow (slow to start, or optional)
    from mlflow.entities import Metric

    # deferred: pulls in sentencepiece, torch (slow to start, or optional)
    from pretrain import load_model

    where = checkpoint_run(Path(args.run))
    if isinstance(where, str):
        print(f"error: --run {args.run}: {where}", file=sys.stderr)
        return 2
    uri, run_id, step = where
    model, _tokenizer = load_model(args.run)
    if not 1 <= args.prompt < model.config.seq_len or args.new_tokens < 1 \
            or args.prompt + args.new_tokens > model.config.seq_len:
        print(f"error: --prompt {args.prompt} + --new-tokens {args.new_tokens} must fit the "
              f"model's context of {model.config.seq_len}", file=sys.stderr)
        return 2
    speed = measure(model, args.batch, args.prompt, args.new_tokens, max(1, args.rounds))
    now = int(time.time() * 1000)
    with bounded_http_requests():
        mlflow_client(uri).log_batch(run_id, [Metric(k, v, now, step)
                                              for k, v in speed.items()])
    print(" ".join(f"{k} {v:.1f}" for k, v in speed.items()) + f" (MLflow run {run_id})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
