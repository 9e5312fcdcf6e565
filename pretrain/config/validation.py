"""Validation of a run config: each numeric key's range, and the checks across fields.

Each numeric key states its valid range next to its default (`ranged`; NaN and inf are never
valid); `ranges_markdown` lists them for docs/configuration-ranges.md. `validate` runs before
any rank is spawned and raises ConfigError naming the key to change.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from parallel.strategies.config import ParallelSection
from parallel.strategies.schedule import schedule_problem
from pretrain.config.coercion import coerce
from pretrain.config.sections import SECTIONS, Config, key_name
from pretrain.model.config import RANGE, ConfigError, ModelConfigError, Range, numeric_kind


def model_config_error(err: ModelConfigError) -> ConfigError:
    """The ConfigError of a model field's error: the same message, the key `model.<field>`."""
    key = f"model.{err.key}"
    return ConfigError(key, str(err).removeprefix(f"{key}: "))


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def _check_pipeline(p: ParallelSection, n_layers: int) -> None:
    """Stage count, explicit split and micro-batch count against the pipeline schedule."""
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
    if p.microbatches != "auto":  # auto picks a count that suits the schedule
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
            if value is None or isinstance(value, str):
                continue  # _coerce has checked that the type allows null (or "auto")
            problem = valid_range(section_name, f).problem(value, numeric_kind(hint)[1])
            _check(problem is None, f"{section_name}.{f.name}", problem)


def ranges_markdown() -> str:
    """The table of numeric keys: key | type | default | valid range (for the docs)."""
    rows = ["| key | type | default | valid range |", "| --- | --- | --- | --- |"]
    for section_name, section_type in SECTIONS.items():
        for f, hint in _numeric_fields(section_type):
            kind, nullable = numeric_kind(hint)
            valid = valid_range(section_name, f)
            words = [repr(a) for arg in typing.get_args(hint)
                     if typing.get_origin(arg) is typing.Literal for a in typing.get_args(arg)]
            rows.append(f"| `{section_name}.{f.name}` | {kind.__name__}"
                        f"{' or null' if nullable else ''}"
                        f"{''.join(' or ' + w for w in words)} | {_default_text(f)} | "
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
            coerce(f"{section_name}.{key_name(name)}", getattr(section, name), hint)
    _check_ranges(cfg)

    m, o, t, p = cfg.model, cfg.optim, cfg.train, cfg.parallel
    try:
        m.validate()  # the model's own checks across its fields (heads divide d_model, ...)
    except ModelConfigError as err:
        raise model_config_error(err) from None

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
    microbatches = 1 if p.microbatches == "auto" else p.microbatches  # auto: a divisor
    _check(p.microbatches != "auto" or t.device != "cpu", "parallel.microbatches",
           "auto needs a CUDA device to read its free memory, but train.device=cpu: give a "
           "number")
    _check(t.batch_size % microbatches == 0, "train.batch_size",
           f"{t.batch_size} sequences do not split into {p.microbatches} micro-batches")
    _check(m.n_heads % p.tp == 0, "parallel.tp",
           f"tp={p.tp} does not divide model.n_heads={m.n_heads} (attention heads split)")
    _check(m.kv_heads % p.tp == 0, "parallel.tp",
           f"tp={p.tp} does not divide the {m.kv_heads} key/value heads (model.n_kv_heads): "
           "a TP rank holds whole key/value groups")
    # tp | n_heads implies tp | d_model and so tp | d_model * mlp_ratio (the MLP width).
    if m.vocab_size is None:
        _check(m.vocab_pad_multiple % p.tp == 0, "parallel.tp",
               f"tp={p.tp} does not divide model.vocab_pad_multiple={m.vocab_pad_multiple}"
               " (the padded vocabulary must split evenly)")
    else:
        _check(m.padded_vocab_size % p.tp == 0, "parallel.tp",
               f"tp={p.tp} does not divide the padded vocabulary {m.padded_vocab_size}"
               " (raise model.vocab_pad_multiple)")
    _check(t.compile in ("none", "auto") or m.mudd_layout is None, "train.compile",
           f"{t.compile} is not available with model.connection=mudd (its buffered mixes run "
           "eagerly): use none or auto")
    _check(m.n_layers >= p.pp, "parallel.pp",
           f"pp={p.pp} stages need model.n_layers >= pp, got {m.n_layers}")
    _check_pipeline(p, m.n_layers)
    _check(p.zero_stage < 2 or (p.tp == 1 and p.pp == 1), "parallel.zero_stage",
           f"ZeRO-{p.zero_stage} is refused with tp={p.tp}, pp={p.pp}: GPT-NeoX/DeepSpeed only "
           "support ZeRO-1 with model parallelism (with PP, ZeRO-2's gradient hooks fire once "
           "per micro-batch); use zero_stage 0 or 1")
    _check(p.checkpoint_every <= m.n_layers, "parallel.checkpoint_every",
           f"must be in [1, model.n_layers={m.n_layers}] blocks, got {p.checkpoint_every}")
    _check(p.pp == 1 or (p.activation_checkpointing in ("none", "block")
                         and p.checkpoint_every == 1), "parallel.activation_checkpointing",
           f"{p.activation_checkpointing} (every {p.checkpoint_every}) is not available with "
           f"pp={p.pp}: pipeline stages checkpoint single blocks; use block with "
           "checkpoint_every=1, or none")
    _check(t.compile in ("none", "auto") or p.zero_stage < 3, "train.compile",
           f"{t.compile} with ZeRO-3 is refused: DeepSpeed gathers each layer's parameters in "
           "module hooks that a compiled graph would not run; use none, or zero_stage <= 2")
    _check(t.compile != "model" or p.pp == 1, "train.compile",
           f"model compiles the whole model's loss, but with pp={p.pp} the pipeline schedule "
           "runs each stage itself: use blocks")
    if p.sequence_parallel:
        _check(p.tp > 1, "parallel.sequence_parallel", "needs parallel.tp > 1, got tp=1")
        _check(m.seq_len % p.tp == 0, "parallel.sequence_parallel",
               f"model.seq_len={m.seq_len} is not divisible by tp={p.tp}")

    if world_size is not None:
        _check(world_size >= 1, "world_size", f"must be >= 1, got {world_size}")
        _check(world_size % (p.tp * p.pp) == 0, "parallel.tp",
               f"tp*pp = {p.tp}*{p.pp} = {p.tp * p.pp} does not divide world size {world_size}")
        dp = world_size // (p.tp * p.pp)
        per_step = dp * microbatches
        _check(t.batch_size % per_step == 0, "train.batch_size",
               f"{t.batch_size} sequences do not split into dp={dp} ranks x "
               f"{p.microbatches} micro-batches; use a multiple of {per_step}")
