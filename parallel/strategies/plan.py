"""The pipeline plan: which blocks each (virtual) stage holds, and what crosses each boundary.

    python -m parallel.plan --config FILE [--set key=value ...] [--world-size N]
        [--device cuda] [--json]

prints the plan of a run without starting ranks: the stages, and for every boundary the
tensors of each transfer mode and their bytes per micro-batch on one TP rank, in the dtype
they cross in (`boundary_dtype_bytes`: the compute dtype with `parallel.pipeline_dtype:
compute`, so 2 bytes under bf16; `--device` says what `train.dtype: auto` is). With `--json`
stdout carries only the JSON document:

    {"stages": [[first_block, last_block], ...],
     "boundaries": [{"after_block": b, "raw": n, "optimal": n, "bound": n,
                     "bytes_per_microbatch": {"raw": x, "optimal": y}}, ...],
     ..., "connection": "dwa", "model": "DenseFormer 1x1", ...}

For Attention Residuals (`model.connection: attnres`) `raw` counts the sources (the X_j a
later consumer reads) and `optimal` the hidden-size tensors sent, the fewer of the sources
and the consumer states (pretrain/model/attnres_program.py); each boundary also gives
"sources", "consumers", "rule" (how "bound" is reached: min(sources, consumers) for full
AttnRes, N + 1 block sums for block AttnRes) and "per_token": {"raw": 0, "optimal": 0 or 1},
the (consumers, tokens) fp32 lse that crosses with the states (in the bytes too).

For MUDD (`model.connection: mudd`, pretrain/model/mudd_program.py) `raw` counts X_0..X_b
(b + 1) and `optimal` the fewer of those and the later mixes' partial sums ("partial_sums":
sum_{i>=b} C_i, static weights only: dynamic weights read the consumer's X_i, so the
X_j cross raw); each boundary also gives "sources", "partial_sums" and "rule".

For Hyper-Connections (`model.connection: hc` or `mhc`, pretrain/model/hc_program.py) every
boundary carries one tensor in both modes, the n-stream state X_{2b}: `raw`, `optimal` and
`bound` are 1, "streams" is n, and the bytes are n hidden-size tensors'.

Partitioning (`stage_split`): an explicit `parallel.pp_split` (blocks per stage, in stage
order), or a balanced split that minimises the largest stage cost, then the spread. A block
costs 1; the embedding 1 more on the first stage (Megatron's
`account_for_embedding_in_pipeline_split`: its lookup is cheap, but its weight, gradient
and optimizer state sit there); the final norm + LM head on the last stage cost their
forward FLOPs in block units, 2 V H / (2 (4 + 2 m) H^2 + 4 S H) per token. With
`parallel.virtual_stages` v > 1 there are pp x v stages, stage s on pipeline rank s mod pp
(interleaved 1F1B).

Plain Python, no torch: config validation, the memory estimator and the sweep dry run build
plans quickly. The DWA pattern comes from the model config (`DenseFormerConfig.dwa_pattern`).
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel.strategies import stage_state
from parallel.strategies.config import ParallelSection
from pretrain.model import attnres_program, hc_program, mudd_program
from pretrain.model.config import ConfigError, DenseFormerConfig
from pretrain.model.dwa_pattern import DWAPattern

FP32_BYTES = 4


def block_cost_units(cfg: DenseFormerConfig) -> tuple[float, float]:
    """(embedding, head) cost in blocks, as documented at the top of this module."""
    h, s = cfg.d_model, cfg.seq_len
    block = 2.0 * cfg.block_matmul_params() + 4.0 * s * h
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


@dataclass(frozen=True)
class PipelinePlan:
    """Stages, their programs (parallel.strategies.stage_state.StageProgram) in the chosen mode, and
    the per-boundary tensor counts of both modes and of the lower bound."""

    config: DenseFormerConfig
    pattern: DWAPattern  # config.dwa_pattern, which the programs were made from
    pp: int
    virtual_stages: int
    transfer: str
    stages: list[tuple[int, int]]
    programs: list  # StageProgram per stage
    # Per boundary: {"after_block", "raw", "optimal", "bound"}; for AttnRes also "rule",
    # "sources", "consumers" and "per_token" ({mode: tensors that are per token, the lse}).
    counts: list[dict]

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    def rank_of_stage(self, stage: int) -> int:
        return stage % self.pp

    def stages_of_rank(self, pp_rank: int) -> list[int]:
        return [s for s in range(self.n_stages) if s % self.pp == pp_rank]

    def report(self, micro_batch: int | None = None, seq_shards: int = 1,
               dtype_bytes: int = FP32_BYTES) -> dict:
        """The JSON document of the module docstring; bytes for `micro_batch` sequences on
        one TP rank (the residual stream is replicated over TP, or split along the sequence
        into `seq_shards` = TP slices under sequence parallelism), `dtype_bytes` per element."""
        cfg = self.config
        per_tensor = None
        if micro_batch is not None:
            tokens = micro_batch * (cfg.seq_len // seq_shards)
            per_tensor = tokens * cfg.d_model * dtype_bytes
        boundaries = []
        for count in self.counts:
            entry = {**count, "per_token": dict(count["per_token"])} if "per_token" in count \
                else dict(count)
            if per_tensor is not None:
                # AttnRes: the states' lse, one fp32 per consumer and token.
                lse = {mode: count["consumers"] * tokens * FP32_BYTES if count.get(
                    "per_token", {}).get(mode) else 0 for mode in ("raw", "optimal")}
                # HC: each tensor is an n-stream state, n hidden-size tensors.
                width = count.get("streams", 1) * per_tensor
                entry["bytes_per_microbatch"] = {mode: count[mode] * width + lse[mode]
                                                 for mode in ("raw", "optimal")}
            boundaries.append(entry)
        return {"stages": [list(r) for r in self.stages], "boundaries": boundaries,
                "pp": self.pp, "virtual_stages": self.virtual_stages,
                "transfer": self.transfer, "connection": cfg.depth_connection,
                "model": cfg.architecture, "micro_batch": micro_batch,
                "seq_len": cfg.seq_len, "d_model": cfg.d_model,
                "dtype_bytes": dtype_bytes,
                "items": [[str(item) for item in p.outgoing] for p in self.programs[:-1]]}

    def describe(self, micro_batch: int | None = None, seq_shards: int = 1,
                 dtype_bytes: int = FP32_BYTES) -> list[str]:
        """Human-readable lines: the stages, then one line per boundary."""
        rep = self.report(micro_batch, seq_shards, dtype_bytes)
        stages = ", ".join(f"{a}-{b}" for a, b in self.stages)
        lines = [f"pipeline: {self.pp} ranks x {self.virtual_stages} virtual stages, blocks "
                 f"{stages}; transfer {self.transfer}"]
        if {"sources", "streams"} & set((rep["boundaries"] or [{}])[0]):
            lines[0] += f"; {rep['model']}"
        for entry, items in zip(rep["boundaries"], rep["items"], strict=True):
            sent = f"{entry[self.transfer]} tensors"
            if "streams" in entry:  # HC
                sent = f"one n-stream state ({entry['streams']} hidden-size tensors)"
            if entry.get("per_token", {}).get(self.transfer):
                sent += f" + {entry['per_token'][self.transfer]} per-token"
            size = ""
            if "bytes_per_microbatch" in entry:
                size = f", {entry['bytes_per_microbatch'][self.transfer] / 2**20:.2f} MiB"
            counts = f"raw {entry['raw']}, optimal {entry['optimal']}, bound {entry['bound']}"
            if "consumers" in entry:  # AttnRes
                counts = (f"sources {entry['sources']}, consumers {entry['consumers']}, "
                          f"{counts} = {entry['rule']}")
            elif "partial_sums" in entry:  # MUDD
                partial = entry["partial_sums"]
                counts = (f"sources {entry['sources']}, partial sums "
                          f"{'none (dynamic)' if partial is None else partial}, {counts} = "
                          f"{entry['rule']}")
            elif "streams" in entry:  # HC
                counts = f"{counts} = {entry['rule']}"
            lines.append(f"  after block {entry['after_block']}: {sent}{size} per "
                         f"micro-batch ({counts}): {' '.join(items)}")
        return lines


def build_plan(cfg: DenseFormerConfig, pp: int, virtual_stages: int = 1,
               split: list[int] | None = None, transfer: str = "optimal") -> PipelinePlan:
    """The PipelinePlan of a model shape and pipeline layout (from `cfg.dwa_pattern`, or
    `cfg.attnres_layout` for Attention Residuals)."""
    pattern = cfg.dwa_pattern
    stages = ranges(stage_split(cfg, pp, virtual_stages, split))
    boundaries = [last for _, last in stages[:-1]]
    if cfg.attnres_layout is not None:
        return _attnres_plan(cfg, pp, virtual_stages, transfer, stages, boundaries)
    if cfg.mudd_layout is not None:
        return _mudd_plan(cfg, pp, virtual_stages, transfer, stages, boundaries)
    if cfg.hc_layout is not None:
        return _hc_plan(cfg, pp, virtual_stages, transfer, stages, boundaries)
    programs = stage_state.stage_programs(pattern, stages, transfer)
    raw = stage_state.boundary_states(pattern, boundaries, "raw")
    optimal = stage_state.boundary_states(pattern, boundaries, "optimal")
    counts = [{"after_block": b, "raw": len(r), "optimal": len(o),
               "bound": stage_state.lower_bound(pattern, b)}
              for b, r, o in zip(boundaries, raw, optimal, strict=True)]
    return PipelinePlan(cfg, pattern, pp, virtual_stages, transfer, stages, programs, counts)


def _attnres_plan(cfg: DenseFormerConfig, pp: int, virtual_stages: int, transfer: str,
                  stages: list[tuple[int, int]], boundaries: list[int]) -> PipelinePlan:
    """The plan of an Attention Residuals model: `raw` sends the sources, `optimal` the
    fewer of sources and consumer states (pretrain/model/attnres_program.py)."""
    layout = cfg.attnres_layout
    programs = attnres_program.stage_programs(layout, stages, transfer)
    counts = []
    for b in boundaries:
        fewest = attnres_program.boundary_state(layout, b, "optimal")
        sizes = attnres_program.boundary_counts(layout, b)
        limit, rule = attnres_program.bound(layout, b)
        counts.append({"after_block": b, "raw": sizes.sources,
                       "optimal": attnres_program.hidden_items(fewest), "bound": limit,
                       "rule": rule, "sources": sizes.sources, "consumers": sizes.consumers,
                       "per_token": {"raw": 0, "optimal": len(fewest)
                                     - attnres_program.hidden_items(fewest)}})
    return PipelinePlan(cfg, cfg.dwa_pattern, pp, virtual_stages, transfer, stages, programs,
                        counts)


def _mudd_plan(cfg: DenseFormerConfig, pp: int, virtual_stages: int, transfer: str,
               stages: list[tuple[int, int]], boundaries: list[int]) -> PipelinePlan:
    """The plan of a MUDD model: `raw` sends X_0..X_b, `optimal` the fewer of those and the
    later mixes' partial sums (static weights; pretrain/model/mudd_program.py)."""
    layout = cfg.mudd_layout
    programs = mudd_program.stage_programs(layout, stages, transfer)
    counts = []
    for b in boundaries:
        sizes = mudd_program.boundary_counts(layout, b)
        limit, rule = mudd_program.bound(layout, b)
        counts.append({"after_block": b, "raw": sizes.sources,
                       "optimal": len(mudd_program.boundary_state(layout, b, "optimal")),
                       "bound": limit, "rule": rule, "sources": sizes.sources,
                       "partial_sums": sizes.partial if not layout.dynamic else None})
    return PipelinePlan(cfg, cfg.dwa_pattern, pp, virtual_stages, transfer, stages, programs,
                        counts)


def _hc_plan(cfg: DenseFormerConfig, pp: int, virtual_stages: int, transfer: str,
             stages: list[tuple[int, int]], boundaries: list[int]) -> PipelinePlan:
    """The plan of a Hyper-Connections model: one n-stream state per boundary, in either
    mode (pretrain/model/hc_program.py)."""
    layout = cfg.hc_layout
    programs = hc_program.stage_programs(layout, stages)
    counts = []
    for b in boundaries:
        limit, rule = hc_program.bound(layout, b)
        sent = len(hc_program.boundary_items(layout, b))
        counts.append({"after_block": b, "raw": sent, "optimal": sent, "bound": limit,
                       "rule": rule, "streams": layout.streams})
    return PipelinePlan(cfg, cfg.dwa_pattern, pp, virtual_stages, transfer, stages, programs,
                        counts)


def resolved_dtype(dtype: str, device: str = "cuda") -> str:
    """"bf16" or "fp32": a `train.dtype` setting, with auto as the trainer resolves it on
    `device`."""
    if dtype == "auto":
        return "bf16" if device == "cuda" else "fp32"
    return dtype


def boundary_dtype_bytes(parallel: ParallelSection, dtype: str, device: str = "cuda") -> int:
    """Bytes per element of the tensors crossing a stage boundary: 2 when the run computes
    in bf16 (`dtype`: train.dtype) and `parallel.pipeline_dtype` is compute, else 4 (fp32)."""
    compute = parallel.pipeline_dtype == "compute" and resolved_dtype(dtype, device) == "bf16"
    return 2 if compute else FP32_BYTES


def micro_batch_size(parallel: ParallelSection, batch_size: int,
                     world_size: int | None = None) -> int:
    """Sequences per micro-batch on one rank, of a global batch of `batch_size` sequences
    (train.batch_size); without a world size, data parallelism is taken as 1."""
    p = parallel
    if p.microbatches == "auto":
        raise ConfigError("parallel.microbatches", "auto is chosen at start-up from the GPU's "
                          "free memory (parallel/strategies/microbatch_fit.py): give a number here")
    dp = (world_size or p.tp * p.pp) // (p.tp * p.pp)
    return batch_size // (dp * p.microbatches)
