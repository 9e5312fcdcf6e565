"""The run configuration: nested dataclasses, one per section, loaded from YAML + overrides.

    cfg = load_config("configs/tiny.yaml", ["train.steps=10", "model.dwa=false"])

Every section has defaults that run. A YAML file may name a `base:` file (relative to itself)
whose values it overrides. Unknown keys, wrong types and inconsistent values raise
ConfigError naming the dotted key, before any rank is spawned. Each numeric key states its
valid range next to its default (`ranged`, checked by `validate`; NaN and inf are never
valid); docs/configuration-ranges.md lists them (`ranges_markdown`), docs/configuration.md
describes the keys.
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

from pretrain.model.config import (
    RANGE,
    DenseFormerConfig,
    ModelConfigError,
    Range,
    numeric_kind,
    ranged,
)


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
    """DenseFormerConfig's fields and ranges; vocab_size may be None (taken from the data)."""
    hints = typing.get_type_hints(DenseFormerConfig)
    fields = []
    for f in dataclasses.fields(DenseFormerConfig):
        if f.name == "vocab_size":
            fields.append((f.name, int | None, field(default=None, metadata=f.metadata)))
        elif f.default is not dataclasses.MISSING:
            fields.append((f.name, hints[f.name], field(default=f.default, metadata=f.metadata)))
        else:
            fields.append((f.name, hints[f.name], field(default_factory=f.default_factory,
                                                        metadata=f.metadata)))
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
    num_workers: int = ranged(0, ge=0)
    val_batches: int = ranged(20, ge=0)  # batches per validation; 0 switches validation off


@dataclass
class OptimSection:
    lr: float = ranged(1e-3, gt=0)
    min_lr: float = ranged(1e-4, ge=0, also="<= optim.lr")  # floor of the cosine decay
    # None: 5% of train.steps
    warmup_steps: int | None = ranged(None, ge=0, also="< train.steps")
    beta1: float = ranged(0.9, ge=0, lt=1)
    beta2: float = ranged(0.95, ge=0, lt=1)
    eps: float = ranged(1e-8, gt=0)
    weight_decay: float = ranged(0.1, ge=0)
    decay_alphas: bool = False  # weight decay on DWA alphas (the paper's code does not)
    grad_clip: float = ranged(1.0, ge=0)  # max global grad norm; 0 disables clipping


@dataclass
class TrainSection:
    steps: int = ranged(100, ge=1)
    seed: int = ranged(0, ge=0)  # the data order's numpy SeedSequence needs >= 0
    # The global batch in sequences, whatever the layout.
    batch_size: int = ranged(8, ge=1, also="a multiple of dp x parallel.microbatches")
    resume: str | None = None  # None, "auto" (latest checkpoint of run.dir) or a checkpoint path
    # A checkpoint or run directory whose model weights start a new run (fresh optimizer,
    # step 0; pretrain/init_from.py); ignored by a run that resumes from its own checkpoint.
    init_from: str | None = None
    # Stop (checkpoint and exit) after this step; the schedule uses steps.
    stop_at: int | None = ranged(None, ge=1, also="<= train.steps")
    eval_every: int = ranged(0, ge=0)  # 0: validate only at the end (when data.val_batches > 0)
    log_every: int = ranged(10, ge=1)
    dtype: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    on_nan: Literal["stop", "skip"] = "stop"
    # on_nan=skip: more skipped steps in a row than this stops the run (exit 3)
    max_consecutive_skips: int = ranged(10, ge=0)
    device: Literal["auto", "cpu", "cuda"] = "auto"


@dataclass
class ParallelSection:
    tp: int = ranged(1, ge=1, also="divides model.n_heads and the padded vocabulary")
    pp: int = ranged(1, ge=1, also="<= model.n_layers")
    # Per data-parallel rank per step (= gradient accumulation).
    microbatches: int = ranged(1, ge=1, also="divides train.batch_size; with virtual_stages "
                                             "> 1, a multiple of pp or < 2 x pp")
    zero_stage: int = ranged(0, ge=0, le=3, also="2 and 3 only with tp = pp = 1")
    sequence_parallel: bool = False
    # Pipeline (docs/pipeline.md): stages per pipeline rank (> 1: interleaved 1F1B), blocks
    # per stage in order (null: balanced), and what crosses stage boundaries.
    virtual_stages: int = ranged(1, ge=1, also="> 1 needs pp > 1; pp x virtual_stages <= "
                                                    "model.n_layers")
    pp_split: list[int] | None = None
    pp_transfer: Literal["optimal", "raw"] = "optimal"
    # Activation checkpointing (parallel/checkpointing.py): recompute units of
    # `checkpoint_every` blocks in backward; dwa_block also recomputes the DWA before a unit.
    activation_checkpointing: Literal["none", "block", "dwa_block"] = "none"
    checkpoint_every: int = ranged(1, ge=1, also="<= model.n_layers; 1 with pp > 1")
    # Timeout of every collective (world, megatron-core and DeepSpeed groups): a hung or
    # stopped peer ends the job after this long instead of holding every rank (a day at most:
    # longer is a hang, not a slow collective).
    timeout_s: int = ranged(600, ge=1, le=86400)


@dataclass
class CheckpointSection:
    every: int = ranged(0, ge=0)  # 0: only at the end (or at stop_at / on a stop signal)
    keep: int = ranged(3, ge=0)  # newest complete checkpoints kept; 0 keeps all


@dataclass
class TrackingSection:
    uri: str | None = None  # None: sqlite:///<run.dir>/mlflow.db
    experiment: str = "denseformer"
    enabled: bool = True
    # false: an unreachable tracking server costs one warning (metrics.jsonl is still written)
    required: bool = True


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
RUN_CONTROL_KEYS = ("run.dir", "train.resume", "train.init_from", "train.stop_at",
                    "data.num_workers", "tracking.*", "checkpoint.*")


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


def _read_text(path: Path, named_by: Path | None) -> str:
    """The text of a config file, or ConfigError naming it (and the file whose base it is)."""
    try:
        return path.read_text()
    except FileNotFoundError:
        problem = "does not exist"
    except IsADirectoryError:
        problem = "is a directory, not a YAML file"
    except UnicodeDecodeError:
        problem = "is not a UTF-8 text file"
    except OSError as err:
        problem = f"cannot be read: {err.strerror}"
    if named_by is None:
        raise ConfigError(str(path), f"config file {problem}")
    raise ConfigError("base", f"{path}, named as the base of {named_by}, {problem}")


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """The mapping in `path`, merged over its `base:` file if it names one."""
    path = path.resolve()
    if path in seen:
        raise ConfigError("base", f"cycle of base files through {path}")
    try:
        data = yaml.load(_read_text(path, seen[-1] if seen else None), Loader=_Loader)
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
                world_size: int | None = None, check: bool = True) -> Config:
    """Defaults, then the YAML file (if any), then `section.key=value` overrides; validated
    unless `check` is false (keys and types are checked always)."""
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
    if check:
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
    from parallel.schedule import schedule_problem

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


def _numeric_fields(section: type) -> list[tuple[dataclasses.Field, Any]]:
    """The int and float fields (nullable or not) of a section dataclass, with their hints."""
    hints = typing.get_type_hints(section)
    return [(f, hints[f.name]) for f in dataclasses.fields(section)
            if numeric_kind(hints[f.name])[0] is not None]


def valid_range(section_name: str, f: dataclasses.Field) -> Range:
    """The stated Range of a numeric field; TypeError for a field that states none."""
    if RANGE not in f.metadata:
        raise TypeError(f"{section_name}.{f.name}: a numeric config key needs a valid range: "
                        "declare it with ranged(default, ge=..., ...)")
    return f.metadata[RANGE]


def _check_ranges(cfg: Config) -> None:
    """Every numeric value is finite and in its field's Range (null where the type allows)."""
    for section_name, section_type in SECTIONS.items():
        section = getattr(cfg, section_name)
        for f, hint in _numeric_fields(section_type):
            value = getattr(section, f.name)
            if value is None:
                continue  # _coerce has checked that the type allows null
            problem = valid_range(section_name, f).problem(value, numeric_kind(hint)[1])
            _check(problem is None, f"{section_name}.{f.name}", problem)


def ranges_markdown() -> str:
    """The table of numeric keys: key | type | default | valid range (for the docs)."""
    rows = ["| key | type | default | valid range |", "| --- | --- | --- | --- |"]
    for section_name, section_type in SECTIONS.items():
        for f, hint in _numeric_fields(section_type):
            kind, nullable = numeric_kind(hint)
            valid = valid_range(section_name, f)
            rows.append(f"| `{section_name}.{f.name}` | {kind.__name__}"
                        f"{' or null' if nullable else ''} | {_default_text(f)} | "
                        f"{'null or ' if nullable else ''}{valid}"
                        f"{'; ' + valid.also if valid.also else ''} |")
    return "\n".join(rows) + "\n"


def _default_text(f: dataclasses.Field) -> str:
    return "null" if f.default is None else repr(f.default)


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Raise ConfigError for the first invalid or inconsistent value (world checks if known)."""
    for section_name in SECTIONS:
        section = getattr(cfg, section_name)
        for name, hint in typing.get_type_hints(type(section)).items():
            _coerce(f"{section_name}.{name}", getattr(section, name), hint)
    _check_ranges(cfg)

    m, o, t, p = cfg.model, cfg.optim, cfg.train, cfg.parallel
    # vocab_size null is filled from the data later; any valid size checks the other fields.
    model = m.build_config(m.vocab_size if m.vocab_size is not None
                           else max(1, m.vocab_pad_multiple))

    # Checks across fields; each field's own range is checked above.
    _check(t.resume != "auto" or cfg.run.dir is not None, "train.resume",
           "auto continues the run in run.dir, but run.dir is null (a new timestamped "
           "directory every time): set run.dir to the run directory to resume")
    _check(t.stop_at is None or t.stop_at <= t.steps, "train.stop_at",
           f"must be null or in [1, train.steps={t.steps}], got {t.stop_at}")
    _check(o.min_lr <= o.lr, "optim.min_lr",
           f"must be in [0, optim.lr={o.lr}], got {o.min_lr}")
    _check(o.warmup_steps is None or o.warmup_steps < t.steps, "optim.warmup_steps",
           f"must be null or in [0, train.steps={t.steps}), got {o.warmup_steps}")
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
    _check(p.zero_stage < 2 or (p.tp == 1 and p.pp == 1), "parallel.zero_stage",
           f"ZeRO-{p.zero_stage} is refused with tp={p.tp}, pp={p.pp}: GPT-NeoX/DeepSpeed only "
           "support ZeRO-1 with model parallelism (with PP, ZeRO-2's gradient hooks fire once "
           "per micro-batch); use zero_stage 0 or 1")
    _check(p.checkpoint_every <= model.n_layers, "parallel.checkpoint_every",
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
