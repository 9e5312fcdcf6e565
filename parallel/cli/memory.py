"""`python -m parallel.memory`: memory per rank of a run config or run directory, for
training or generation (the usage is parallel/strategies/memory.py's docstring)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from data_pipeline import DataError
from parallel.cli.run_config import config_parser, load_run, note_ignored_keys
from parallel.strategies import memory
from parallel.strategies.inference_memory import describe_inference, estimate_inference
from parallel.strategies.memory import describe, estimate, local_parameters
from pretrain.checkpoint import CheckpointError
from pretrain.config import load_config, validate
from pretrain.model.config import DenseFormerConfig


def main(argv: list[str] | None = None) -> int:
    parser = config_parser("python -m parallel.memory", memory.__doc__, run_dir=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="what train.dtype=auto resolves to (default cuda: bf16); with "
                             "--inference, cuda is bf16 autocast and cpu fp32")
    parser.add_argument("--inference", action="store_true", help="generation, not training")
    parser.add_argument("--batch", type=int, default=None, help="--inference: sequences (1)")
    parser.add_argument("--context", type=int, default=None,
                        help="--inference: prompt + new tokens (default model.seq_len)")
    parser.add_argument("--prompt", type=int, default=None,
                        help="--inference: prompt tokens of the prefill (default --context)")
    args = parser.parse_args(argv)
    if not args.inference and (args.batch, args.context, args.prompt) != (None,) * 3:
        parser.error("--batch, --context and --prompt need --inference")
    try:
        cfg, model = _load(args)
        note_ignored_keys(model)
        if args.inference:
            return _print_inference(args, model)
        ranks = estimate(cfg.parallel, model, cfg.train.batch_size, cfg.train.dtype,
                         args.world_size, args.device, cfg.optim.decay_alphas)
    except ValueError as err:  # ConfigError is one
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"ranks": [r.as_json() for r in ranks]}))
    else:
        print("\n".join(describe(cfg.parallel, cfg.model, ranks)))
    return 0


def _load(args: argparse.Namespace):
    """(run config, DenseFormerConfig) of --config FILE or --run DIR. For --inference the
    world size is the TP group's, not the training layout's: the config is checked without it."""
    if args.run is None:
        if args.inference:
            args = argparse.Namespace(config=args.config, overrides=args.overrides)
        return load_run(args)
    # Deferred: pretrain.load imports torch, which the estimate from --config does without.
    # deferred: pulls in sentencepiece, torch (slow to start, or optional)
    from pretrain.load import CONFIG_FILE, model_config, run_tokenizer

    run_dir = Path(args.run)
    try:  # as pretrain.load reads a run: generation checks only the model section
        cfg = load_config(run_dir / CONFIG_FILE, [f"run.dir={run_dir}", *args.overrides],
                          check=False)
        if not args.inference:
            validate(cfg, args.world_size)
        vocab = cfg.model.vocab_size or run_tokenizer(run_dir, cfg).vocab_size
    except (CheckpointError, DataError) as err:
        raise ValueError(str(err)) from err
    model = model_config(cfg, vocab)
    model.validate()
    return cfg, model


def _print_inference(args: argparse.Namespace, model: DenseFormerConfig) -> int:
    tp = 1 if args.world_size is None else args.world_size
    batch = 1 if args.batch is None else args.batch
    context = model.seq_len if args.context is None else args.context
    prompt = context if args.prompt is None else args.prompt
    if tp < 1:
        raise ValueError(f"--world-size must be >= 1, got {tp}")
    dtype = "bf16" if args.device == "cuda" else "fp32"
    parameters = local_parameters(model, tp, range(1, model.n_layers + 1), True, True,
                                  decay_alphas=False)
    ranks = estimate_inference(model, parameters, tp, batch, context, prompt, dtype)
    if args.json:
        print(json.dumps({"inference": {"batch": batch, "context": context,
                                        "prompt": prompt, "dtype": dtype, "tp": tp},
                          "ranks": [r.as_json() for r in ranks]}))
    else:
        print("\n".join(describe_inference(model, ranks, batch, context, prompt, dtype)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
