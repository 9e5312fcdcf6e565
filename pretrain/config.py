"""The run configuration: nested dataclasses, one per section, loaded from YAML + overrides.

    cfg = load_config("configs/tiny.yaml", ["train.steps=10", "model.dwa=false"])

Every section has defaults that run. A YAML file may name a `base:` file (relative to itself)
whose values it overrides. Unknown keys, wrong types and inconsistent values raise
ConfigError naming the dotted key, before any rank is spawned. The key reference is
docs_config.md (merged into README.md).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from pretrain.model.config import DenseFormerConfig, ModelConfigError


class ConfigError(ValueError):
    """An invalid configuration value; `key` is the dotted key, e.g. "model.n_heads"."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


# ---------------------------------------------------------------------------------------------
# Sections


@dataclass
class RunSection:
    dir: str | None = None  # None: runs/<name>-<timestamp>, decided by the trainer
    name: str = "denseformer"


def _model_section_fields() -> list[tuple[str, Any, Any]]:
    """DenseFormerConfig's fields, except that vocab_size may be None (taken from the data)."""
    hints = typing.get_type_hints(DenseFormerConfig)
    fields = []
    for f in dataclasses.fields(DenseFormerConfig):
        if f.name == "vocab_size":
            fields.append((f.name, int | None, field(default=None)))
        elif f.default is not dataclasses.MISSING:
            fields.append((f.name, hints[f.name], field(default=f.default)))
        else:
            fields.append((f.name, hints[f.name], field(default_factory=f.default_factory)))
    return fields


def _build_config(self, vocab_size: int | None = None) -> DenseFormerConfig:
    """The DenseFormerConfig of this section; `vocab_size` fills a null model.vocab_size."""
    if vocab_size is None:
        vocab_size = self.vocab_size
    if vocab_size is None:
        raise ConfigError("model.vocab_size", "is null: pass the vocabulary size of the data")
    kwargs = dataclasses.asdict(self)
    kwargs["vocab_size"] = vocab_size
    try:
        return DenseFormerConfig(**kwargs)
    except ModelConfigError as err:
        key = f"model.{err.key}"
        raise ConfigError(key, str(err).removeprefix(f"{key}: ")) from None


# Generated from DenseFormerConfig so that a field added to the model is a config key at once.
ModelSection = dataclasses.make_dataclass(
    "ModelSection", _model_section_fields(),
    namespace={"build_config": _build_config,
               "__doc__": "The model shape: DenseFormerConfig's fields, vocab_size optional."})
ModelSection.__module__ = __name__  # make_dataclass(module=...) needs Python 3.12


@dataclass
class DataSection:
    path: str | None = None  # a tokenised dataset directory (data_pipeline output)
    num_workers: int = 0
    val_batches: int = 20  # batches per validation


@dataclass
class OptimSection:
    lr: float = 1e-3
    min_lr: float = 1e-4  # floor of the cosine decay
    warmup_steps: int | None = None  # None: 5% of train.steps
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_alphas: bool = False  # weight decay on DWA alphas (the paper's code does not)
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping


@dataclass
class TrainSection:
    steps: int = 100
    seed: int = 0
    batch_size: int = 8  # global batch in sequences, whatever the layout
    resume: str | None = None  # None, "auto" (latest checkpoint of run.dir) or a checkpoint path
    stop_at: int | None = None  # stop (checkpoint and exit) after this step; schedule uses steps
    eval_every: int = 0  # 0: validate only at the end
    log_every: int = 10
    dtype: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    on_nan: Literal["stop", "skip"] = "stop"
    device: Literal["auto", "cpu", "cuda"] = "auto"


@dataclass
class ParallelSection:
    tp: int = 1
    pp: int = 1
    microbatches: int = 1  # per data-parallel rank per step (= gradient accumulation)
    zero_stage: int = 0
    sequence_parallel: bool = False
    # Pipeline (docs_pipeline.md): stages per pipeline rank (> 1: interleaved 1F1B), blocks
    # per stage in order (null: balanced), and what crosses stage boundaries.
    virtual_stages: int = 1
    pp_split: list[int] | None = None
    pp_transfer: Literal["optimal", "raw"] = "optimal"
    # Activation checkpointing (parallel/checkpointing.py): recompute units of
    # `checkpoint_every` blocks in backward; dwa_block also recomputes the DWA before a unit.
    activation_checkpointing: Literal["none", "block", "dwa_block"] = "none"
    checkpoint_every: int = 1


@dataclass
class CheckpointSection:
    every: int = 0  # 0: only at the end (or at stop_at / on a stop signal)
    keep: int = 3  # newest complete checkpoints kept; 0 keeps all


@dataclass
class TrackingSection:
    uri: str | None = None  # None: sqlite:///<run.dir>/mlflow.db
    experiment: str = "denseformer"
    enabled: bool = True


@dataclass
class Config:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)

    def effective_warmup_steps(self) -> int:
        """optim.warmup_steps, or round(5% of train.steps) when it is null."""
        if self.optim.warmup_steps is not None:
            return self.optim.warmup_steps
        return round(0.05 * self.train.steps)

    def layout_tag(self, world_size: int) -> str:
        """The layout as a short string, e.g. "tp2-pp2-dp2"."""
        dp = world_size // (self.parallel.tp * self.parallel.pp)
        return f"tp{self.parallel.tp}-pp{self.parallel.pp}-dp{dp}"


SECTIONS: dict[str, type] = {
    f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}

# Keys that may legitimately change when a run is resumed; left out of the MLflow params.
RUN_CONTROL_KEYS = ("run.dir", "train.resume", "train.stop_at", "data.num_workers",
                    "tracking.*", "checkpoint.*")


# ---------------------------------------------------------------------------------------------
# Types


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads 1e-3 as a float (YAML 1.1 wants a dot: 1.0e-3)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is list:
        return "a list of " + _type_name(typing.get_args(tp)[0])
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """`value` checked against the type hint `tp` (an int is accepted for a float)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is not type(None):
                try:
                    return _coerce(key, value, arg)
                except ConfigError:
                    pass
    elif origin is Literal:
        if value in typing.get_args(tp) and isinstance(value, str):
            return value
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin is list:
        if isinstance(value, list):
            (item_type,) = typing.get_args(tp)
            return [_coerce(f"{key}[{n}]", v, item_type) for n, v in enumerate(value)]
    else:
        raise TypeError(f"{key}: unsupported config type {tp!r}")
    raise ConfigError(key, f"expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def _is_str_field(tp: Any) -> bool:
    args = typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)
    return str in args


def _unknown(key: str, name: str, known: Sequence[str]) -> ConfigError:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]!r}?" if close else "known: " + ", ".join(known)
    return ConfigError(key, f"unknown key; {hint}")


# ---------------------------------------------------------------------------------------------
# Loading


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """The mapping in `path`, merged over its `base:` file if it names one."""
    path = path.resolve()
    if path in seen:
        raise ConfigError("base", f"cycle of base files through {path}")
    try:
        data = yaml.load(path.read_text(), Loader=_Loader)
    except yaml.YAMLError as err:
        raise ConfigError(str(path), f"not valid YAML: {err}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), f"expected a mapping of sections, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError("base", f"expected a file name, got {base!r}")
    merged = _read_yaml(path.parent / base, seen + (path,))
    for section, values in data.items():
        if isinstance(values, dict) and isinstance(merged.get(section), dict):
            merged[section] = {**merged[section], **values}
        else:
            merged[section] = values
    return merged


def _apply(cfg: Config, key: str, value: Any) -> None:
    """Set the dotted `key` of `cfg` to `value`, checking the key and the type."""
    section_name, _, name = key.partition(".")
    if section_name not in SECTIONS:
        raise _unknown(key, section_name, list(SECTIONS))
    section = getattr(cfg, section_name)
    hints = typing.get_type_hints(type(section))
    if name not in hints:
        raise _unknown(key, name, list(hints))
    setattr(section, name, _coerce(key, value, hints[name]))


def _parse_override(item: str) -> tuple[str, Any]:
    key, eq, raw = item.partition("=")
    key = key.strip()
    if not eq or "." not in key:
        raise ConfigError(item, "an override looks like section.key=value")
    try:
        value = yaml.load(raw, Loader=_Loader)
    except yaml.YAMLError as err:
        raise ConfigError(key, f"cannot parse {raw!r}: {err}") from None
    section = SECTIONS.get(key.partition(".")[0])
    hint = typing.get_type_hints(section).get(key.partition(".")[2]) if section else None
    if hint is not None and _is_str_field(hint) and value is not None \
            and not isinstance(value, str):
        value = raw.strip()  # run.name=2024 means the string "2024"
    return key, value


def load_config(path: str | Path | None, overrides: Sequence[str] = (),
                world_size: int | None = None) -> Config:
    """Defaults, then the YAML file (if any), then `section.key=value` overrides; validated."""
    cfg = Config()
    if path is not None:
        for section, values in _read_yaml(Path(path)).items():
            if section not in SECTIONS:
                raise _unknown(section, section, list(SECTIONS))
            if values is None:
                continue
            if not isinstance(values, dict):
                raise ConfigError(section, f"expected a mapping, got {values!r}")
            for name, value in values.items():
                _apply(cfg, f"{section}.{name}", value)
    for item in overrides:
        _apply(cfg, *_parse_override(item))
    validate(cfg, world_size)
    return cfg


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """The config as a nested plain dict (YAML-dumpable; load_config reads it back)."""
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the config as YAML."""
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def flat_params(cfg: Config) -> dict[str, Any]:
    """{"model.n_layers": 4, ...} for MLflow params, without the RUN_CONTROL_KEYS."""
    flat = {}
    for section, values in config_to_dict(cfg).items():
        for name, value in values.items():
            key = f"{section}.{name}"
            if key not in RUN_CONTROL_KEYS and f"{section}.*" not in RUN_CONTROL_KEYS:
                flat[key] = value
    return flat


# ---------------------------------------------------------------------------------------------
# Validation


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def _check_pipeline(p: ParallelSection, n_layers: int) -> None:
    """Stage count, explicit split and micro-batch count against the pipeline schedule."""
    from parallel.plan import schedule_problem

    _check(p.virtual_stages >= 1, "parallel.virtual_stages",
           f"must be >= 1, got {p.virtual_stages}")
    _check(p.virtual_stages == 1 or p.pp > 1, "parallel.virtual_stages",
           f"{p.virtual_stages} virtual stages need parallel.pp > 1 (interleaved 1F1B)")
    stages = p.pp * p.virtual_stages
    _check(stages <= n_layers, "parallel.virtual_stages" if p.virtual_stages > 1 else "parallel.pp",
           f"pp x virtual_stages = {p.pp} x {p.virtual_stages} = {stages} stages, more than "
           f"model.n_layers={n_layers} blocks")
    if p.pp_split is not None:
        _check(len(p.pp_split) == stages, "parallel.pp_split",
               f"{p.pp_split} has {len(p.pp_split)} entries; pp x virtual_stages = {stages}")
        _check(all(m >= 1 for m in p.pp_split), "parallel.pp_split",
               f"every stage needs >= 1 block, got {p.pp_split}")
        _check(sum(p.pp_split) == n_layers, "parallel.pp_split",
               f"{p.pp_split} sums to {sum(p.pp_split)}, not model.n_layers={n_layers}")
    problem = schedule_problem(p.pp, p.virtual_stages, p.microbatches)
    _check(problem is None, "parallel.microbatches", f"{p.microbatches}: {problem}")


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Raise ConfigError for the first invalid or inconsistent value (world checks if known)."""
    for section_name in SECTIONS:
        section = getattr(cfg, section_name)
        for name, hint in typing.get_type_hints(type(section)).items():
            _coerce(f"{section_name}.{name}", getattr(section, name), hint)

    m, o, t, p = cfg.model, cfg.optim, cfg.train, cfg.parallel
    # vocab_size null is filled from the data later; any valid size checks the other fields.
    model = m.build_config(m.vocab_size if m.vocab_size is not None
                           else max(1, m.vocab_pad_multiple))

    _check(t.steps >= 1, "train.steps", f"must be >= 1, got {t.steps}")
    _check(t.batch_size >= 1, "train.batch_size", f"must be >= 1, got {t.batch_size}")
    _check(t.stop_at is None or 1 <= t.stop_at <= t.steps, "train.stop_at",
           f"must be null or in [1, train.steps={t.steps}], got {t.stop_at}")
    _check(t.eval_every >= 0, "train.eval_every", f"must be >= 0, got {t.eval_every}")
    _check(t.log_every >= 1, "train.log_every", f"must be >= 1, got {t.log_every}")
    _check(cfg.data.num_workers >= 0, "data.num_workers",
           f"must be >= 0, got {cfg.data.num_workers}")
    _check(cfg.data.val_batches >= 1, "data.val_batches",
           f"must be >= 1, got {cfg.data.val_batches}")
    _check(cfg.checkpoint.every >= 0, "checkpoint.every",
           f"must be >= 0, got {cfg.checkpoint.every}")
    _check(cfg.checkpoint.keep >= 0, "checkpoint.keep", f"must be >= 0, got {cfg.checkpoint.keep}")

    _check(o.lr > 0, "optim.lr", f"must be > 0, got {o.lr}")
    _check(0 <= o.min_lr <= o.lr, "optim.min_lr",
           f"must be in [0, optim.lr={o.lr}], got {o.min_lr}")
    _check(o.warmup_steps is None or 0 <= o.warmup_steps < t.steps, "optim.warmup_steps",
           f"must be null or in [0, train.steps={t.steps}), got {o.warmup_steps}")
    for name in ("beta1", "beta2"):
        value = getattr(o, name)
        _check(0 <= value < 1, f"optim.{name}", f"must be in [0, 1), got {value}")
    _check(o.eps > 0, "optim.eps", f"must be > 0, got {o.eps}")
    _check(o.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {o.weight_decay}")
    _check(o.grad_clip >= 0, "optim.grad_clip", f"must be >= 0 (0 disables), got {o.grad_clip}")

    for name in ("tp", "pp", "microbatches"):
        value = getattr(p, name)
        _check(value >= 1, f"parallel.{name}", f"must be >= 1, got {value}")
    _check(t.batch_size % p.microbatches == 0, "train.batch_size",
           f"{t.batch_size} sequences do not split into {p.microbatches} micro-batches")
    _check(model.n_heads % p.tp == 0, "parallel.tp",
           f"tp={p.tp} does not divide model.n_heads={model.n_heads} (attention heads split)")
    # tp | n_heads implies tp | d_model and so tp | d_model * mlp_ratio (the MLP width).
    if m.vocab_size is None:
        _check(model.vocab_pad_multiple % p.tp == 0, "parallel.tp",
               f"tp={p.tp} does not divide model.vocab_pad_multiple={model.vocab_pad_multiple}"
               " (the padded vocabulary must split evenly)")
    else:
        _check(model.padded_vocab_size % p.tp == 0, "parallel.tp",
               f"tp={p.tp} does not divide the padded vocabulary {model.padded_vocab_size}"
               " (raise model.vocab_pad_multiple)")
    _check(model.n_layers >= p.pp, "parallel.pp",
           f"pp={p.pp} stages need model.n_layers >= pp, got {model.n_layers}")
    _check_pipeline(p, model.n_layers)
    _check(p.zero_stage in (0, 1, 2, 3), "parallel.zero_stage",
           f"must be 0, 1, 2 or 3, got {p.zero_stage}")
    _check(p.zero_stage < 2 or (p.tp == 1 and p.pp == 1), "parallel.zero_stage",
           f"ZeRO-{p.zero_stage} is refused with tp={p.tp}, pp={p.pp}: GPT-NeoX/DeepSpeed only "
           "support ZeRO-1 with model parallelism (with PP, ZeRO-2's gradient hooks fire once "
           "per micro-batch); use zero_stage 0 or 1")
    _check(1 <= p.checkpoint_every <= model.n_layers, "parallel.checkpoint_every",
           f"must be in [1, model.n_layers={model.n_layers}] blocks, got {p.checkpoint_every}")
    _check(p.pp == 1 or (p.activation_checkpointing in ("none", "block")
                         and p.checkpoint_every == 1), "parallel.activation_checkpointing",
           f"{p.activation_checkpointing} (every {p.checkpoint_every}) is not available with "
           f"pp={p.pp}: pipeline stages checkpoint single blocks; use block with "
           "checkpoint_every=1, or none")
    if p.sequence_parallel:
        _check(p.tp > 1, "parallel.sequence_parallel", "needs parallel.tp > 1, got tp=1")
        _check(model.seq_len % p.tp == 0, "parallel.sequence_parallel",
               f"model.seq_len={model.seq_len} is not divisible by tp={p.tp}")

    if world_size is not None:
        _check(world_size >= 1, "world_size", f"must be >= 1, got {world_size}")
        _check(world_size % (p.tp * p.pp) == 0, "parallel.tp",
               f"tp*pp = {p.tp}*{p.pp} = {p.tp * p.pp} does not divide world size {world_size}")
        dp = world_size // (p.tp * p.pp)
        per_step = dp * p.microbatches
        _check(t.batch_size % per_step == 0, "train.batch_size",
               f"{t.batch_size} sequences do not split into dp={dp} ranks x "
               f"{p.microbatches} micro-batches; use a multiple of {per_step}")
