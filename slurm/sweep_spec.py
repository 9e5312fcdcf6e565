"""Sweep files: parse, validate and expand a scaling-law grid into training runs.

A sweep file (see configs/sweeps/) names a base training config and a grid:

    name: tiny-cpu                  # sweep id: letters, digits, . _ -
    base: ../tiny.yaml              # relative to the sweep file
    set: {train.batch_size: 8}      # dotted overrides for every run
    warmup_fraction: 0.1            # optional: optim.warmup_steps = round(f * steps)
    grid:
      architecture: [transformer, denseformer-1x1, denseformer-4x5]   # or {name:, set: {...}}
      shape: [{n_layers: 2, d_model: 32}, ...]   # model keys; or depth: [...] x width: [...]
      tokens: [5120, 10240]         # D per run; or tokens_per_param: [20]; or compute: [...]
      seed: [0]
      lr: [3e-3]                    # optional
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

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
RUN_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}"
TOP_KEYS = {"name", "base", "set", "warmup_fraction", "grid", "slurm", "experiment",
            "tracking_uri", "out"}
GRID_KEYS = {"architecture", "shape", "depth", "width", "head_dim", "tokens",
             "tokens_per_param", "compute", "seed", "lr"}
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


class SweepError(ValueError):
    """An invalid sweep file; the message names the key (and run) at fault."""


@dataclass
class Architecture:
    name: str
    overrides: dict[str, Any]


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

    def tags(self, sweep_id: str) -> dict[str, str]:
        """MLflow tags that the fit reads."""
        return {"sweep_id": sweep_id, "sweep_run": self.name, "architecture": self.architecture,
                "N": str(self.n_params), "D": str(self.tokens), "C": f"{self.compute:.6g}",
                "C_model": f"{self.model_flops:.6g}", "steps": str(self.config.train.steps),
                **{f"grid.{k}": str(v) for k, v in self.values.items()}}


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


def check_name(value: Any, key: str, pattern: str = NAME_PATTERN) -> str:
    """`value` if it is a safe name (letters, digits, . _ -), else SweepError naming `key`."""
    if not isinstance(value, str) or not re.fullmatch(pattern, value):
        raise SweepError(f"{key}: {value!r} is not a valid name: use letters, digits, '.', "
                         f"'_' and '-', starting with a letter or digit (pattern {pattern})")
    return value


def _list(grid: dict, key: str, kind: type | tuple, positive: bool = False) -> list | None:
    if key not in grid:
        return None
    values = grid[key] if isinstance(grid[key], list) else [grid[key]]
    if not values:
        raise SweepError(f"grid.{key}: empty list")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, kind) or (positive and not v > 0):
            raise SweepError(f"grid.{key}: expected {'positive ' if positive else ''}"
                             f"numbers, got {v!r}")
    return values


def parse_architecture(item: Any) -> Architecture:
    """"transformer", "denseformer-KxP", or {name: ..., set: {model.key: value}}."""
    if isinstance(item, str):
        if item == "transformer":
            return Architecture(item, {"model.dwa": False})
        match = re.fullmatch(r"denseformer-(\d+)x(\d+)", item)
        if match:
            k, p = int(match[1]), int(match[2])
            return Architecture(item, {"model.dwa": True, "model.dwa_dilation": k,
                                       "model.dwa_period": p})
        raise SweepError(f"grid.architecture: {item!r}: use transformer, denseformer-KxP "
                         "(e.g. denseformer-4x5) or {name: ..., set: {model.key: value}}")
    if isinstance(item, dict) and set(item) <= {"name", "set"} and "name" in item:
        overrides = item.get("set") or {}
        if not isinstance(overrides, dict):
            raise SweepError(f"grid.architecture: 'set' of {item['name']!r} must be a mapping")
        return Architecture(check_name(item["name"], "grid.architecture.name"), dict(overrides))
    raise SweepError(f"grid.architecture: cannot read {item!r}")


def parse_shapes(grid: dict) -> list[dict[str, Any]]:
    """grid.shape, or the product of grid.depth and grid.width (heads from head_dim)."""
    if "shape" in grid:
        if {"depth", "width"} & set(grid):
            raise SweepError("grid: give either shape or depth x width, not both")
        shapes = grid["shape"] if isinstance(grid["shape"], list) else [grid["shape"]]
        if not shapes or not all(isinstance(s, dict) and s for s in shapes):
            raise SweepError("grid.shape: expected a list of mappings of model keys, e.g. "
                             "{n_layers: 12, d_model: 768}")
        return [dict(s) for s in shapes]
    depths, widths = _list(grid, "depth", int, True), _list(grid, "width", int, True)
    if depths is None or widths is None:
        raise SweepError("grid: needs shape (a list of {n_layers, d_model, ...}) or both "
                         "depth and width")
    head_dim = grid.get("head_dim")
    shapes = []
    for d, w in itertools.product(depths, widths):
        shape = {"n_layers": d, "d_model": w}
        if head_dim is not None:
            if not isinstance(head_dim, int) or head_dim < 1 or w % head_dim:
                raise SweepError(f"grid.head_dim: {head_dim!r} must divide every width ({w})")
            shape["n_heads"] = w // head_dim
        shapes.append(shape)
    return shapes


def _si(value: float) -> str:
    """3 significant digits and a suffix: 5120 -> "5.12k", 2e9 -> "2G"."""
    for suffix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


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
    from pretrain.config import ConfigError, load_config

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


def expand(path: str | Path, cli_overrides: list[str] = (), out: str | Path | None = None,
           tracking_uri: str | None = None) -> Sweep:
    """Read a sweep file and expand it into validated runs (nothing is written)."""
    from parallel.memory import estimate as estimate_memory
    from pretrain.config import ConfigError, validate

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
    tokens = _list(grid, "tokens", (int, float), True)
    per_param = _list(grid, "tokens_per_param", (int, float), True)
    compute = _list(grid, "compute", (int, float), True)
    if sum(x is not None for x in (tokens, per_param, compute)) != 1 and not (
            compute and per_param and tokens is None):
        raise SweepError("grid: give exactly one budget: tokens, tokens_per_param or compute "
                         "(compute may come with one tokens_per_param to pick shapes)")
    if compute and per_param and len(per_param) != 1:
        raise SweepError("grid.tokens_per_param: with compute, give a single value")
    seeds = _list(grid, "seed", int) or [0]
    lrs = _list(grid, "lr", (int, float), True)

    runs: list[RunSpec] = []
    for arch, lr, seed in itertools.product(archs, lrs or [None], seeds):
        candidates = []  # (shape, cfg, model, N)
        for shape in shapes:
            layers = [("set", common), ("architecture", arch.overrides),
                      ("shape", {f"model.{k}": v for k, v in shape.items()})]
            if lr is not None:
                layers.append(("lr", {"optim.lr": lr}))
            cfg = _resolve_config(base, layers, list(cli_overrides), f"{arch.name} {shape}")
            vocab = cfg.model.vocab_size or _data_vocab(cfg.data.path)
            model = cfg.model.with_vocab(vocab or cfg.model.vocab_pad_multiple)
            candidates.append((shape, cfg, model, vocab, model.num_params(non_embedding=True)))
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
        for (_shape, cfg, model, vocab, n_params), target in plan:
            tokens_per_step = cfg.train.batch_size * model.seq_len
            steps = max(1, round(target / tokens_per_step))
            run_tokens = steps * tokens_per_step
            run_name = "-".join(
                [name, arch.name, f"L{model.n_layers}", f"W{model.d_model}",
                 f"D{_si(run_tokens)}", f"s{seed}"] + ([f"lr{lr:g}"] if lr is not None else []))
            check_name(run_name, "run name", RUN_NAME_PATTERN)
            cfg.train.steps = steps
            cfg.train.seed = seed
            cfg.train.resume = None
            cfg.train.stop_at = None
            if warmup_fraction is not None:
                cfg.optim.warmup_steps = round(warmup_fraction * steps)
            cfg.run.name = run_name
            cfg.run.dir = str(out_dir / "runs" / run_name)
            cfg.tracking.experiment = experiment
            cfg.tracking.uri = tracking_uri or data.get("tracking_uri") \
                or f"sqlite:///{out_dir / 'mlflow.db'}"
            if cfg.data.path and not Path(cfg.data.path).is_absolute():
                cfg.data.path = str(Path(cfg.data.path).absolute())
            world = slurm["nodes"] * slurm["nproc_per_node"]
            try:
                validate(cfg, world_size=world)
            except ConfigError as err:
                raise SweepError(f"run {run_name}: {err}") from None
            memory = None  # the largest rank's total; n/a until the vocabulary is known
            if vocab:
                gpu = slurm["gpus_per_node"] or cfg.train.device == "cuda"
                memory = max(r.total_bytes for r in estimate_memory(
                    cfg, world, "cuda" if gpu else "cpu", model))
            runs.append(RunSpec(
                index=len(runs), name=run_name, architecture=arch.name, config=cfg,
                n_params=n_params, tokens=run_tokens, compute=6.0 * n_params * run_tokens,
                model_flops=model.flops_per_token() * run_tokens,
                memory_bytes=memory,
                values={"n_layers": model.n_layers, "d_model": model.d_model, "seed": seed,
                        **({"lr": lr} if lr is not None else {})}))
    names = [r.name for r in runs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SweepError(f"grid: several runs would be named {duplicates[0]!r} (budgets that "
                         "round to the same number of steps?); make the grid values distinct")
    return Sweep(name=name, path=path, base=base, experiment=experiment,
                 tracking_uri=runs[0].config.tracking.uri if runs else None, out=out_dir,
                 slurm=slurm, runs=runs)


def _data_vocab(data_path: str | None) -> int | None:
    """The vocabulary size in DATA/index.json, or None if the data is not there (yet)."""
    if not data_path or not (Path(data_path) / "index.json").is_file():
        return None
    from data_pipeline.index import read_index

    return read_index(data_path, check_files=False).vocab_size
