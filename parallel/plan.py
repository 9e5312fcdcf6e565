"""The pipeline plan: which blocks each (virtual) stage holds, and what crosses each boundary.

    python -m parallel.plan --config FILE [--set key=value ...] [--world-size N] [--json]

prints the plan of a run without starting ranks: the stages, and for every boundary the
tensors of each transfer mode and their bytes per micro-batch on one TP rank. With `--json`
stdout carries only the JSON document:

    {"stages": [[first_block, last_block], ...],
     "boundaries": [{"after_block": b, "raw": n, "optimal": n, "bound": n,
                     "bytes_per_microbatch": {"raw": x, "optimal": y}}, ...], ...}

Partitioning (`stage_split`): an explicit `parallel.pp_split` (blocks per stage, in stage
order), or a balanced split that minimises the largest stage cost, then the spread. A block
costs 1; the embedding 1 more on the first stage (Megatron's
`account_for_embedding_in_pipeline_split`: its lookup is cheap, but its weight, gradient
and optimizer state sit there); the final norm + LM head on the last stage cost their
forward FLOPs in block units, 2 V H / (2 (4 + 2 m) H^2 + 4 S H) per token. With
`parallel.virtual_stages` v > 1 there are pp x v stages, stage s on pipeline rank s mod pp
(interleaved 1F1B).

Only the standard library is imported at module level (config validation and the CLI stay
light); torch comes in with the DWA pattern when a plan is built.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from pretrain.model.config import DenseFormerConfig

BOUNDARY_DTYPE_BYTES = 4  # the residual stream crosses stages in fp32


def block_cost_units(cfg: DenseFormerConfig) -> tuple[float, float]:
    """(embedding, head) cost in blocks, as documented at the top of this module."""
    h, s, m = cfg.d_model, cfg.seq_len, cfg.mlp_ratio
    block = 2.0 * (4 + 2 * m) * h * h + 4.0 * s * h
    head = 2.0 * cfg.padded_vocab_size * h
    return 1.0, head / block


def balanced_split(n_layers: int, n_stages: int, first_extra: float = 0.0,
                   last_extra: float = 0.0) -> list[int]:
    """Blocks per stage (each >= 1) minimising the largest stage cost (a block costs 1; the
    first and last stages carry `first_extra` / `last_extra` more), then the sum of squared
    stage costs (the most even among the optimal splits)."""
    if not 1 <= n_stages <= n_layers:
        raise ValueError(f"{n_stages} stages need between 1 and n_layers={n_layers} stages")

    def cost(stage: int, blocks: int) -> float:
        extra = (first_extra if stage == 0 else 0.0) + (
            last_extra if stage == n_stages - 1 else 0.0)
        return blocks + extra

    def solve(limit: float | None) -> tuple[float, list[int]] | None:
        # best[s][n]: (objective, split) for the first s stages holding n blocks
        best: list[dict[int, tuple[float, list[int]]]] = [{0: (0.0, [])}]
        for s in range(n_stages):
            layer: dict[int, tuple[float, list[int]]] = {}
            for used, (value, split) in best[s].items():
                for m in range(1, n_layers - used - (n_stages - s - 1) + 1):
                    c = cost(s, m)
                    if limit is not None and c > limit + 1e-9:
                        continue
                    new = max(value, c) if limit is None else value + c * c
                    if used + m not in layer or new < layer[used + m][0] - 1e-12:
                        layer[used + m] = (new, split + [m])
            best.append(layer)
        return best[n_stages].get(n_layers)

    smallest_max, _ = solve(None)
    return solve(smallest_max)[1]


def stage_split(cfg: DenseFormerConfig, pp: int, virtual_stages: int = 1,
                split: list[int] | None = None) -> list[int]:
    """Blocks per stage: `split` checked, or `balanced_split` with embedding and head costs."""
    n_stages = pp * virtual_stages
    if split is not None:
        if len(split) != n_stages or any(m < 1 for m in split) or sum(split) != cfg.n_layers:
            raise ValueError(f"pp_split {split} must give each of the {n_stages} stages "
                             f"(pp x virtual_stages) >= 1 block, {cfg.n_layers} in all")
        return list(split)
    embed, head = block_cost_units(cfg)
    return balanced_split(cfg.n_layers, n_stages, embed, head)


def ranges(split: list[int]) -> list[tuple[int, int]]:
    """Blocks per stage -> inclusive (first, last) block ranges, blocks numbered from 1."""
    out, first = [], 1
    for m in split:
        out.append((first, first + m - 1))
        first += m
    return out


def schedule_name(pp: int, virtual_stages: int, microbatches: int) -> str:
    """The torch.distributed.pipelining schedule used for this layout."""
    if virtual_stages > 1:
        return "ScheduleInterleaved1F1B"
    return "Schedule1F1B" if microbatches >= pp else "ScheduleGPipe"


def schedule_problem(pp: int, virtual_stages: int, microbatches: int) -> str | None:
    """Why `microbatches` does not fit the schedule (None if it does)."""
    if virtual_stages > 1 and pp > 1:
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            return (f"interleaved 1F1B runs micro-batches in rounds of pp={pp}: "
                    f"{microbatches} is not a multiple of its {rounds} rounds; use a "
                    f"multiple of {pp} or fewer than {2 * pp}")
    return None


@dataclass(frozen=True)
class PipelinePlan:
    """Stages, their programs (parallel.stage_state.StageProgram) in the chosen mode, and the
    per-boundary tensor counts of both modes and of the lower bound."""

    config: DenseFormerConfig
    pp: int
    virtual_stages: int
    transfer: str
    stages: list[tuple[int, int]]
    programs: list  # StageProgram per stage
    counts: list[dict[str, int]]  # per boundary: {"after_block", "raw", "optimal", "bound"}

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    def rank_of_stage(self, stage: int) -> int:
        return stage % self.pp

    def stages_of_rank(self, pp_rank: int) -> list[int]:
        return [s for s in range(self.n_stages) if s % self.pp == pp_rank]

    def report(self, micro_batch: int | None = None, seq_shards: int = 1) -> dict:
        """The JSON document of the module docstring; bytes for `micro_batch` sequences on
        one TP rank (the residual stream is replicated over TP, or split along the sequence
        into `seq_shards` = TP slices under sequence parallelism)."""
        cfg = self.config
        per_tensor = None
        if micro_batch is not None:
            per_tensor = (micro_batch * (cfg.seq_len // seq_shards) * cfg.d_model
                          * BOUNDARY_DTYPE_BYTES)
        boundaries = []
        for count in self.counts:
            entry = dict(count)
            if per_tensor is not None:
                entry["bytes_per_microbatch"] = {mode: count[mode] * per_tensor
                                                 for mode in ("raw", "optimal")}
            boundaries.append(entry)
        return {"stages": [list(r) for r in self.stages], "boundaries": boundaries,
                "pp": self.pp, "virtual_stages": self.virtual_stages,
                "transfer": self.transfer, "micro_batch": micro_batch,
                "seq_len": cfg.seq_len, "d_model": cfg.d_model,
                "dtype_bytes": BOUNDARY_DTYPE_BYTES,
                "items": [[str(item) for item in p.outgoing] for p in self.programs[:-1]]}

    def describe(self, micro_batch: int | None = None, seq_shards: int = 1) -> list[str]:
        """Human-readable lines: the stages, then one line per boundary."""
        rep = self.report(micro_batch, seq_shards)
        stages = ", ".join(f"{a}-{b}" for a, b in self.stages)
        lines = [f"pipeline: {self.pp} ranks x {self.virtual_stages} virtual stages, blocks "
                 f"{stages}; transfer {self.transfer}"]
        for entry, items in zip(rep["boundaries"], rep["items"], strict=True):
            sent = entry[self.transfer]
            size = ""
            if "bytes_per_microbatch" in entry:
                size = f", {entry['bytes_per_microbatch'][self.transfer] / 2**20:.2f} MiB"
            lines.append(f"  after block {entry['after_block']}: {sent} tensors{size} per "
                         f"micro-batch (raw {entry['raw']}, optimal {entry['optimal']}, "
                         f"bound {entry['bound']}): {' '.join(items)}")
        return lines


def build_plan(cfg: DenseFormerConfig, pp: int, virtual_stages: int = 1,
               split: list[int] | None = None, transfer: str = "optimal") -> PipelinePlan:
    """The PipelinePlan of a model shape and pipeline layout."""
    from parallel import stage_state
    from pretrain.model.dwa import dwa_inputs

    stages = ranges(stage_split(cfg, pp, virtual_stages, split))
    inputs = dwa_inputs(cfg)
    k = cfg.dwa_dilation
    programs = stage_state.stage_programs(inputs, cfg.n_layers, k, stages, transfer)
    boundaries = [last for _, last in stages[:-1]]
    raw = stage_state.boundary_states(inputs, k, boundaries, "raw")
    optimal = stage_state.boundary_states(inputs, k, boundaries, "optimal")
    counts = [{"after_block": b, "raw": len(r), "optimal": len(o),
               "bound": stage_state.lower_bound(inputs, k, b)}
              for b, r, o in zip(boundaries, raw, optimal, strict=True)]
    return PipelinePlan(cfg, pp, virtual_stages, transfer, stages, programs, counts)


def plan_from_config(cfg, world_size: int | None = None) -> tuple[PipelinePlan, int]:
    """(plan, micro-batch size) of a run config (pretrain.config.Config); without a world
    size, data parallelism is taken as 1."""
    from pretrain.config import ConfigError

    p = cfg.parallel
    if cfg.model.vocab_size is None:
        vocab = _vocab_from_data(cfg.data.path)
        if vocab is None:
            raise ConfigError("model.vocab_size", "is null and data.path has no index.json: "
                              "set it (the LM head's cost enters the balanced split)")
        cfg.model.vocab_size = vocab
    model = cfg.model.build_config()
    dp = (world_size or p.tp * p.pp) // (p.tp * p.pp)
    micro_batch = cfg.train.batch_size // (dp * p.microbatches)
    return build_plan(model, p.pp, p.virtual_stages, p.pp_split, p.pp_transfer), micro_batch


def _vocab_from_data(path) -> int | None:
    from pathlib import Path

    if path and (Path(path) / "index.json").exists():
        from data_pipeline.index import read_index

        return read_index(path, check_files=False).vocab_size
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML run config")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--world-size", type=int, default=None,
                        help="number of ranks (sets the data-parallel size; default tp x pp)")
    parser.add_argument("--json", action="store_true", help="print only the JSON document")
    args = parser.parse_args(argv)

    from pretrain.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides, world_size=args.world_size)
        plan, micro_batch = plan_from_config(cfg, args.world_size)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.report(micro_batch)))
    else:
        print("\n".join(plan.describe(micro_batch)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
