"""`python -m slurm {sweep,fit,launch}`: scaling-law sweeps on Slurm, fits, the node launcher."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m slurm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from slurm import launch

    launch.add_arguments(sub.add_parser(
        "launch", help="start this node's training ranks (used by slurm/train.sbatch)"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "launch":
        from slurm.launch import launch

        return launch(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
