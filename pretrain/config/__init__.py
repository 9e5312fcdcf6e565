"""The run configuration: nested dataclasses, one per section, loaded from YAML + overrides.

    cfg = load_config("configs/tiny.yaml", ["train.steps=10", "model.dwa=false"])

Every section has defaults that run; the model section is `DenseFormerConfig` itself, its
vocab_size null until the data's tokenizer fills it in (`cfg.model.with_vocab(n)`). A YAML
file may name a `base:` file (relative to itself) whose values it overrides. Unknown keys,
wrong types and inconsistent values raise ConfigError naming the dotted key, before any rank
is spawned. Each numeric key states its valid range next to its default (`ranged`, checked
by `validate`; NaN and inf are never valid); docs/configuration-ranges.md lists them
(`ranges_markdown`), docs/configuration.md describes the keys.

ConfigError lives with the model's config (pretrain/model/config.py), the lowest layer that
raises it; the parallel section's type with the strategies (parallel/strategies/config.py).
The modules: `sections` (the dataclasses), `coercion` (values against type
hints), `validation` (ranges and checks across fields), `loading` (YAML, base files,
overrides, saving).
"""

from pretrain.config.loading import (
    config_to_dict,
    flat_params,
    load_config,
    override_argument,
    save_config,
)
from pretrain.config.sections import (
    RUN_CONTROL_KEYS,
    SECTIONS,
    CheckpointSection,
    Config,
    DataSection,
    OptimSection,
    RunSection,
    TrackingSection,
    TrainSection,
)
from pretrain.config.validation import model_config_error, ranges_markdown, valid_range, validate
from pretrain.model.config import ConfigError

__all__ = [
    "RUN_CONTROL_KEYS", "SECTIONS", "CheckpointSection", "Config", "ConfigError", "DataSection",
    "OptimSection", "RunSection", "TrackingSection", "TrainSection",
    "config_to_dict", "flat_params", "load_config", "model_config_error", "ranges_markdown",
    "override_argument", "save_config", "valid_range", "validate",
]
