"""What an Attention Residuals model's consumers attend to, over a validation batch.

The depth weights of AttnRes depend on the token (each source's key is its RMS-normalised
output), so there is no one matrix to draw as for the DWA: a forward over a validation
batch records every consumer's softmax weights (`AttnResConnections(..., record=...)`), and
`analyze` draws their mean over the batch's tokens and their spread (standard deviation over
tokens), consumer c (rows, 1..L + 1, L + 1 the model output) x source X_j (columns, 0..L).

Index conventions (docs/connections.md#attention-residuals): sub-layer 2i - 1 is block i's
attention, 2i its MLP; X_0 is the embedding. Under block AttnRes X_j is the running sum of
j's group through j, so column j of a consumer in a later group is the sum of that whole
group; a consumer's own group appears as its partial sum X_{c-1}. Cells that a consumer does
not read are NaN in the tables and grey in the heatmaps.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from data_pipeline import DataError
from pretrain import checkpoint
from pretrain.config import ConfigError, load_config
from pretrain.model.attnres import AttnResConnections
from pretrain.model.attnres_layout import AttnResLayout
from pretrain.model.program import run_program

STATS_FILE = "attnres_stats.json"
CMAP = "viridis"
ANNOTATE_UP_TO = 16  # write each mean weight in its cell up to this many consumers


@torch.no_grad()
def recorded_weights(model: torch.nn.Module, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
    """{consumer c: its softmax weights (n_sources, B, S)} of the model's forward on
    `tokens` (B, S), in the order of `layout.sources(c)`."""
    record: dict[int, torch.Tensor] = {}
    connections = AttnResConnections(model.attnres_query, model.attnres_key_norm,
                                     model.config.norm_eps, model.config.attnres_layout,
                                     record=record)
    run_program(model.program, model.block, connections, {0: model.embed(tokens)})
    return record


def weight_tables(layout: AttnResLayout, record: dict[int, torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of each consumer's weight on each source over all tokens: two
    (L + 1, L + 1) float64 tables, row c - 1 consumer c, column j source X_j, NaN where c
    does not read X_j."""
    size = layout.n_sublayers + 1
    mean = torch.full((size, size), math.nan, dtype=torch.float64)
    std = mean.clone()
    for c in range(1, size + 1):
        weights = record[c].flatten(1).double()  # (n_sources, tokens)
        columns = list(layout.sources(c))
        mean[c - 1, columns] = weights.mean(1)
        std[c - 1, columns] = weights.std(1, correction=0)
    return mean, std


def consumer_stats(layout: AttnResLayout, record: dict[int, torch.Tensor]) -> list[dict]:
    """Per consumer: its sources, the mean and std over tokens of each source's weight, the
    mean weight on X_0 (the embedding) and on the newest source X_{c-1}, the mean largest
    weight, and the mean entropy of its weights relative to uniform's (1: uniform)."""
    rows = []
    for c in range(1, layout.n_sublayers + 2):
        weights = record[c].flatten(1).double()
        n = weights.shape[0]
        entropy = -(weights * weights.clamp_min(1e-30).log()).sum(0)
        rows.append({
            "consumer": c,
            "sources": list(layout.sources(c)),
            "mean": weights.mean(1).tolist(),
            "std": weights.std(1, correction=0).tolist(),
            "x0": float(weights[0].mean()),
            "newest": float(weights[-1].mean()),
            "max": float(weights.max(0).values.mean()),
            "entropy": float(entropy.mean() / math.log(n)) if n > 1 else None,
        })
    return rows


def summary(rows: list[dict]) -> dict:
    """The consumer statistics averaged over consumers (entropy over those with two or more
    sources), and the largest spread of any weight."""
    def mean(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    return {"consumers": len(rows), "mean_x0": mean([r["x0"] for r in rows]),
            "mean_newest": mean([r["newest"] for r in rows]),
            "mean_max": mean([r["max"] for r in rows]),
            "mean_entropy": mean([r["entropy"] for r in rows]),
            "max_std": max(s for r in rows for s in r["std"])}


def write_attnres_heatmaps(mean: torch.Tensor, std: torch.Tensor, step: int | None,
                           path: str | Path, title: str | None = None) -> Path:
    """Two panels into the PNG `path` (parent directories created): the mean weights and
    their standard deviation over tokens, consumer x source, unread cells grey."""
    # deferred: pulls in matplotlib (slow to start, or optional)
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11.5, 4.8), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, 2, squeeze=False).ravel()
    cmap = colormaps[CMAP].with_extremes(bad="#d9d9d9")  # grey: not a source
    for ax, table, name in ((axes[0], mean, "mean weight"), (axes[1], std, "std over tokens")):
        values = table.numpy()
        masked = np.ma.masked_invalid(values)
        top = max(float(np.nanmax(values)) if np.isfinite(values).any() else 0.0, 1e-6)
        image = ax.imshow(masked, cmap=cmap, vmin=0.0, vmax=top, aspect="equal",
                          interpolation="nearest")
        size = values.shape[0]
        tick = max(1, size // 12)
        ax.set_xticks(range(0, size, tick), [str(j) for j in range(0, size, tick)])
        ax.set_yticks(range(0, size, tick), [str(c + 1) for c in range(0, size, tick)])
        ax.set_xlabel("source X_j")
        ax.set_ylabel("consumer c (last: the output)")
        ax.set_title(name)
        if size <= ANNOTATE_UP_TO:
            for c, j in zip(*np.nonzero(~masked.mask), strict=True):
                ax.text(j, c, f"{values[c, j]:.2f}", ha="center", va="center", fontsize=6,
                        color="black" if values[c, j] > 0.6 * top else "white")
        figure.colorbar(image, ax=ax)
    figure.suptitle(title or (f"AttnRes depth weights, step {step}" if step is not None
                              else "AttnRes depth weights"))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path


def checkpoint_entry(step: int | None, path: Path, layout: AttnResLayout,
                     record: dict[int, torch.Tensor], mean: torch.Tensor,
                     std: torch.Tensor) -> dict:
    """One checkpoint's record in attnres_stats.json (`mean`, `std`: its `weight_tables`)."""
    rows = consumer_stats(layout, record)
    return {"step": step, "path": str(path), "mean": json_table(mean),
            "std": json_table(std), "consumers": rows, "summary": summary(rows)}


def json_table(table: torch.Tensor) -> list[list[float | None]]:
    """A table as JSON can hold it: null for the cells a consumer (or stream) does not read."""
    return [[None if math.isnan(v) else v for v in row] for row in table.tolist()]


def validation_tokens(data: Path, batch_size: int, seq_len: int) -> torch.Tensor:
    """The first validation batch of the prepared dataset `data`, cut to `seq_len` tokens
    (B, S); ConfigError naming --data or --batch-size when there is none."""
    # deferred: pulls in sentencepiece, wids (slow to start, or optional)
    from data_pipeline.loader import validation_batches

    if batch_size < 1:
        raise ConfigError("--batch-size", f"must be >= 1, got {batch_size}")
    try:
        batch = next(iter(validation_batches(data, batch_size, max_batches=1)), None)
    except DataError as err:
        raise ConfigError("--data", str(err)) from None
    if batch is None:
        raise ConfigError("--batch-size", f"{data} has fewer than {batch_size} validation "
                                          "samples: pass a smaller --batch-size")
    return batch[:, :seq_len]


def data_of(source: Path, given: str | None) -> Path:
    """--data, else the data.path of the config of the run, checkpoint or exported
    directory `source`; ConfigError naming --data when there is neither."""
    if given is not None:
        return Path(given)
    if (source / checkpoint.MANIFEST).is_file():
        source = source.resolve().parent.parent  # a native checkpoint: its run directory
    config = source / "config.yaml"
    data = load_config(config, [], check=False).data.path if config.is_file() else None
    if data is None:
        raise ConfigError("--data", f"{source} names no data.path: pass --data DIR (a "
                                    "prepared dataset with a validation split)")
    return Path(data)


def analyzed_models(args, model: torch.nn.Module, source: Path, step_of) -> list[tuple]:
    """(step, path, model) of each checkpoint `analyze` reads: `source` alone (--checkpoint,
    `model` its model), or every complete checkpoint of the run (--run); `step_of(path)`: a
    checkpoint's step (None for an exported directory)."""
    # deferred: pulls in sentencepiece, torch (slow to start, or optional)
    from pretrain.load import load_model

    if args.checkpoint:
        return [(step_of(source), source, model)]
    models = []
    for step, path in checkpoint.list_checkpoints(source / "checkpoints"):
        try:
            models.append((step, path, load_model(path, device="cpu")[0]))
        except checkpoint.CheckpointError:
            continue  # an incomplete checkpoint (a save that was cut short)
    return models


def analyze_attnres(args, model: torch.nn.Module, source: Path, step_of) -> int:
    """`analyze` of an AttnRes model: per checkpoint, the heatmaps of its depth weights over
    one validation batch (`step-XXXXXXXX.png`, `exported.png`) and attnres_stats.json.
    `model`: the model of `source` (--checkpoint) or of the run's latest checkpoint (--run);
    `step_of(path)`: a checkpoint's step (None for an exported directory)."""
    config, layout = model.config, model.config.attnres_layout
    tokens = validation_tokens(data_of(source, args.data), args.batch_size, config.seq_len)
    models = analyzed_models(args, model, source, step_of)
    out, entries = Path(args.out), []
    for step, path, each in models:
        record = recorded_weights(each, tokens)
        name = f"step-{step:08d}.png" if step is not None else "exported.png"
        mean, std = weight_tables(layout, record)
        write_attnres_heatmaps(mean, std, step, out / name)
        entries.append({**checkpoint_entry(step, path, layout, record, mean, std),
                        "heatmap": name})
    stats = {"source": str(source),
             "model": {"n_layers": config.n_layers, "attnres_blocks": config.attnres_blocks},
             "batch": {"sequences": tokens.shape[0], "tokens": tokens.shape[1]},
             "sources": [list(layout.sources(c)) for c in range(1, layout.n_sublayers + 2)],
             "checkpoints": entries}
    (out / STATS_FILE).write_text(json.dumps(stats, indent=1) + "\n")
    print(f"wrote {len(entries)} heatmap(s) and {STATS_FILE} to {out}")
    return 0
