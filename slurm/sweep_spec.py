"""Sweep files: parse, validate and expand a scaling-law grid into training runs.

A sweep file (see configs/sweeps/) names a base training config and a grid:

    name: tiny-cpu                  # sweep id: letters, digits, . _ -
    base: ../tiny.yaml              # relative to the sweep file
    set: {train.batch_size: 8}      # dotted overrides for every run
    warmup_fraction: 0.1            # optional: optim.warmup_steps = round(f * steps)
    grid:
      architecture: [transformer, denseformer-1x1, denseformer-4x5]   # or {name:, set: {...}}
      shape: [{n_layers: 2, d_model: 32}, ...]   # model keys; or depth: [...] x width: [...]
                                    # or params: 20M with depth: [...] (slurm/sweep_shapes.py)
      tokens: [5120, 10240]         # D per run; or tokens_per_param: [20]; or compute: [...]
      seed: [0]
      lr: [3e-3]                    # optional; an architecture may carry its own lr: [...]
      warmup: [0.02, 0.1]           # optional: warm-up fractions, an axis like lr
    continue: {...}                 # optional dependent stage (slurm/sweep_stages.py)
    match_flops: transformer        # optional: a matched-FLOPs arm (slurm/sweep_flops.py)
    lm_eval: {tasks: [...]}         # optional: downstream tasks after each run (sweep_stages)
    inference: {batch: 1}           # optional: generation speed after each run (sweep_stages)
    slurm: {nodes: 1, nproc_per_node: 1, cpus_per_task: 1, time: "00:10:00", max_parallel: 2}

Budgets: `tokens` fixes D; `tokens_per_param: r` sets D = r * N; `compute: C` gives each
shape D = C / (6 N) (IsoFLOP), and with a single `tokens_per_param: r` next to it, picks
per budget the one shape whose N is closest to sqrt(C / (6 r)). Steps are D / (batch x
seq_len), rounded; D is then recomputed from the steps. N is the non-embedding parameter
count (`DenseFormerConfig.num_params(non_embedding=True)`); compute is C = 6 N D (Kaplan et
al.); the model FLOPs `flops_per_token() * D` (attention and LM head included) are kept too.

Run names are built from the grid values (stable across invocations) and, like the sweep and
architecture names, must match NAME_PATTERN: they reach file names, sbatch and MLflow.
"""

from __future__ import annotations

import itertools
import math
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from data_pipeline.index import read_index
from parallel.strategies.memory import estimate as estimate_memory
from pretrain.config import ConfigError, load_config, validate
from slurm.sweep_axes import (
    RUN_NAME_PATTERN,
    Architecture,
    check_name,
    number_list,
    parse_architecture,
    si_format,
)
from slurm.sweep_errors import SweepError
from slurm.sweep_flops import flops_matched_runs
from slurm.sweep_shapes import matched_shapes, parse_shapes
from slurm.sweep_stages import continuation_runs, inference_settings, lm_eval_settings

TOP_KEYS = {"name", "base", "set", "warmup_fraction", "grid", "slurm", "experiment",
            "tracking_uri", "out", "continue", "lm_eval", "inference", "match_flops"}
GRID_KEYS = {"architecture", "shape", "depth", "width", "head_dim", "params", "tokens",
             "tokens_per_param", "compute", "seed", "lr", "warmup"}
SLURM_DEFAULTS: dict[str, Any] = {
    "nodes": 1, "nproc_per_node": 1, "cpus_per_task": 1, "gpus_per_node": 0,
    "time": None, "partition": None, "account": None, "max_parallel": 4,
    "signal_seconds": 120, "extra_args": []}


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads 1e-3 and 3.0e18 as floats (YAML 1.1 wants 3.0e+18), as
    pretrain.config does for training configs."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


@dataclass
class RunSpec:
    """One run of the sweep, fully resolved."""

    index: int
    name: str
    architecture: str
    config: Any  # pretrain.config.Config
    n_params: int  # non-embedding N
    tokens: int  # D = steps * batch * seq_len
    compute: float  # C = 6 N D
    model_flops: float  # flops_per_token() * D
    memory_bytes: float | None
    values: dict[str, Any] = field(default_factory=dict)  # the grid values of this run
    shape: dict[str, Any] = field(default_factory=dict)  # its model keys from the grid
    depends_on: int | None = None  # index of the run it continues (a dependent stage)
    stage_tags: dict[str, str] = field(default_factory=dict)

    def tags(self, sweep_id: str) -> dict[str, str]:
        """MLflow tags that the fit and the report read."""
        return {"sweep_id": sweep_id, "sweep_run": self.name, "architecture": self.architecture,
                "N": str(self.n_params), "D": str(self.tokens), "C": f"{self.compute:.6g}",
                "C_model": f"{self.model_flops:.6g}", "steps": str(self.config.train.steps),
                **{f"grid.{k}": str(v) for k, v in self.values.items()}, **self.stage_tags}


@dataclass
class Sweep:
    name: str
    path: Path
    base: Path
    experiment: str
    tracking_uri: str | None
    out: Path
    slurm: dict[str, Any]
    runs: list[RunSpec]
    lm_eval: dict[str, Any] | None = None  # downstream tasks after each run
    inference: dict[str, int] | None = None  # generation speed after each run


def load_sweep_file(path: str | Path) -> dict:
    """The mapping in a sweep file (floats like 3.0e18 read as numbers); top keys checked."""
    path = Path(path)
    try:
        data = yaml.load(path.read_text(), Loader=_Loader)
    except OSError as err:
        raise SweepError(f"{path}: cannot read: {err}") from None
    except yaml.YAMLError as err:
        raise SweepError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise SweepError(f"{path}: expected a mapping with name, base and grid")
    unknown = set(data) - TOP_KEYS
    if unknown:
        raise SweepError(f"{path}: unknown keys {sorted(unknown)}; known: {sorted(TOP_KEYS)}")
    return data


def _yaml_sections(overrides: dict[str, Any], key: str) -> dict[str, dict[str, Any]]:
    sections: dict[str, dict[str, Any]] = {}
    for dotted, value in overrides.items():
        section, _, name = str(dotted).partition(".")
        if not name:
            raise SweepError(f"{key}: {dotted!r} is not a dotted config key (section.key)")
        sections.setdefault(section, {})[name] = value
    return sections


def _resolve_config(base: Path, layers: list[tuple[str, dict]], cli_overrides: list[str],
                    run: str):
    """Base config + layered dotted overrides (YAML values) + command-line overrides."""
    merged: dict[str, Any] = {}
    for _key, overrides in layers:
        merged.update(overrides)
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "run.yaml"
        file.write_text(yaml.safe_dump({"base": str(base),
                                        **_yaml_sections(merged, "set")}))
        try:
            return load_config(file, cli_overrides)
        except ConfigError as err:
            raise SweepError(f"run {run}: {err}") from None


@dataclass
class RunContext:
    """What every run of a sweep shares: builds and finishes the runs of each stage."""

    name: str
    base: Path
    common: dict[str, Any]
    cli_overrides: list[str]
    warmup_fraction: float | None
    out_dir: Path
    experiment: str
    tracking_uri: str | None
    slurm: dict[str, Any]

    def resolve(self, arch: Architecture, shape: dict[str, Any], lr: float | None, what: str,
                extra: dict[str, Any] | None = None):
        """(config, model config with its vocabulary, vocabulary or None) of one run."""
        layers = [("set", self.common), ("architecture", arch.overrides),
                  ("shape", {f"model.{k}": v for k, v in shape.items()}),
                  ("stage", extra or {})]
        if lr is not None:
            layers.append(("lr", {"optim.lr": lr}))
        cfg = _resolve_config(self.base, layers, self.cli_overrides, what)
        vocab = cfg.model.vocab_size or _data_vocab(cfg.data.path)
        return cfg, cfg.model.with_vocab(vocab or cfg.model.vocab_pad_multiple), vocab

    def finish(self, index: int, prefix: str, architecture: str, cfg, model, vocab,
               target_tokens: float, seed: int, axes: dict[str, float],
               shape: dict[str, Any]) -> RunSpec:
        """The run of `target_tokens` (rounded to whole steps) with its name, run dir,
        tracking, seed and warm-up set, validated, with N, D, C and its memory estimate."""
        tokens_per_step = cfg.train.batch_size * model.seq_len
        steps = max(1, round(target_tokens / tokens_per_step))
        run_tokens = steps * tokens_per_step
        run_name = "-".join(
            [prefix, f"L{model.n_layers}", f"W{model.d_model}", f"D{si_format(run_tokens)}",
             f"s{seed}"] + ([f"lr{axes['lr']:g}"] if "lr" in axes else [])
            + ([f"wu{axes['warmup']:g}"] if "warmup" in axes else []))
        check_name(run_name, "run name", RUN_NAME_PATTERN)
        cfg.train.steps = steps
        cfg.train.seed = seed
        cfg.train.resume = None
        cfg.train.stop_at = None
        fraction = axes.get("warmup", self.warmup_fraction)
        if fraction is not None:
            cfg.optim.warmup_steps = round(fraction * steps)
        cfg.run.name = run_name
        cfg.run.dir = str(self.out_dir / "runs" / run_name)
        cfg.tracking.experiment = self.experiment
        cfg.tracking.uri = self.tracking_uri or f"sqlite:///{self.out_dir / 'mlflow.db'}"
        if cfg.data.path and not Path(cfg.data.path).is_absolute():
            cfg.data.path = str(Path(cfg.data.path).absolute())
        world = self.slurm["nodes"] * self.slurm["nproc_per_node"]
        try:
            validate(cfg, world_size=world)
        except ConfigError as err:
            raise SweepError(f"run {run_name}: {err}") from None
        memory = None  # the largest rank's total; n/a until the vocabulary is known, and
        # with parallel.microbatches: auto, which the GPU's free memory decides at start-up
        if vocab and cfg.parallel.microbatches != "auto":
            gpu = self.slurm["gpus_per_node"] or cfg.train.device == "cuda"
            memory = max(r.total_bytes for r in estimate_memory(
                cfg.parallel, model, cfg.train.batch_size, cfg.train.dtype, world,
                "cuda" if gpu else "cpu", cfg.optim.decay_alphas))
        n_params = model.num_params(non_embedding=True)
        return RunSpec(
            index=index, name=run_name, architecture=architecture, config=cfg,
            n_params=n_params, tokens=run_tokens, compute=6.0 * n_params * run_tokens,
            model_flops=model.flops_per_token() * run_tokens, memory_bytes=memory,
            values={"n_layers": model.n_layers, "d_model": model.d_model, "seed": seed,
                    **axes},
            shape=dict(shape))


def expand(path: str | Path, cli_overrides: list[str] = (), out: str | Path | None = None,
           tracking_uri: str | None = None) -> Sweep:
    """Read a sweep file and expand it into validated runs (nothing is written)."""

    path = Path(path).resolve()
    data = load_sweep_file(path)
    name = check_name(data.get("name"), "name")
    if not isinstance(data.get("base"), str):
        raise SweepError("base: expected the path of a training config, relative to the "
                         "sweep file")
    base = (path.parent / data["base"]).resolve()
    if not base.is_file():
        raise SweepError(f"base: {base} does not exist")
    common = data.get("set") or {}
    if not isinstance(common, dict):
        raise SweepError("set: expected a mapping of dotted config keys to values")
    warmup_fraction = data.get("warmup_fraction")
    if warmup_fraction is not None and not (isinstance(warmup_fraction, (int, float))
                                            and 0 <= warmup_fraction < 1):
        raise SweepError(f"warmup_fraction: expected a number in [0, 1), got {warmup_fraction!r}")
    slurm = {**SLURM_DEFAULTS, **(data.get("slurm") or {})}
    unknown = set(slurm) - set(SLURM_DEFAULTS)
    if unknown:
        raise SweepError(f"slurm: unknown keys {sorted(unknown)}; known: {sorted(SLURM_DEFAULTS)}")
    for key in ("nodes", "nproc_per_node", "cpus_per_task", "max_parallel"):
        if isinstance(slurm[key], bool) or not isinstance(slurm[key], int) or slurm[key] < 1:
            raise SweepError(f"slurm.{key}: expected a positive integer, got {slurm[key]!r}")
    for key in ("time", "partition", "account"):
        if slurm[key] is not None and not (isinstance(slurm[key], str)
                                           and re.fullmatch(r"[A-Za-z0-9:_.,=+-]+", slurm[key])):
            raise SweepError(f"slurm.{key}: {slurm[key]!r} is not a valid value")
    extra = slurm["extra_args"]
    if not isinstance(extra, list) or not all(
            isinstance(a, str) and re.fullmatch(r"--[A-Za-z][A-Za-z0-9-]*(=[^\s]+)?", a)
            for a in extra):
        raise SweepError(f"slurm.extra_args: expected a list of '--option=value' strings "
                         f"without spaces, got {extra!r}")
    experiment = check_name(data.get("experiment", f"sweep-{name}"), "experiment")
    out_dir = Path(out or data.get("out") or f"runs/sweeps/{name}").absolute()

    grid = data.get("grid")
    if not isinstance(grid, dict):
        raise SweepError("grid: expected a mapping (architecture, shape, tokens, seed, ...)")
    unknown = set(grid) - GRID_KEYS
    if unknown:
        raise SweepError(f"grid: unknown keys {sorted(unknown)}; known: {sorted(GRID_KEYS)}")
    archs = [parse_architecture(a) for a in (grid.get("architecture") or ["transformer"])]
    if len({a.name for a in archs}) != len(archs):
        raise SweepError("grid.architecture: names must be unique")
    shapes = parse_shapes(grid)
    tokens = number_list(grid, "tokens", (int, float), True)
    per_param = number_list(grid, "tokens_per_param", (int, float), True)
    compute = number_list(grid, "compute", (int, float), True)
    if sum(x is not None for x in (tokens, per_param, compute)) != 1 and not (
            compute and per_param and tokens is None):
        raise SweepError("grid: give exactly one budget: tokens, tokens_per_param or compute "
                         "(compute may come with one tokens_per_param to pick shapes)")
    if compute and per_param and len(per_param) != 1:
        raise SweepError("grid.tokens_per_param: with compute, give a single value")
    seeds = number_list(grid, "seed", int) or [0]
    lrs = number_list(grid, "lr", (int, float), True)
    warmups = number_list(grid, "warmup", (int, float))
    for fraction in (warmups or []) + [w for a in archs for w in a.warmups or []]:
        if not 0 <= fraction < 1:
            raise SweepError(f"warmup: fractions must be in [0, 1), got {fraction!r}")
    context = RunContext(name=name, base=base, common=common, cli_overrides=list(cli_overrides),
                         warmup_fraction=warmup_fraction, out_dir=out_dir,
                         experiment=experiment,
                         tracking_uri=tracking_uri or data.get("tracking_uri"), slurm=slurm)

    runs: list[RunSpec] = []
    if "params" in grid:  # widths matched on the base config, the same for every architecture
        cfg = _resolve_config(base, [("set", common)], context.cli_overrides, "grid.params")
        shapes = matched_shapes(grid, cfg.model.with_vocab(
            cfg.model.vocab_size or _data_vocab(cfg.data.path) or cfg.model.vocab_pad_multiple))
    for arch in archs:  # run order as before per-architecture grids: arch, lr, seed
        for lr, warmup, seed in itertools.product(arch.lrs or lrs or [None],
                                                  arch.warmups or warmups or [None], seeds):
            candidates = []  # (shape, cfg, model, vocab, N)
            for shape in shapes:
                cfg, model, vocab = context.resolve(arch, shape, lr, f"{arch.name} {shape}")
                candidates.append((shape, cfg, model, vocab,
                                   model.num_params(non_embedding=True)))
            plan = []  # (candidate, target tokens)
            if tokens:
                plan = [(c, d) for c in candidates for d in tokens]
            elif per_param and not compute:
                plan = [(c, r * c[4]) for c in candidates for r in per_param]
            elif compute and not per_param:
                plan = [(c, budget / (6 * c[4])) for c in candidates for budget in compute]
            else:
                for budget in compute:
                    best_n = math.sqrt(budget / (6 * per_param[0]))
                    c = min(candidates, key=lambda c: abs(math.log(c[4] / best_n)))
                    plan.append((c, budget / (6 * c[4])))
            for (shape, cfg, model, vocab, _n), target in plan:
                values = {"lr": lr, "warmup": warmup}
                runs.append(context.finish(
                    len(runs), f"{name}-{arch.name}", arch.name, cfg, model, vocab, target,
                    seed, {k: v for k, v in values.items() if v is not None}, shape))
    if "match_flops" in data:
        if "continue" in data:
            raise SweepError("match_flops and continue: give one of them (a continuation has "
                             "no FLOPs-matched twin)")
        runs += flops_matched_runs(data["match_flops"], runs, archs, context, bool(tokens))
    if "continue" in data:
        runs += continuation_runs(data["continue"], runs, context)
    names = [r.name for r in runs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SweepError(f"grid: several runs would be named {duplicates[0]!r} (budgets that "
                         "round to the same number of steps?); make the grid values distinct")
    return Sweep(name=name, path=path, base=base, experiment=experiment,
                 tracking_uri=runs[0].config.tracking.uri if runs else None, out=out_dir,
                 slurm=slurm, runs=runs,
                 lm_eval=lm_eval_settings(data.get("lm_eval"), path.parent),
                 inference=inference_settings(data.get("inference")))


def _data_vocab(data_path: str | None) -> int | None:
    """The vocabulary size in DATA/index.json, or None if the data is not there (yet)."""
    if not data_path or not (Path(data_path) / "index.json").is_file():
        return None

    return read_index(data_path, check_files=False).vocab_size
