"""`python -m slurm {sweep,fit,report,launch}`: sweeps on Slurm, fits, study reports, the node
launcher."""

from __future__ import annotations

import argparse
import sys

from pretrain.config import override_argument
from slurm import fit, launch, report
from slurm.fit import cmd_fit
from slurm.report import cmd_report
from slurm.sweep import cmd_sweep


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m slurm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    sweep = sub.add_parser("sweep", help="expand a sweep file; print its runs or submit them "
                           "as one job array")
    sweep.add_argument("sweep_file", help="sweep YAML (see configs/sweeps/)")
    mode = sweep.add_mutually_exclusive_group(required=True)
    mode.add_argument("--dry-run", action="store_true",
                      help="print the runs with N, D, C and estimated memory; write nothing")
    mode.add_argument("--submit", action="store_true",
                      help="write the sweep directory, create the MLflow experiment, sbatch")
    sweep.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="KEY=VALUE", type=override_argument,
                       help="config override for every run")
    sweep.add_argument("--out", help="sweep directory (default: the file's out, or "
                       "runs/sweeps/<name>)")
    sweep.add_argument("--no-preflight", action="store_true",
                       help="submit without first running each task's start-up checks "
                       "(data, tokenizer, shards, run directories): for data that only "
                       "the compute nodes can see")
    sweep.add_argument("--tracking-uri", help="MLflow store (default: the file's "
                       "tracking_uri, or sqlite:///<out>/mlflow.db)")

    fit.add_arguments(sub.add_parser(
        "fit", help="fit scaling laws to a sweep's MLflow runs; print, plot, log"))

    report.add_arguments(sub.add_parser(
        "report", help="one self-contained HTML report of a study's MLflow runs"))

    launch.add_arguments(sub.add_parser(
        "launch", help="start this node's training ranks (used by slurm/train.sbatch)"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "sweep":
        return cmd_sweep(args)
    if args.command == "fit":
        return cmd_fit(args)
    if args.command == "report":
        return cmd_report(args)
    if args.command == "launch":
        return launch.launch(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
