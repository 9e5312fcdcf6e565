"""`python -m parallel.memory_probe`: one micro-batch's activation memory, measured
(parallel/strategies/memory_probe.py) against the estimate, per checkpointing mode."""

from __future__ import annotations

import json

import torch

from parallel.cli.run_config import config_parser, load_run
from parallel.strategies.checkpointing import apply_activation_checkpointing
from parallel.strategies.memory import estimate
from parallel.strategies.memory_probe import measure_activations
from parallel.strategies.plan import micro_batch_size
from pretrain.model import DenseFormer


def main(argv: list[str] | None = None) -> int:
    """Measured vs estimated activation bytes of one micro-batch, per checkpointing mode."""
    parser = config_parser(
        "python -m parallel.memory_probe",
        "Measure one micro-batch's activation memory (fp32, this process, no parallelism) in "
        "each checkpointing mode and compare with the estimator.", world_size=False)
    parser.add_argument("--modes", default="none,block,dwa_block",
                        help="comma-separated MODE or MODE:EVERY (default none,block,dwa_block)")
    args = parser.parse_args(argv)

    cfg, model_cfg = load_run(args, "train.dtype=fp32")
    model = DenseFormer(model_cfg, seed=cfg.train.seed)
    micro_batch = micro_batch_size(cfg.parallel, cfg.train.batch_size, 1)
    batch = torch.randint(0, model_cfg.vocab_size, (micro_batch, model_cfg.seq_len + 1),
                          generator=torch.Generator().manual_seed(0))
    rows = []
    for item in args.modes.split(","):
        mode, _, every = item.partition(":")
        every = int(every or 1)
        cfg.parallel.activation_checkpointing, cfg.parallel.checkpoint_every = mode, every
        apply_activation_checkpointing(model, mode, every)
        report = measure_activations(model, batch[:, :-1], batch[:, 1:])
        estimated = estimate(cfg.parallel, model_cfg, cfg.train.batch_size, cfg.train.dtype, 1,
                             "cpu")[0].activation_bytes
        rows.append({"mode": mode, "every": every, **report.as_dict(),
                     "estimated_bytes": estimated})
    if args.json:
        print(json.dumps(rows))
        return 0
    m = model_cfg
    print(f"{m.n_layers} x {m.d_model}, seq {m.seq_len}, micro-batch {micro_batch}, vocab "
          f"{m.vocab_size}, fp32; MiB:")
    print(f"{'mode':>14} {'autograd':>9} {'buffers':>9} {'recompute':>9} {'measured':>9} "
          f"{'estimated':>9} {'ratio':>6}")
    for r in rows:
        mib = [r[k] / 2**20 for k in ("saved_bytes", "dwa_buffer_bytes", "recompute_bytes",
                                      "total_bytes", "estimated_bytes")]
        print(f"{r['mode'] + ':' + str(r['every']):>14} " + " ".join(f"{v:9.1f}" for v in mib)
              + f" {r['estimated_bytes'] / r['total_bytes']:6.3f}")
    return 0
