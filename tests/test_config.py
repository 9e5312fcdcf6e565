"""pretrain.config: loading, overrides, type checks, cross-field validation, shipped configs."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
import yaml

from pretrain.config import (
    SECTIONS,
    Config,
    ConfigError,
    config_to_dict,
    flat_params,
    load_config,
    ranges_markdown,
    save_config,
    valid_range,
    validate,
)
from pretrain.model.config import DenseFormerConfig, ModelConfigError, Range, numeric_kind
from tests.conftest import cli_env

REPO = Path(__file__).resolve().parents[1]
# Sweep and study files are sweeps, checked in test_slurm_sweep.py and test_studies.py.
CONFIGS = sorted(p for p in (REPO / "configs").rglob("*.yaml")
                 if not {"sweeps", "studies"} & set(p.parts))


def write(path: Path, data: dict | str) -> Path:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def rejected(path: Path | None = None, overrides: list[str] = (),
             world_size: int | None = None) -> ConfigError:
    """The ConfigError that loading raises (the test fails if it loads)."""
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides, world_size=world_size)
    return err.value


def assert_names(err: ConfigError, key: str, fragment: str = "") -> None:
    """`err` names `key`, first in its message, and says `fragment`."""
    assert err.key == key and str(err).startswith(f"{key}: "), str(err)
    assert fragment in str(err), str(err)


def test_defaults_load_and_validate():
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.model.vocab_size is None
    validate(cfg, world_size=1)


def test_model_section_is_the_model_config():
    assert SECTIONS["model"] is DenseFormerConfig
    assert isinstance(load_config(None).model, DenseFormerConfig)


@pytest.mark.parametrize("needs_vocab", [
    lambda m: m.padded_vocab_size, lambda m: m.num_params(), lambda m: m.flops_per_token()],
    ids=["padded_vocab_size", "num_params", "flops_per_token"])
def test_a_null_vocab_size_is_refused_where_it_is_needed(needs_vocab):
    model = load_config(None).model
    with pytest.raises(ModelConfigError) as err:
        needs_vocab(model)
    assert err.value.key == "vocab_size"
    assert str(err.value).startswith("model.vocab_size: is null")
    assert needs_vocab(model.with_vocab(300)) > 0


def test_building_a_model_needs_the_vocab_size():
    from pretrain.model import DenseFormer

    with pytest.raises(ModelConfigError, match=r"^model\.vocab_size: is null"):
        DenseFormer(DenseFormerConfig(n_layers=1, d_model=8, n_heads=2, seq_len=4))


def test_with_vocab_fills_a_null_vocab_size_in_a_copy():
    section = load_config(None, ["model.n_layers=3"]).model
    model = section.with_vocab(300)
    assert isinstance(model, DenseFormerConfig) and section.vocab_size is None
    assert (model.n_layers, model.vocab_size, model.padded_vocab_size) == (3, 300, 384)
    # A vocab_size the config names is kept, also above the tokenizer's (reserved rows, as
    # in released models); below it, a token id would fall outside the model: refused.
    named = load_config(None, ["model.vocab_size=77"]).model
    assert named.with_vocab(77) == named and named.with_vocab(70) == named
    with pytest.raises(ModelConfigError, match=r"^model\.vocab_size: is 77, .* has 78 ids"):
        named.with_vocab(78)
    with pytest.raises(ModelConfigError, match=r"^model\.vocab_size: must be null or >= 1"):
        section.with_vocab(0)


def test_yaml_then_overrides(tmp_path):
    path = write(tmp_path / "c.yaml", "model:\n  n_layers: 3\n  d_model: 32\n"
                                      "optim:\n  lr: 1e-3\n  min_lr: 0\ntrain:\n  steps: 50\n")
    cfg = load_config(path, ["train.steps=10", "model.dwa=false", "optim.warmup_steps=null",
                             "run.dir=/x/y", "optim.eps=1e-9"])
    assert cfg.model.n_layers == 3 and cfg.model.d_model == 32
    assert cfg.train.steps == 10 and cfg.model.dwa is False
    assert cfg.optim.lr == 1e-3 and isinstance(cfg.optim.lr, float)  # "1e-3" is a float here
    assert cfg.optim.min_lr == 0.0 and isinstance(cfg.optim.min_lr, float)  # int -> float
    assert cfg.optim.eps == 1e-9
    assert cfg.run.dir == "/x/y"
    assert cfg.effective_warmup_steps() == 0  # 5% of 10 steps
    assert load_config(None, ["train.steps=400"]).effective_warmup_steps() == 20
    assert load_config(None, ["optim.warmup_steps=7"]).effective_warmup_steps() == 7


def test_override_for_a_string_key_keeps_the_text():
    cfg = load_config(None, ["run.name=2024", "data.path=null", "tracking.uri=http://h:5000"])
    assert cfg.run.name == "2024" and cfg.data.path is None
    assert cfg.tracking.uri == "http://h:5000"


# (override, key): unknown keys, then wrong types; each must be named first in the error.
BAD_OVERRIDES = [
    ("model.nlayers=3", "model.nlayers"),
    ("modle.n_layers=3", "modle.n_layers"),
    ("train=3", "train=3"),
    ("train.steps", "train.steps"),
    ("train.steps=ten", "train.steps"),
    ("train.steps=1.5", "train.steps"),
    ("train.steps=true", "train.steps"),      # a bool is not an int
    ("train.steps=null", "train.steps"),      # null only for Optional keys
    ("model.dwa=1", "model.dwa"),
    ("model.dwa=yes please", "model.dwa"),
    ("optim.lr=fast", "optim.lr"),
    ("optim.lr=[1, 2]", "optim.lr"),
    ("run.name=null", "run.name"),
    ("train.dtype=fp16", "train.dtype"),
    ("train.on_nan=ignore", "train.on_nan"),
    ("optim.fused=sometimes", "optim.fused"),
    ("optim.fused=1", "optim.fused"),          # a bool or auto, not a number
    ("train.device=tpu", "train.device"),
    ("model.dwa_window=2.5", "model.dwa_window"),
    ("model.dwa_dtype=fp16", "model.dwa_dtype"),
]


@pytest.mark.parametrize("override, key", BAD_OVERRIDES)
def test_bad_override(override, key):
    assert_names(rejected(overrides=[override]), key)


# (files written, key, message fragment); the first file is loaded.
BAD_FILES = [
    ({"a.yaml": {"optim": {"learning_rate": 1.0}}}, "optim.learning_rate", "unknown key"),
    ({"b.yaml": {"optimizer": {"lr": 1.0}}}, "optimizer", "unknown key; did you mean 'optim'"),
    ({"c.yaml": {"train": 5}}, "train", "expected a mapping"),
    ({"d.yaml": "model:\n  n_layers: '4'\n"}, "model.n_layers", "expected int, got '4'"),
    ({"e.yaml": "base: f.yaml\n", "f.yaml": "base: e.yaml\n"}, "base", "cycle"),
]


@pytest.mark.parametrize("files, key, fragment", BAD_FILES,
                         ids=["unknown key", "unknown section", "section not a mapping",
                              "wrong type", "base cycle"])
def test_bad_yaml_file(tmp_path, files, key, fragment):
    for name, data in files.items():
        write(tmp_path / name, data)
    assert_names(rejected(tmp_path / next(iter(files))), key, fragment)


def test_validate_checks_types_of_a_programmatic_config():
    cfg = Config()
    cfg.train.steps = "10"
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert_names(err.value, "train.steps", "expected int")


def test_a_model_error_names_the_model_key():
    cfg = Config()
    cfg.model.n_heads = 3  # set after the model config checked itself
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert_names(err.value, "model.n_heads", "3 heads do not divide d_model=64")


# (overrides, world_size, key, message fragment); each case is one step off a valid config.
INVALID = [
    (["model.n_heads=6", "model.d_model=64"], None, "model.n_heads",
     "6 heads do not divide d_model=64"),
    (["model.seq_len=0"], None, "model.seq_len", ">= 1"),
    (["model.dropout=1.0"], None, "model.dropout", "[0, 1)"),
    (["model.skip_gains=true"], None, "model.skip_gains", "dwa=false"),
    (["model.vocab_size=0"], None, "model.vocab_size", ">= 1"),
    (["train.steps=0"], None, "train.steps", ">= 1"),
    (["train.steps=10", "train.stop_at=11"], None, "train.stop_at", "[1, train.steps=10]"),
    (["train.stop_at=0"], None, "train.stop_at", "must be null or >= 1, got 0"),
    (["train.batch_size=0"], None, "train.batch_size", ">= 1"),
    (["train.log_every=0"], None, "train.log_every", ">= 1"),
    (["train.eval_every=-1"], None, "train.eval_every", ">= 0"),
    (["data.val_batches=-1"], None, "data.val_batches", ">= 0"),
    (["data.num_workers=-1"], None, "data.num_workers", ">= 0"),
    (["checkpoint.every=-1"], None, "checkpoint.every", ">= 0"),
    (["checkpoint.keep=-1"], None, "checkpoint.keep", ">= 0"),
    (["optim.lr=0"], None, "optim.lr", "> 0"),
    (["optim.lr=1e-3", "optim.min_lr=2e-3"], None, "optim.min_lr", "[0, optim.lr=0.001]"),
    (["train.steps=10", "optim.warmup_steps=10"], None, "optim.warmup_steps", "[0, train.steps"),
    (["optim.beta2=1.0"], None, "optim.beta2", "[0, 1)"),
    (["optim.eps=0"], None, "optim.eps", "> 0"),
    (["optim.grad_clip=-1"], None, "optim.grad_clip", ">= 0"),
    (["optim.weight_decay=-0.1"], None, "optim.weight_decay", ">= 0"),
    (["parallel.tp=0"], None, "parallel.tp", ">= 1"),
    (["parallel.microbatches=0"], None, "parallel.microbatches", ">= 1"),
    (["train.batch_size=10", "parallel.microbatches=4"], None, "train.batch_size",
     "4 micro-batches"),
    (["model.n_heads=4", "parallel.tp=8"], None, "parallel.tp", "model.n_heads=4"),
    (["model.vocab_size=302", "model.vocab_pad_multiple=1", "parallel.tp=4"], None,
     "parallel.tp", "padded vocabulary 302"),
    (["model.vocab_pad_multiple=2", "parallel.tp=4"], None, "parallel.tp",
     "vocab_pad_multiple=2"),
    (["model.n_layers=2", "parallel.pp=3"], None, "parallel.pp", "n_layers >= pp"),
    (["parallel.zero_stage=4"], None, "parallel.zero_stage", "in [0, 3], got 4"),
    (["parallel.zero_stage=2", "parallel.tp=2"], None, "parallel.zero_stage",
     "only support ZeRO-1 with model parallelism"),
    (["parallel.zero_stage=3", "parallel.pp=2"], None, "parallel.zero_stage",
     "fire once per micro-batch"),
    (["parallel.sequence_parallel=true"], None, "parallel.sequence_parallel", "tp > 1"),
    (["parallel.sequence_parallel=true", "parallel.tp=4", "model.seq_len=130"], None,
     "parallel.sequence_parallel", "seq_len=130"),
    (["parallel.tp=2", "parallel.pp=2"], 6, "parallel.tp", "does not divide world size 6"),
    (["train.batch_size=12", "parallel.microbatches=2"], 4, "train.batch_size",
     "dp=4 ranks x 2 micro-batches; use a multiple of 8"),
    (["train.batch_size=12", "parallel.tp=2"], 16, "train.batch_size", "dp=8"),
    # Accepted before, then NaN (or a broken run) at the first step.
    (["model.init_std=-0.01"], None, "model.init_std", "must be > 0, got -0.01"),
    (["model.norm_eps=0"], None, "model.norm_eps", "must be > 0, got 0.0"),
    (["model.rope_base=0"], None, "model.rope_base", "must be > 1, got 0.0"),
    (["optim.lr=.inf"], None, "optim.lr", "must be a finite number > 0, got inf"),
    (["optim.lr=1e999"], None, "optim.lr", "finite number > 0, got inf"),  # overflows to inf
    (["optim.min_lr=.nan"], None, "optim.min_lr", "finite number >= 0, got nan"),
    (["optim.beta1=-.inf"], None, "optim.beta1", "finite number in [0, 1), got -inf"),
    (["train.seed=-1"], None, "train.seed", ">= 0, got -1"),
    (["train.max_consecutive_skips=-1"], None, "train.max_consecutive_skips", ">= 0, got -1"),
    (["parallel.timeout_s=0"], None, "parallel.timeout_s", "in [1, 86400], got 0"),
    (["parallel.checkpoint_every=0"], None, "parallel.checkpoint_every", ">= 1, got 0"),
    (["model.n_layers=4", "parallel.checkpoint_every=5"], None, "parallel.checkpoint_every",
     "[1, model.n_layers=4]"),
    (["train.resume=auto"], None, "train.resume", "run.dir is null (a new timestamped "
     "directory every time): set run.dir"),
]


@pytest.mark.parametrize("overrides, world_size, key, fragment", INVALID)
def test_invalid_values(overrides, world_size, key, fragment):
    assert_names(rejected(overrides=overrides, world_size=world_size), key, fragment)


@pytest.mark.parametrize("overrides, world_size", [
    (["train.steps=10", "train.stop_at=10", "optim.warmup_steps=9"], None),
    (["optim.min_lr=1e-3", "optim.lr=1e-3", "optim.grad_clip=0"], None),
    (["parallel.tp=4", "model.n_heads=4", "parallel.sequence_parallel=true"], 8),
    (["parallel.zero_stage=1", "parallel.tp=2", "parallel.pp=2"], 4),
    (["parallel.zero_stage=3"], 8),
    (["train.batch_size=16", "parallel.microbatches=2"], 8),
    (["train.batch_size=12", "parallel.tp=2", "parallel.pp=2", "parallel.microbatches=3"], 16),
    (["model.n_layers=2", "parallel.pp=2"], 2),
    (["model.vocab_size=300", "parallel.tp=4"], 4),  # padded to 384
])
def test_valid_boundaries(overrides, world_size):
    load_config(None, overrides, world_size=world_size)


def test_world_checks_are_skipped_without_world_size():
    load_config(None, ["train.batch_size=12", "parallel.microbatches=2"])
    assert_names(rejected(overrides=["train.batch_size=12", "parallel.microbatches=2"],
                          world_size=4), "train.batch_size")


def test_round_trip(tmp_path):
    cfg = load_config(None, ["model.n_layers=5", "optim.lr=3e-3", "optim.eps=1e-12",
                             "train.resume=auto", "run.dir=/r", "model.dwa_window=2",
                             "run.name=2024"])
    path = tmp_path / "resolved.yaml"
    save_config(cfg, path)
    assert load_config(path) == cfg
    assert yaml.safe_load(yaml.safe_dump(config_to_dict(cfg))) == config_to_dict(cfg)
    assert config_to_dict(cfg)["model"]["n_layers"] == 5


def test_flat_params_leave_out_run_control_keys():
    cfg = load_config(None, ["train.resume=auto", "train.stop_at=5", "run.dir=/r"])
    params = flat_params(cfg)
    assert params["model.n_layers"] == 4 and params["optim.lr"] == 1e-3
    assert params["train.steps"] == 100 and params["parallel.tp"] == 1
    for key in params:
        assert not key.startswith(("tracking.", "checkpoint."))
    for key in ("train.resume", "train.stop_at", "run.dir"):
        assert key not in params
    # What a resume may change does not change the params.
    resumed = load_config(None, ["train.stop_at=50", "checkpoint.every=7", "tracking.uri=x://"])
    assert flat_params(resumed) == flat_params(load_config(None))


def test_base_file_is_merged(tmp_path):
    write(tmp_path / "base.yaml", {"model": {"n_layers": 3, "d_model": 32}, "train": {"seed": 4}})
    (tmp_path / "sub").mkdir()
    child = write(tmp_path / "sub" / "child.yaml", "base: ../base.yaml\nmodel:\n  n_layers: 5\n")
    cfg = load_config(child)
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.train.seed) == (5, 32, 4)


def test_layout_tag():
    assert load_config(None, ["parallel.tp=2", "parallel.pp=2"]).layout_tag(8) == "tp2-pp2-dp2"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(REPO / "configs")))
def test_shipped_configs_load(path):
    cfg = load_config(path)
    model = cfg.model.with_vocab(cfg.model.vocab_size or 1000)
    assert model.n_layers >= 1


def test_shipped_configs_exist():
    names = {str(p.relative_to(REPO / "configs")) for p in CONFIGS}
    assert {"tiny.yaml", "paper/dense-48-1x1.yaml", "paper/dense-48-4x1.yaml",
            "paper/dense-48-4x5.yaml", "paper/transformer-48.yaml", "paper/transformer-72.yaml",
            "paper/transformer-90.yaml", "baselines/connect-to-last.yaml",
            "baselines/last-k.yaml", "baselines/skip-gains.yaml"} <= names


@pytest.mark.parametrize("name, millions", [
    ("transformer-48", 378.45), ("transformer-72", 548.35), ("transformer-90", 675.78)])
def test_paper_transformer_sizes(name, millions):
    cfg = load_config(REPO / "configs" / "paper" / f"{name}.yaml")
    assert cfg.model.vocab_size == 50304 and cfg.train.batch_size == 400
    assert cfg.effective_warmup_steps() == 2000  # 5% of 40k
    n = cfg.model.num_params()
    assert abs(n / 1e6 - millions) / millions < 1e-3


@pytest.mark.parametrize("name, k, p, extra", [
    ("dense-48-1x1", 1, 1, 48 * 51 // 2), ("dense-48-4x5", 4, 5, 62)])
def test_paper_denseformer_shapes(name, k, p, extra):
    dense = load_config(REPO / "configs" / "paper" / f"{name}.yaml").model
    plain = load_config(REPO / "configs" / "paper" / "transformer-48.yaml").model
    assert (dense.dwa, dense.dwa_dilation, dense.dwa_period) == (True, k, p)
    assert dense.num_params() - plain.num_params() == extra


def test_tiny_config():
    cfg = load_config(REPO / "configs" / "tiny.yaml")
    m = cfg.model
    assert (m.n_layers, m.d_model, m.n_heads, m.seq_len, m.vocab_size) == (6, 128, 4, 128, None)
    assert (cfg.train.steps, cfg.train.batch_size, cfg.data.path) == (300, 16, "data/demo")
    assert (cfg.checkpoint.every, cfg.checkpoint.keep) == (100, 2)


def test_tiny_attnres_config():
    """The tiny shape with block AttnRes: 12 sub-layers in 4 groups of 3, and no note (the
    DWA keys it inherits from tiny.yaml are at their defaults)."""
    m = load_config(REPO / "configs" / "tiny-attnres.yaml").model
    assert m.depth_connection == "attnres" and not m.has_dwa
    assert (m.n_layers, m.attnres_layout.blocks, m.attnres_layout.group) == (6, 4, 3)
    assert m.architecture == "AttnRes block 4" and m.ignored_dwa_note() is None


def test_tiny_mudd_config():
    """The tiny shape with MUDD (dynamic, qkvr streams), and no note."""
    m = load_config(REPO / "configs" / "tiny-mudd.yaml").model
    assert m.depth_connection == "mudd" and not m.has_dwa
    assert (m.mudd_layout.streams, m.mudd_layout.dynamic) == ("qkvr", True)
    assert m.architecture == "MUDD" and m.ignored_dwa_note() is None


def test_tiny_hc_configs():
    """The tiny shape with dynamic HC and with mHC, 4 streams, and no note."""
    for name, arch in (("tiny-hc", "HC n=4"), ("tiny-mhc", "mHC n=4")):
        m = load_config(REPO / "configs" / f"{name}.yaml").model
        assert m.architecture == arch and not m.has_dwa and m.ignored_dwa_note() is None


def test_baselines():
    base = REPO / "configs" / "baselines"
    last = load_config(base / "connect-to-last.yaml").model
    assert last.dwa and last.dwa_period == last.n_layers and last.dwa_init_offdiag == 1e-4
    assert load_config(base / "last-k.yaml").model.dwa_window == 4
    gains = load_config(base / "skip-gains.yaml").model
    assert gains.skip_gains and not gains.dwa


# ---------------------------------------------------------------------------------------------
# Valid ranges: every numeric key, found by reflection over the section dataclasses.


def _numeric_keys() -> list[tuple[str, str, dataclasses.Field, type, bool]]:
    """(section, name, field, int or float, nullable) of every int/float config field."""
    found = []
    for section_name, section in SECTIONS.items():
        hints = typing.get_type_hints(section)
        for f in dataclasses.fields(section):
            args = set(typing.get_args(hints[f.name])) or {hints[f.name]}
            kinds = args & {int, float}
            if kinds:
                found.append((section_name, f.name, f, kinds.pop(), type(None) in args))
    return found


NUMERIC_KEYS = _numeric_keys()


def _outside(valid: Range, kind: type) -> list[float]:
    """A value just past each bound of `valid` (of the field's type)."""
    step = 1 if kind is int else 0.5
    values = [valid.ge - step if valid.ge is not None else None,
              valid.gt if valid.gt is not None else None,
              valid.le + step if valid.le is not None else None,
              valid.lt if valid.lt is not None else None]
    return [kind(v) for v in values if v is not None]


def test_reflection_finds_the_numeric_keys():
    keys = {f"{section}.{name}" for section, name, *_ in NUMERIC_KEYS}
    assert {"model.init_std", "model.norm_eps", "model.rope_base", "model.dwa_window",
            "model.vocab_size", "optim.lr", "optim.warmup_steps", "train.seed",
            "train.max_consecutive_skips", "parallel.timeout_s", "checkpoint.keep"} <= keys
    assert not keys & {"model.dwa", "optim.decay_alphas", "tracking.required", "run.name"}
    hints = typing.get_type_hints(DenseFormerConfig)
    assert {name for section, name, *_ in NUMERIC_KEYS if section == "model"} == {
        f.name for f in dataclasses.fields(DenseFormerConfig)
        if hints[f.name] is not bool and not all(
            a in (type(None), bool) or typing.get_origin(a) is typing.Literal for a in (
                typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name])
                in (typing.Union, types.UnionType) else (hints[f.name],)))}


@pytest.mark.parametrize("section, name, field, kind, nullable", NUMERIC_KEYS,
                         ids=[f"{s}.{n}" for s, n, *_ in NUMERIC_KEYS])
def test_every_numeric_key_has_a_range_that_is_enforced(section, name, field, kind, nullable):
    key = f"{section}.{name}"
    valid = field.metadata.get("range")
    assert isinstance(valid, Range), f"{key} states no valid range: declare it with ranged()"
    assert valid == valid_range(section, field)
    outside = _outside(valid, kind)
    assert outside, f"{key}: the range {valid} excludes no value"
    for bad in [math.nan, math.inf, *outside]:
        cfg = Config()
        setattr(getattr(cfg, section), name, bad)
        with pytest.raises(ConfigError) as err:
            validate(cfg)
        assert err.value.key == key, (bad, str(err.value))
        assert repr(bad) in str(err.value)
    # The same from the command line (YAML spells NaN and inf with a dot).
    for text in [".nan", ".inf", *map(repr, outside)]:
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"{key}={text}"])
        assert err.value.key == key, (text, str(err.value))


MODEL_NUMERIC = [name for section, name, *_ in NUMERIC_KEYS if section == "model"]


@pytest.mark.parametrize("name", MODEL_NUMERIC)
def test_denseformer_config_refuses_out_of_range_values(name):
    """The model config checks its own ranges too (it is also built outside load_config)."""
    field = next(f for f in dataclasses.fields(DenseFormerConfig) if f.name == name)
    assert isinstance(field.metadata.get("range"), Range), f"model.{name} states no range"
    kind = numeric_kind(typing.get_type_hints(DenseFormerConfig)[name])[0]
    for bad in [math.nan, math.inf, -math.inf, *_outside(field.metadata["range"], kind)]:
        with pytest.raises(ModelConfigError) as err:
            DenseFormerConfig(**{name: bad})
        assert err.value.key == name and repr(bad) in str(err.value)


def test_ranges_doc_lists_every_numeric_key():
    doc = (REPO / "docs" / "configuration-ranges.md").read_text()
    table = [line for line in doc.splitlines() if line.startswith("|")]
    assert table == ranges_markdown().splitlines()
    assert len(table) == 2 + len(NUMERIC_KEYS)


def test_resume_auto_with_a_run_dir():
    """train.resume=auto without run.dir is refused (INVALID); with one it loads."""
    assert load_config(None, ["train.resume=auto", "run.dir=/r"]).train.resume == "auto"


# ---------------------------------------------------------------------------------------------
# Bad config files through the command line: exit 2 and "error: <path> ...", no traceback.


def _cli(tmp_path: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pretrain", *args], cwd=tmp_path, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _bad_config(tmp_path: Path, case: str) -> tuple[Path, str]:
    """(the --config path, the path the error must name) for each bad-file case."""
    if case == "missing file":
        return tmp_path / "nope.yaml", str(tmp_path / "nope.yaml")
    if case == "missing base":
        child = write(tmp_path / "child.yaml", "base: gone/base.yaml\ntrain:\n  steps: 5\n")
        return child, str(tmp_path / "gone" / "base.yaml")
    (tmp_path / "configs").mkdir()
    return tmp_path / "configs", str(tmp_path / "configs")


@pytest.mark.parametrize("case", ["missing file", "missing base", "directory"])
def test_bad_config_file_exits_2_naming_the_path(tmp_path, case):
    tmp_path = tmp_path.resolve()
    config, named = _bad_config(tmp_path, case)
    procs = {cmd: _cli(tmp_path, cmd, "--config", str(config)) for cmd in ("config", "train")}
    for cmd, proc in procs.items():
        _, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 2, (cmd, stderr)
        assert "Traceback" not in stderr
        error = next(line for line in stderr.splitlines() if line.startswith("error: "))
        assert named in error, (cmd, error)
        if case == "missing base":
            assert str(config) in error  # and the file that names it
    assert not (tmp_path / "runs").exists()


def test_resume_auto_without_run_dir_exits_2_before_creating_a_run(tmp_path):
    proc = _cli(tmp_path, "train", "--config", str(REPO / "configs" / "tiny.yaml"),
                "--set", "train.resume=auto", "--set", "train.steps=2")
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 2, stderr
    assert "error: train.resume: " in stderr and "set run.dir" in stderr
    assert not (tmp_path / "runs").exists()


def test_a_bad_optim_fused_exits_2_naming_the_key(tmp_path):
    proc = _cli(tmp_path, "train", "--config", str(REPO / "configs" / "tiny.yaml"),
                "--set", "optim.fused=sometimes")
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 2, stderr
    assert "error: optim.fused: expected bool or one of 'auto', got 'sometimes'" in stderr
    assert not (tmp_path / "runs").exists()
