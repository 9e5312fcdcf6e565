"""What a sweep does beyond its grid: a dependent stage, and downstream tasks after each run.

A dependent stage continues runs of the grid (`train.init_from`, the new run starts from the
parent's final weights with a fresh optimizer at step 0):

    continue:
      from: {architecture: transformer}     # grid values of the runs to continue ({}: all)
      grid:
        architecture: [transformer, denseformer-1x1]   # what each is continued as
        tokens: [5120]                      # the continuation's own budget (D)
        lr: [1e-3]                          # optional, as in the grid
      set: {optim.warmup_steps: 0}          # optional dotted overrides for this stage

Each matching parent gives one run per architecture x lr x tokens, with the parent's shape
and seed, named `<parent>.then-<architecture>-...` and tagged `stage=continue`,
`continues=<parent>`, `parent_architecture`. The sweep submits it with a Slurm dependency
on its parent's array task (`--dependency=afterok:<job>_<task>`), so it starts only when the
parent finished, and is dropped by Slurm if the parent failed. A continuation that
`train.init_from` would refuse (a DenseFormer continued as a Transformer or with another k x
p) is refused here, at expansion, naming both runs.

Downstream tasks (lm-evaluation-harness, `python -m pretrain lm-eval`) run on each run's final
checkpoint by the launcher once training succeeded; the scores land in the run's MLflow run
as `lm_eval/<task>/<metric>`:

    lm_eval: {tasks: [tiny_cloze], include_path: tasks, limit: 20, batch_size: 4}

`include_path` (a folder of task YAMLs, relative to the sweep file) is optional, as are
`limit` (examples per task) and `num_fewshot`.

Generation speed (slurm/inference_speed.py) is measured the same way, after training, and
logged as `inference/prefill_tokens_per_s` and `inference/decode_tokens_per_s`:

    inference: {batch: 1, prompt: 16, new_tokens: 16, rounds: 3}
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from pretrain.config import config_to_dict
from slurm.sweep_axes import number_list, parse_architecture
from slurm.sweep_errors import SweepError

CONTINUE_KEYS = {"from", "grid", "set"}
CONTINUE_GRID_KEYS = {"architecture", "tokens", "lr", "warmup"}
LM_EVAL_KEYS = {"tasks", "include_path", "limit", "batch_size", "num_fewshot"}
INFERENCE_DEFAULTS = {"batch": 1, "prompt": 32, "new_tokens": 32, "rounds": 3}


def _matches(values: dict[str, Any], architecture: str, wanted: dict[str, Any]) -> bool:
    have = {**values, "architecture": architecture}
    return all(k in have and str(have[k]) == str(v) for k, v in wanted.items())


def continuation_runs(spec: Any, parents: list, context) -> list:
    """The runs of a `continue:` stage (RunSpecs indexed after `parents`), each depending on
    the parent run it starts from. `context`: the sweep's RunContext."""
    # deferred: pulls in torch (slow to start, or optional)
    from pretrain.init_from import model_mismatch

    if not isinstance(spec, dict) or set(spec) - CONTINUE_KEYS or "grid" not in spec:
        raise SweepError(f"continue: expected a mapping with grid (and from, set), got "
                         f"{spec!r}")
    wanted = spec.get("from") or {}
    stage_set = spec.get("set") or {}
    grid = spec["grid"]
    if not isinstance(wanted, dict) or not isinstance(stage_set, dict) \
            or not isinstance(grid, dict):
        raise SweepError("continue: from, grid and set must be mappings")
    unknown = set(grid) - CONTINUE_GRID_KEYS
    if unknown:
        raise SweepError(f"continue.grid: unknown keys {sorted(unknown)}; known: "
                         f"{sorted(CONTINUE_GRID_KEYS)} (the shape and seed are the parent's)")
    archs = [parse_architecture(a, "continue.grid.architecture")
             for a in (grid.get("architecture") or ["transformer"])]
    tokens = number_list(grid, "tokens", (int, float), True, "continue.grid")
    if tokens is None:
        raise SweepError("continue.grid.tokens: the continuation's budget (D) is required")
    lrs = number_list(grid, "lr", (int, float), True, "continue.grid")
    warmups = number_list(grid, "warmup", (int, float), False, "continue.grid")
    chosen = [p for p in parents if _matches(p.values, p.architecture, wanted)]
    if not chosen:
        raise SweepError(f"continue.from: {wanted} matches no run of the grid (grid values: "
                         "architecture, n_layers, d_model, seed, lr, warmup)")
    runs = []
    for parent, arch in itertools.product(chosen, archs):
        for lr, warmup, budget in itertools.product(arch.lrs or lrs or [None],
                                                    arch.warmups or warmups or [None], tokens):
            extra = {**stage_set, "train.init_from": parent.config.run.dir}
            cfg, model, vocab = context.resolve(arch, parent.shape, lr,
                                                f"continue {parent.name} as {arch.name}", extra)
            refused = model_mismatch(config_to_dict(parent.config)["model"],
                                     config_to_dict(cfg)["model"])
            if refused:
                raise SweepError(f"continue: {parent.name} cannot start a {arch.name} run "
                                 f"(train.init_from refuses it): {'; '.join(refused)}")
            axes = {k: v for k, v in (("lr", lr), ("warmup", warmup)) if v is not None}
            run = context.finish(len(parents) + len(runs), f"{parent.name}.then-{arch.name}",
                                 arch.name, cfg, model, vocab, budget,
                                 parent.config.train.seed, axes, parent.shape)
            run.depends_on = parent.index
            run.stage_tags = {"stage": "continue", "continues": parent.name,
                              "parent_architecture": parent.architecture}
            runs.append(run)
    return runs


def lm_eval_settings(spec: Any, sweep_dir: Path) -> dict[str, Any] | None:
    """The sweep's `lm_eval:` section checked, include_path made absolute; None if absent."""
    if spec is None:
        return None
    if not isinstance(spec, dict) or set(spec) - LM_EVAL_KEYS or not spec.get("tasks"):
        raise SweepError(f"lm_eval: expected a mapping with tasks (and {sorted(LM_EVAL_KEYS)})"
                         f", got {spec!r}")
    tasks = spec["tasks"] if isinstance(spec["tasks"], list) else [spec["tasks"]]
    if not all(isinstance(t, str) and t.replace("_", "").replace("-", "").isalnum()
               for t in tasks):
        raise SweepError(f"lm_eval.tasks: expected task names, got {spec['tasks']!r}")
    settings: dict[str, Any] = {"tasks": tasks, "batch_size": spec.get("batch_size", 4)}
    for key in ("limit", "batch_size", "num_fewshot"):
        value = spec.get(key, settings.get(key))
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise SweepError(f"lm_eval.{key}: expected a non-negative integer, got {value!r}")
        if value is not None:
            settings[key] = value
    if spec.get("include_path") is not None:
        folder = (sweep_dir / str(spec["include_path"])).resolve()
        if not folder.is_dir():
            raise SweepError(f"lm_eval.include_path: {folder} is not a directory")
        settings["include_path"] = str(folder)
    return settings


def lm_eval_command(settings: dict[str, Any], run_dir: str | Path, device: str) -> list[str]:
    """The `python -m pretrain lm-eval` arguments that score a finished run's checkpoint."""
    command = ["lm-eval", "--model_args", f"checkpoint={run_dir}",
               "--tasks", ",".join(settings["tasks"]),
               "--batch_size", str(settings["batch_size"]), "--device", device]
    for key in ("limit", "num_fewshot", "include_path"):
        if key in settings:
            command += [f"--{key}", str(settings[key])]
    return command


def inference_settings(spec: Any) -> dict[str, int] | None:
    """The sweep's `inference:` section with its defaults; None if absent."""
    if spec is None:
        return None
    if not isinstance(spec, dict) or set(spec) - set(INFERENCE_DEFAULTS):
        raise SweepError(f"inference: expected a mapping of {sorted(INFERENCE_DEFAULTS)}, got "
                         f"{spec!r}")
    settings = {**INFERENCE_DEFAULTS, **spec}
    for key, value in settings.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SweepError(f"inference.{key}: expected a positive integer, got {value!r}")
    return settings


def follow_up_commands(lm_eval: dict[str, Any] | None, inference: dict[str, int] | None,
                       run_dir: str | Path, device: str) -> dict[str, list[str]]:
    """{tag: python arguments} of what runs on a run after it trained: lm-eval and the
    inference speed; each tag later holds the command's exit status."""
    commands = {}
    if lm_eval:
        commands["lm_eval_status"] = ["-m", "pretrain", *lm_eval_command(lm_eval, run_dir,
                                                                         device)]
    if inference:
        commands["inference_status"] = [
            "-m", "slurm.inference_speed", "--run", str(run_dir),
            *[x for k, v in inference.items() for x in (f"--{k.replace('_', '-')}", str(v))]]
    return commands
