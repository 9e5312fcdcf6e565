"""Cost figures of a study's runs: measured speed from MLflow, memory from the estimators.

Measured (each run's own metrics, medians over its steps after the first two): tokens per
second, the step time it implies (batch x seq_len / tokens per second) and MFU; and when the
sweep had `inference:`, generation speed (prefill and decode tokens per second,
slurm/inference_speed.py). Estimated
from the run's resolved config (`parallel.memory`, `parallel.inference_memory`, the same
estimators as `python -m parallel.memory`): training memory of the fullest rank without and
with block activation checkpointing, and for generation at batch 1 and the full context the
KV cache and the DWA state a decode step keeps.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path

from slurm.report_data import StudyRun


@dataclass
class Cost:
    tokens_per_s: float | None
    step_seconds: float | None
    mfu: float | None
    train_bytes: dict[str, float]  # activation checkpointing mode -> fullest rank's bytes
    kv_cache_bytes: float | None
    dwa_decode_bytes: float | None
    prefill_tokens_per_s: float | None = None  # measured by slurm/inference_speed.py
    decode_tokens_per_s: float | None = None
    note: str = ""


def _config(run: StudyRun):
    from pretrain.config import load_config

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(run.config_text)
        cfg = load_config(path)
    vocab = cfg.model.vocab_size
    if vocab is None and cfg.data.path and (Path(cfg.data.path) / "index.json").is_file():
        from data_pipeline.index import read_index

        vocab = read_index(cfg.data.path, check_files=False).vocab_size
    return cfg, (cfg.model.with_vocab(vocab) if vocab else None)


def cost_of(run: StudyRun) -> Cost:
    """The run's measured speed and estimated memory (what cannot be known is None)."""
    tokens_per_s, mfu = run.speed.get("tokens_per_s"), run.speed.get("mfu")
    step = None
    batch, seq = run.params.get("train.batch_size"), run.params.get("model.seq_len")
    if tokens_per_s and batch and seq:
        step = int(batch) * int(seq) / tokens_per_s
    cost = Cost(tokens_per_s, step, mfu, {}, None, None,
                run.metrics.get("inference/prefill_tokens_per_s"),
                run.metrics.get("inference/decode_tokens_per_s"))
    if run.config_text is None:
        cost.note = "no config.yaml artifact: no memory estimate"
        return cost
    try:
        cfg, model = _config(run)
    except Exception as err:  # noqa: BLE001 (a config from another version of the code)
        cost.note = f"config not readable here: {err}"
        return cost
    if model is None:
        cost.note = "vocabulary unknown (data not on this machine): no memory estimate"
        return cost
    from parallel.inference_memory import estimate_inference
    from parallel.memory import estimate, local_parameters

    device = "cuda" if cfg.train.device == "cuda" else "cpu"
    for mode in ("none", "block"):
        variant = dataclasses.replace(cfg, parallel=dataclasses.replace(
            cfg.parallel, activation_checkpointing=mode))
        cost.train_bytes[mode] = max(r.total_bytes for r in estimate(variant, None, device,
                                                                     model))
    parameters = local_parameters(model, 1, range(1, model.n_layers + 1), True, True,
                                  decay_alphas=False)
    (rank,) = estimate_inference(model, parameters, 1, 1, model.seq_len,
                                 dtype="bf16" if device == "cuda" else "fp32")
    cost.kv_cache_bytes, cost.dwa_decode_bytes = rank.kv_cache_bytes, rank.dwa_decode_bytes
    return cost
