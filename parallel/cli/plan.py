"""`python -m parallel.plan`: the pipeline plan of a run config, without starting ranks (the
usage is parallel/strategies/plan.py's docstring)."""

from __future__ import annotations

import json
import sys

from parallel.cli.run_config import config_parser, load_run, note_ignored_keys
from parallel.strategies import plan as plan_module
from parallel.strategies.plan import boundary_dtype_bytes, build_plan, micro_batch_size


def main(argv: list[str] | None = None) -> int:
    parser = config_parser("python -m parallel.plan", plan_module.__doc__)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="what train.dtype=auto resolves to (default cuda: bf16)")
    args = parser.parse_args(argv)
    try:
        cfg, model = load_run(args)
        note_ignored_keys(model)
        p = cfg.parallel
        plan = build_plan(model, p.pp, p.virtual_stages, p.pp_split, p.pp_transfer)
    except ValueError as err:  # ConfigError is one
        print(f"error: {err}", file=sys.stderr)
        return 2
    micro_batch = micro_batch_size(cfg.parallel, cfg.train.batch_size, args.world_size)
    dtype_bytes = boundary_dtype_bytes(cfg.parallel, cfg.train.dtype, args.device)
    if args.json:
        print(json.dumps(plan.report(micro_batch, dtype_bytes=dtype_bytes)))
    else:
        print("\n".join(plan.describe(micro_batch, dtype_bytes=dtype_bytes)))
    return 0
