"""Cost figures of a study's runs: measured speed from MLflow, memory from the estimators.

Measured (each run's own metrics, medians over its steps after the first two): tokens per
second, the step time it implies (batch x seq_len / tokens per second) and MFU; and when the
sweep had `inference:`, generation speed (prefill and decode tokens per second,
slurm/inference_speed.py). Estimated
from the run's resolved config (`parallel.strategies.memory`,
`parallel.strategies.inference_memory`, the same estimators as
`python -m parallel.memory`): training memory of the fullest rank without and
with block activation checkpointing, and for generation at batch 1 and the full context the
KV cache and the DWA state a decode step keeps.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path

from data_pipeline.index import read_index
from parallel.strategies.inference_memory import estimate_inference
from parallel.strategies.memory import estimate, local_parameters
from pretrain.config import load_config
from slurm.report_data import StudyRun
from slurm.report_html import column, paragraph, section, sizes, table
from slurm.report_mfu import StudyPeak, study_mfu


@dataclass
class Cost:
    tokens_per_s: float | None
    step_seconds: float | None
    mfu: float | None  # against the study's one peak (slurm/report_mfu.py)
    train_bytes: dict[str, float]  # activation checkpointing mode -> fullest rank's bytes
    kv_cache_bytes: float | None
    dwa_decode_bytes: float | None
    prefill_tokens_per_s: float | None = None  # measured by slurm/inference_speed.py
    decode_tokens_per_s: float | None = None
    note: str = ""


def _config(run: StudyRun):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(run.config_text)
        cfg = load_config(path)
    vocab = cfg.model.vocab_size
    if vocab is None and cfg.data.path and (Path(cfg.data.path) / "index.json").is_file():
        vocab = read_index(cfg.data.path, check_files=False).vocab_size
    return cfg, (cfg.model.with_vocab(vocab) if vocab else None)


def step_seconds(run: StudyRun) -> float | None:
    """The run's median step time: batch x seq_len over its median tokens per second."""
    tokens_per_s = run.speed.get("tokens_per_s")
    batch, seq = run.params.get("train.batch_size"), run.params.get("model.seq_len")
    return int(batch) * int(seq) / tokens_per_s if tokens_per_s and batch and seq else None


def cost_of(run: StudyRun, peak: StudyPeak) -> Cost:
    """The run's measured speed, its MFU against the study's `peak`, and its estimated
    memory (what cannot be known is None)."""
    tokens_per_s, mfu = run.speed.get("tokens_per_s"), study_mfu(run, peak)
    cost = Cost(tokens_per_s, step_seconds(run), mfu, {}, None, None,
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

    device = "cuda" if cfg.train.device == "cuda" else "cpu"
    for mode in ("none", "block"):
        variant = dataclasses.replace(cfg, parallel=dataclasses.replace(
            cfg.parallel, activation_checkpointing=mode))
        cost.train_bytes[mode] = max(r.total_bytes for r in estimate(
            variant.parallel, model, cfg.train.batch_size, cfg.train.dtype, None, device,
            cfg.optim.decay_alphas))
    parameters = local_parameters(model, 1, range(1, model.n_layers + 1), True, True,
                                  decay_alphas=False)
    (rank,) = estimate_inference(model, parameters, 1, 1, model.seq_len,
                                 dtype="bf16" if device == "cuda" else "fp32")
    cost.kv_cache_bytes, cost.dwa_decode_bytes = rank.kv_cache_bytes, rank.dwa_decode_bytes
    return cost


def cost_section(runs: list[StudyRun], peak: StudyPeak) -> tuple[str, dict]:
    """The Cost section (one number format per column) and its figures for report.json."""
    costs = [cost_of(run, peak) for run in runs]
    columns = [
        column([c.tokens_per_s for c in costs]), column([c.step_seconds for c in costs], 3),
        column([None if c.mfu is None else 100 * c.mfu for c in costs], 3, "%"),
        sizes([c.train_bytes.get("none") for c in costs]),
        sizes([c.train_bytes.get("block") for c in costs]),
        sizes([c.kv_cache_bytes for c in costs]), sizes([c.dwa_decode_bytes for c in costs]),
        column([c.prefill_tokens_per_s for c in costs]),
        column([c.decode_tokens_per_s for c in costs])]
    rows = [(run.name, *[cells[i] for cells in columns]) for i, run in enumerate(runs)]
    notes = [f"{run.name}: {cost.note}" for run, cost in zip(runs, costs, strict=True)
             if cost.note]
    if peak.flops is None:
        mfu_note = f"MFU: not shown: {peak.why}."
    elif peak.comparable:
        mfu_note = (f"MFU: model FLOP/s per device over one peak for every run, {peak.source}.")
    else:
        mfu_note = (f"{peak.header}: model FLOP/s per device over one matmul speed for every "
                    f"run, {peak.source}. It is relative to a matmul measured on this "
                    "machine and not comparable across machines (nor with a GPU's MFU); "
                    "compare the runs by tokens/s.")
    html = section(
        "Cost",
        paragraph("Measured: medians over each run's steps (the first two left out). "
                  "Estimated (parallel.strategies.memory, parallel.strategies.inference_memory) "
                  "from the run's "
                  "config at one data-parallel rank: training memory of the fullest rank "
                  "without and with block activation checkpointing; for generation at batch "
                  "1 and the full context, the KV cache and the DWA state of a decode step. "
                  "Generation speed: measured after training when the sweep has inference: "
                  "(slurm/inference_speed.py)."),
        paragraph(mfu_note),
        table(["run", "tokens/s", "step s", peak.header, "train mem", "train mem (ckpt)",
               "KV cache", "DWA decode state", "prefill tok/s", "decode tok/s"], rows,
              numeric=range(1, 10)),
        "".join(paragraph(n) for n in notes))
    summary = {"mfu_peak": {"flops": peak.flops, "source": peak.source,
                            "comparable_across_machines": peak.comparable, "why": peak.why},
               "cost": {run.name: {"tokens_per_s": c.tokens_per_s, "mfu": c.mfu}
                        for run, c in zip(runs, costs, strict=True)}}
    return html, summary
