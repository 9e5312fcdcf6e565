"""What a MUDD model's mixes weigh, over a validation batch.

The dynamic weights of MUDD depend on the token (A_i = a_i + W2_i GELU(W1_i RMSNorm(X_i))),
so a forward over a validation batch records every mix's weights (`MuddConnections(...,
record=...)`), and `analyze` writes their mean over the batch's tokens and their spread
(standard deviation over tokens) per mix and stream (mudd_stats.json), and per stream a
heatmap like AttnRes's (pretrain/attnres_analysis.py): consumer c = block c's input (rows
1..d + 1, d + 1 the model output: the mix M_{c-1}; block 1 reads X_0 alone) x source X_j
(columns 0..d). The static ablation's weights are the same for every token (std 0).

Index conventions: pretrain/model/mudd_program.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from pretrain.attnres_analysis import (
    analyzed_models,
    data_of,
    json_table,
    validation_tokens,
    write_attnres_heatmaps,
)
from pretrain.model.mudd import MuddConnections
from pretrain.model.mudd_program import STREAMS, MuddLayout
from pretrain.model.program import run_program

STATS_FILE = "mudd_stats.json"


@torch.no_grad()
def recorded_weights(model: torch.nn.Module, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
    """{mix i: its weights (tokens, C_i, i + 1)} of the model's forward on `tokens`."""
    record: dict[int, torch.Tensor] = {}
    x0 = model.embed(tokens)
    connections = MuddConnections((model.mudd_static, model.mudd_w1, model.mudd_w2),
                                  model.config.mudd_layout, model.config.norm_eps, x0,
                                  record=record)
    run_program(model.program, model.block, connections, {0: x0})
    return record


def mix_stats(layout: MuddLayout, record: dict[int, torch.Tensor]) -> list[dict]:
    """Per mix and stream: the mean and std over tokens of the weight on each X_j, and the
    mean weight on X_0 and on the newest X_i."""
    rows = []
    for i in range(1, layout.n_layers + 1):
        weights = record[i].double()
        for s, stream in enumerate(layout.stream_names(i)):
            w = weights[:, s]  # (tokens, i + 1)
            rows.append({"mix": i, "stream": stream, "mean": w.mean(0).tolist(),
                         "std": w.std(0, correction=0).tolist(), "x0": float(w[:, 0].mean()),
                         "newest": float(w[:, -1].mean())})
    return rows


def stream_tables(layout: MuddLayout, rows: list[dict], stream: str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std), (d + 1, d + 1): row c - 1 block c's input (the mix M_{c-1}; row 0: X_0
    alone), column j X_j; NaN where the stream does not exist or reads nothing."""
    size = layout.n_layers + 1
    mean = torch.full((size, size), math.nan, dtype=torch.float64)
    std = mean.clone()
    mean[0, 0], std[0, 0] = 1.0, 0.0
    for row in rows:
        if row["stream"] == stream:
            n = len(row["mean"])
            mean[row["mix"], :n] = torch.tensor(row["mean"], dtype=torch.float64)
            std[row["mix"], :n] = torch.tensor(row["std"], dtype=torch.float64)
    return mean, std


def analyze_mudd(args, model: torch.nn.Module, source: Path, step_of) -> int:
    """`analyze` of a MUDD model: per checkpoint and stream a heatmap of the mean weights
    and their spread over one validation batch (`step-XXXXXXXX-<stream>.png`,
    `exported-<stream>.png`), and mudd_stats.json. Arguments as `analyze_attnres`."""
    config, layout = model.config, model.config.mudd_layout
    tokens = validation_tokens(data_of(source, args.data), args.batch_size, config.seq_len)
    models = analyzed_models(args, model, source, step_of)
    out, entries = Path(args.out), []
    for step, path, each in models:
        rows = mix_stats(layout, recorded_weights(each, tokens))
        stem = f"step-{step:08d}" if step is not None else "exported"
        heatmaps = {}
        for stream in STREAMS[layout.streams]:
            mean, std = stream_tables(layout, rows, stream)
            name = f"{stem}-{stream}.png"
            title = f"MUDD {stream} weights" + (f", step {step}" if step is not None else "")
            write_attnres_heatmaps(mean, std, step, out / name, title=title)
            heatmaps[stream] = {"file": name, "mean": json_table(mean),
                                "std": json_table(std)}
        entries.append({"step": step, "path": str(path), "mixes": rows,
                        "heatmaps": heatmaps,
                        "max_std": max(s for r in rows for s in r["std"])})
    stats = {"source": str(source),
             "model": {"n_layers": config.n_layers, "mudd_streams": layout.streams,
                       "mudd_dynamic": layout.dynamic},
             "batch": {"sequences": tokens.shape[0], "tokens": tokens.shape[1]},
             "checkpoints": entries}
    (out / STATS_FILE).write_text(json.dumps(stats, indent=1) + "\n")
    print(f"wrote {len(entries) * len(STREAMS[layout.streams])} heatmap(s) and {STATS_FILE} "
          f"to {out}")
    return 0
