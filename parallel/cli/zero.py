"""`python -m parallel.zero --build-ops`: JIT-build DeepSpeed's CPU op ahead of the first
ZeRO run (scripts/test.sh does, before the tests)."""

from __future__ import annotations

import argparse

from parallel.strategies.zero import build_ops


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel.zero")
    parser.add_argument("--build-ops", action="store_true",
                        help="JIT-build DeepSpeed's CPU op into TORCH_EXTENSIONS_DIR and exit")
    if parser.parse_args(argv).build_ops:
        build_ops()
    return 0
