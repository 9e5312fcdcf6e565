"""`python -m pretrain generate`: continue text prompts with a trained model.

    python -m pretrain generate --run runs/tiny --prompt "def main(" --max-new-tokens 40
    python -m pretrain generate --checkpoint exported/ --prompts prompts.jsonl --json

With one `--prompt` and no `--json` the continuation streams to stdout as it is made.
`--prompts` is JSONL, one {"prompt": TEXT} per line. `--json` prints one object per prompt:
{"prompt", "completion", "tokens" (the new ids), "finish_reason" ("eos" or "length")}. The time
to the first token and the decoding speed go to stderr at the end (not with `--quiet`). Under
torchrun the ranks form one tensor-parallel group and rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from data_pipeline import DataError
from pretrain.config import ConfigError


def add_parser(subparsers) -> None:
    """The `generate` subcommand and its options."""
    gen = subparsers.add_parser("generate", help="continue text prompts with a trained model")
    where = gen.add_mutually_exclusive_group(required=True)
    where.add_argument("--run", help="run directory (its newest complete checkpoint)")
    where.add_argument("--checkpoint", help="a checkpoint or an exported directory")
    what = gen.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="one prompt text")
    what.add_argument("--prompts", metavar="FILE.jsonl", help='one {"prompt": TEXT} per line')
    gen.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                     help="new tokens per prompt (default: up to the model's context)")
    gen.add_argument("--temperature", type=float, default=1.0, metavar="T")
    gen.add_argument("--top-k", type=int, default=None, metavar="K",
                     help="sample among the K most likely ids")
    gen.add_argument("--top-p", type=float, default=None, metavar="P",
                     help="sample among the most likely ids holding probability P")
    gen.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed")
    gen.add_argument("--greedy", action="store_true", help="the most likely id, no sampling")
    gen.add_argument("--no-cache", action="store_true",
                     help="full forward every step (the reference for the KV cache)")
    gen.add_argument("--batch-size", type=int, default=8, metavar="B",
                     help="prompts generated together (default 8)")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.add_argument("--quiet", action="store_true",
                     help="no time-to-first-token and tokens/s line on stderr")


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompt texts; an empty one or a bad file raises naming it."""
    if args.prompt is not None:
        if not args.prompt:
            raise ConfigError("--prompt", "is empty: give some text to continue")
        try:  # bytes that are not UTF-8 reach Python as lone surrogates ("\udcff")
            args.prompt.encode("utf-8")
        except UnicodeEncodeError as error:
            raw = args.prompt.encode("utf-8", "surrogateescape")
            raise ConfigError("--prompt", f"is not UTF-8 text: byte "
                              f"0x{raw[error.start]:02x} at offset {error.start}") from None
        return [args.prompt]
    path = Path(args.prompts)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"{path}: cannot read the prompt file ({error})") from error
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            raise DataError(f"{path}:{number}: not JSONL ({error})") from error
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise DataError(f'{path}:{number}: expected {{"prompt": TEXT}}, got {line[:80]}')
        if not record["prompt"]:
            raise DataError(f"{path}:{number}: the prompt is empty")
        prompts.append(record["prompt"])
    if not prompts:
        raise DataError(f"{path}: holds no prompt")
    return prompts


def _check_options(args: argparse.Namespace) -> None:
    """Refuse bad sampling options before the model is loaded."""
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ConfigError("--max-new-tokens", f"must be >= 1, got {args.max_new_tokens}")
    if args.batch_size < 1:
        raise ConfigError("--batch-size", f"must be >= 1, got {args.batch_size}")
    if args.greedy:
        return
    if not args.temperature > 0:
        raise ConfigError("--temperature", f"must be > 0 (or use --greedy), got "
                          f"{args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise ConfigError("--top-k", f"must be >= 1, got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ConfigError("--top-p", f"must be in (0, 1], got {args.top_p}")


def cmd_generate(args: argparse.Namespace) -> int:
    """Load the model, generate for every prompt, print (rank 0); the exit status."""
    # deferred: pulls in sentencepiece, torch (slow to start, or optional)
    from parallel.primitives import groups
    from pretrain.generation import context_budgets, generate, prompt_ids
    from pretrain.load import load_model

    _check_options(args)
    texts = read_prompts(args)
    try:
        model, tokenizer = load_model(args.run or args.checkpoint)
        ids = [prompt_ids(tokenizer, text) for text in texts]
        try:
            context_budgets([len(p) for p in ids], model.config.seq_len, args.max_new_tokens)
        except ValueError as error:
            key = "--max-new-tokens" if "max_new_tokens" in str(error) else "--prompt"
            raise ConfigError(key, str(error).replace("max_new_tokens", "--max-new-tokens")) \
                from None
        printing = os.environ.get("RANK", "0") == "0"
        streaming = printing and len(texts) == 1 and not args.json
        speed = _Speed()
        for first in range(0, len(ids), args.batch_size):
            batch = ids[first:first + args.batch_size]
            stream = _Stream(tokenizer, batch[0]) if streaming else None
            if stream is not None:
                print(texts[0], end="", flush=True)
            timings: dict = {}
            completions = generate(
                model, batch, args.max_new_tokens, greedy=args.greedy, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                eos_id=tokenizer.eos_id, use_cache=not args.no_cache, timings=timings,
                on_step=stream)
            speed.add(timings, completions)
            if stream is not None:
                stream(completions, final=True)
                print(flush=True)
            elif printing:
                for number, completion in enumerate(completions, start=first):
                    text = continuation(tokenizer, ids[number], completion.tokens)
                    _print(texts[number], text, completion, number, args.json)
        if printing and not args.quiet:
            print(speed.line(), file=sys.stderr, flush=True)
    finally:
        groups.destroy()
    return 0


def continuation(tokenizer, prompt: list[int], tokens: list[int]) -> str:
    """The text `tokens` add after `prompt`: decoded with the prompt, so that a leading
    space (which a tokenizer drops at the start of a decoded text) is kept."""
    before = tokenizer.decode(prompt)
    after = tokenizer.decode(prompt + tokens)
    return after[len(before):] if after.startswith(before) else tokenizer.decode(tokens)


class _Stream:
    """Writes the first prompt's continuation to stdout as its tokens come (`on_step`)."""

    def __init__(self, tokenizer, prompt: list[int]):
        self.tokenizer, self.prompt = tokenizer, prompt
        self.shown = ""

    def __call__(self, completions, final: bool = False) -> None:
        text = continuation(self.tokenizer, self.prompt, completions[0].tokens)
        # U+FFFD at the end: a character whose bytes are not all generated yet; wait for them.
        if not final and text.endswith("\ufffd"):
            return
        if text.startswith(self.shown) and len(text) > len(self.shown):
            print(text[len(self.shown):], end="", flush=True)
            self.shown = text


class _Speed:
    """Time to the first token and new tokens per second, over every batch."""

    def __init__(self):
        self.first_token_s: float | None = None
        self.seconds = 0.0
        self.tokens = 0
        self.finish: list[str] = []

    def add(self, timings: dict, completions) -> None:
        if self.first_token_s is None:
            self.first_token_s = timings["first_token_s"]
        self.seconds += timings["prefill_s"] + timings["decode_s"]
        self.tokens += sum(len(c.tokens) for c in completions)
        self.finish += [c.finish_reason for c in completions]

    def line(self) -> str:
        reasons = ", ".join(sorted(set(self.finish)))
        return (f"[{self.tokens} new tokens, {reasons}] time to first token "
                f"{self.first_token_s:.3f} s, {self.tokens / max(self.seconds, 1e-9):.1f} "
                f"tokens/s ({self.seconds:.2f} s in all)")


def _print(prompt: str, text: str, completion, number: int, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"prompt": prompt, "completion": text, "tokens": completion.tokens,
                          "finish_reason": completion.finish_reason}), flush=True)
    else:
        print(f"=== prompt {number + 1} ({completion.finish_reason}, "
              f"{len(completion.tokens)} new tokens)\n{prompt}{text}", flush=True)
