"""Command line: python -m data_pipeline {demo-corpus,prepare,inspect} ...

A DataError (bad input, bad shard, index mismatch) prints one line naming the file and
exits with status 2, like a usage error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data_pipeline import DataError
from data_pipeline.demo_corpus import build_demo_corpus
from data_pipeline.prepare import (
    DEFAULT_SEQ_LEN,
    DEFAULT_SHARD_MB,
    DEFAULT_TOKENIZER_TRAIN_MB,
    DEFAULT_VAL_FRACTION,
    DEFAULT_VOCAB_SIZE,
    prepare_dataset,
)
from data_pipeline.verify import inspect_dataset, summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m data_pipeline", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo-corpus", help="write a demo corpus from the stdlib's docstrings and comments"
    )
    demo.add_argument("--out", required=True, type=Path, help="output .jsonl file")
    demo.add_argument(
        "--max-mb", type=float, default=8.0, help="stop after this many MB of text (default 8)"
    )

    prep = commands.add_parser("prepare", help="tokenize, pack and shard raw text")
    prep.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help=".txt/.jsonl(.gz) files, directories or globs",
    )
    prep.add_argument("--out", required=True, type=Path, help="dataset directory to create")
    prep.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help=f"tokenizer vocabulary to train (default {DEFAULT_VOCAB_SIZE})",
    )
    prep.add_argument(
        "--seq-len",
        type=int,
        default=DEFAULT_SEQ_LEN,
        help=f"tokens per training sequence; samples hold seq_len+1 (default {DEFAULT_SEQ_LEN})",
    )
    prep.add_argument(
        "--val-fraction",
        type=float,
        default=DEFAULT_VAL_FRACTION,
        help=f"fraction of documents held out for validation (default {DEFAULT_VAL_FRACTION})",
    )
    prep.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="use this tokenizer instead of training one: a sentencepiece .model, a Hugging "
        "Face tokenizer.json (needs the hf extra) or a directory holding one",
    )
    prep.add_argument(
        "--workers", type=int, default=None, help="tokenisation processes (default: all cores)"
    )
    prep.add_argument(
        "--seed", type=int, default=0, help="seed of the train/val document split (default 0)"
    )
    prep.add_argument(
        "--shard-mb",
        type=float,
        default=DEFAULT_SHARD_MB,
        help=f"target shard size in MB (default {DEFAULT_SHARD_MB:g})",
    )
    prep.add_argument(
        "--tokenizer-train-mb",
        type=float,
        default=DEFAULT_TOKENIZER_TRAIN_MB,
        help="text to train the tokenizer on, sampled by document stride "
        f"(default {DEFAULT_TOKENIZER_TRAIN_MB:g})",
    )
    prep.add_argument(
        "--force", action="store_true", help="replace an existing prepared dataset at --out"
    )

    insp = commands.add_parser(
        "inspect", help="check every shard (sha256, samples) against the index; show samples"
    )
    insp.add_argument("data_dir", type=Path)
    insp.add_argument(
        "--samples", type=int, default=3, help="samples to decode and print (default 3)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo-corpus":
            stats = build_demo_corpus(args.out, args.max_mb)
            print(
                f"wrote {args.out}: {stats['documents']} documents from {stats['files']} files, "
                f"{stats['bytes'] / 1e6:.2f} MB of text (stdlib {stats['stdlib']})"
            )
        elif args.command == "prepare":
            index = prepare_dataset(
                args.input,
                args.out,
                vocab_size=args.vocab_size,
                seq_len=args.seq_len,
                val_fraction=args.val_fraction,
                tokenizer=args.tokenizer,
                workers=args.workers,
                seed=args.seed,
                shard_mb=args.shard_mb,
                tokenizer_train_mb=args.tokenizer_train_mb,
                force=args.force,
            )
            print(summary(index))
        elif args.command == "inspect":
            print(inspect_dataset(args.data_dir, num_decoded=args.samples))
    except DataError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
