"""Data pipeline throughput on the demo corpus: tokenisation (MB/s) and loader (tokens/s).

    .venv/bin/python benchmarks/bench_data.py [--consumption-tokens-per-s 20000]

Builds the demo corpus and a dataset (vocab 4096, seq_len 128 by default) in a temporary
directory (or --work-dir, reused if already there), then measures
  demo-corpus and prepare wall time (the README quickstart's data step);
  tokenisation alone: documents -> token arrays on --workers processes, MB/s of text;
  TrainLoader: shuffled global batches, tokens/s, with 0 and 2 DataLoader workers;
and prints each loader figure against the training consumption (goal: >= 20x).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_pipeline.demo_corpus import build_demo_corpus  # noqa: E402
from data_pipeline.index import read_index  # noqa: E402
from data_pipeline.prepare import _encoded_chunks, prepare_dataset  # noqa: E402
from data_pipeline.sources import expand_inputs  # noqa: E402


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def bench_tokenize(corpus: Path, index, workers: int, repeats: int) -> float:
    """MB/s of text through encode + EOS append, as prepare runs it (best of repeats)."""
    files = expand_inputs([str(corpus)])
    best = float("inf")
    text_bytes = 0
    for _ in range(repeats):
        start = time.perf_counter()
        text_bytes = sum(
            chunk[3]
            for chunk in _encoded_chunks(files, index.tokenizer_path, index.token_dtype, workers)
        )
        best = min(best, time.perf_counter() - start)
    return text_bytes / 1e6 / best


def bench_loader(data_dir: Path, global_batch: int, num_workers: int, steps: int) -> float:
    """Tokens/s of shuffled training batches after a short warm-up."""
    # Imported here: spawned tokenisation workers re-import this script, and need no torch.
    from data_pipeline.loader import TrainLoader

    loader = TrainLoader(
        data_dir, global_batch, seed=0, num_workers=num_workers, cache_dir=data_dir.parent / "wids"
    )
    list(itertools.islice(loader, 5))  # start workers, open shards
    start = time.perf_counter()
    tokens = sum(batch.numel() for batch in itertools.islice(loader, steps))
    elapsed = time.perf_counter() - start
    loader.close()
    return tokens / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--consumption-tokens-per-s",
        type=float,
        default=20000.0,
        help="training consumption to compare the loader against",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="keep the corpus and dataset here (reused when present)",
    )
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, help="tokenisation processes"
    )
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--loader-workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--steps", type=int, default=300, help="loader batches to time")
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = parser.parse_args(argv)

    scratch = None
    if args.work_dir is None:
        scratch = tempfile.TemporaryDirectory(prefix="bench-data-")
        args.work_dir = Path(scratch.name)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    corpus, data_dir = args.work_dir / "demo-corpus.jsonl", args.work_dir / "demo"
    results: dict[str, float] = {}
    if not corpus.exists():
        stats, results["demo_corpus_s"] = timed(lambda: build_demo_corpus(corpus, progress=False))
        print(
            f"demo-corpus: {stats['documents']} documents, {stats['bytes'] / 1e6:.2f} MB "
            f"in {results['demo_corpus_s']:.1f} s"
        )
    if not (data_dir / "index.json").exists():
        _, results["prepare_s"] = timed(
            lambda: prepare_dataset(
                [str(corpus)],
                data_dir,
                vocab_size=args.vocab_size,
                seq_len=args.seq_len,
                workers=args.workers,
                progress=False,
            )
        )
        print(
            f"prepare (vocab {args.vocab_size}, seq_len {args.seq_len}, "
            f"{args.workers} workers): {results['prepare_s']:.1f} s"
        )
    index = read_index(data_dir)
    results["tokenize_mb_per_s"] = bench_tokenize(corpus, index, args.workers, repeats=2)
    print(f"tokenisation: {results['tokenize_mb_per_s']:.2f} MB/s of text ({args.workers} workers)")
    for workers in args.loader_workers:
        rate = bench_loader(data_dir, args.global_batch, workers, args.steps)
        ratio = rate / args.consumption_tokens_per_s
        results[f"loader_tokens_per_s_workers{workers}"] = rate
        print(
            f"loader ({workers} DataLoader workers, global batch {args.global_batch} x "
            f"{index.sample_len}): {rate:,.0f} tokens/s = {ratio:.1f}x the consumption of "
            f"{args.consumption_tokens_per_s:,.0f} tokens/s "
            f"({'meets' if ratio >= 20 else 'BELOW'} the 20x goal)"
        )
    if args.json:
        print(json.dumps(results, indent=2))
    if scratch is not None:
        scratch.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
