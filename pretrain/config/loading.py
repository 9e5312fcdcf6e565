"""Loading and saving the run config: YAML files with their base files, and overrides.

    cfg = load_config("configs/tiny.yaml", ["train.steps=10", "model.dwa=false"])

A YAML file may name a `base:` file (relative to itself) whose values it overrides; dotted
`section.key=value` overrides come last. Each value is checked against its key's type as it
is set (pretrain/config/coercion.py); `validate` then checks the whole config.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from pretrain.config.coercion import coerce, is_str_field, unknown_key
from pretrain.config.sections import (
    RUN_CONTROL_KEYS,
    SECTIONS,
    Config,
    field_name,
    key_name,
)
from pretrain.config.validation import validate
from pretrain.model.config import ConfigError
from pretrain.run_files import write_atomic


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads 1e-3 as a float (YAML 1.1 wants a dot: 1.0e-3)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


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
        raise unknown_key(key, section_name, list(SECTIONS))
    section = getattr(cfg, section_name)
    hints = typing.get_type_hints(type(section))
    if field_name(name) not in hints:
        raise unknown_key(key, name, [key_name(h) for h in hints])
    setattr(section, field_name(name), coerce(key, value, hints[field_name(name)]))


def override_argument(text: str) -> str:
    """argparse `type` of a `--set KEY=VALUE` option: the text, or a usage error that says
    how to write it (`--set train.steps 50` would otherwise end in "unrecognized
    arguments: 50")."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE: write --set "
                                          f"{text.strip()}=VALUE, one argument")
    return text


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
    hint = typing.get_type_hints(section).get(field_name(key.partition(".")[2])) \
        if section else None
    if hint is not None and is_str_field(hint) and value is not None \
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
                raise unknown_key(section, section, list(SECTIONS))
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
    return {section: {key_name(name): value for name, value in values.items()}
            for section, values in dataclasses.asdict(cfg).items()}


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the config as YAML, atomically (RunFileError naming the file if it fails)."""
    write_atomic(Path(path), yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def flat_params(cfg: Config) -> dict[str, Any]:
    """{"model.n_layers": 4, ...} for MLflow params, without the RUN_CONTROL_KEYS."""
    flat = {}
    for section, values in config_to_dict(cfg).items():
        for name, value in values.items():
            key = f"{section}.{name}"
            if key not in RUN_CONTROL_KEYS and f"{section}.*" not in RUN_CONTROL_KEYS:
                flat[key] = value
    return flat
