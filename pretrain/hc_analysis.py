"""What a Hyper-Connections model's sub-layers read and write: `analyze` of `model.connection:
hc` or `mhc`, into hc_stats.json and one PNG per checkpoint.

Per sub-layer c = 1..L (2i - 1 block i's attention, 2i its MLP;
docs/connections.md#hyper-connections-hc-and-mhc) three weights: `pre` (n), the share of
each stream in the sub-layer's input; `mix` (n x n), destination-major: mix[k][l] is stream
l's weight in the new stream k (Ar^T for HC, H_res for mHC); `post` (n), the sub-layer
output's weight in each stream. Static HC's are parameters, drawn as they are (no data
needed). Dynamic HC's and mHC's depend on the token: a forward over a validation batch
records them (`HCConnections(..., record=...)`) and `analyze` draws their mean over the
batch's tokens and their spread (standard deviation over tokens).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pretrain.attnres_analysis import analyzed_models, data_of, validation_tokens
from pretrain.model.program import run_program

STATS_FILE = "hc_stats.json"
CMAP = "coolwarm"
WEIGHTS = ("pre", "mix", "post")


def static_tables(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Static HC's {pre (L, n), mix (L, n, n), post (L, n)}, float64."""
    p = model.hc_parameters()
    return {"pre": p["hc_pre"].detach().double(),
            "mix": p["hc_res"].detach().double().mT,
            "post": p["hc_post"].detach().double()}


@torch.no_grad()
def recorded_tables(model: torch.nn.Module, tokens: torch.Tensor
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(mean, std) over the tokens of `tokens` (B, S) of every sub-layer's weights, each
    {pre (L, n), mix (L, n, n), post (L, n)}, float64."""
    record: dict[int, tuple] = {}
    x0 = model.embed(tokens)
    run_program(model.program, model.block, model.training_connections(x0, False, record),
                {0: x0})
    mean, std = {}, {}
    for n, name in enumerate(WEIGHTS):
        per_token = [record[c][n].double() for c in sorted(record)]  # each (B, S, ...)
        stacked = torch.stack([w.flatten(0, 1) for w in per_token])  # (L, tokens, ...)
        mean[name], std[name] = stacked.mean(1), stacked.std(1, correction=0)
    return mean, std


def write_hc_heatmaps(tables: list[tuple[str, dict[str, torch.Tensor]]], path: str | Path,
                      title: str) -> Path:
    """One row of three panels per (label, tables): pre (sub-layer x stream), mix (sub-layer
    x (k, l) pairs, destination-major) and post (sub-layer x stream)."""
    # deferred: pulls in matplotlib (slow to start, or optional)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(13, 4.2 * len(tables)), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(tables), 3, squeeze=False)
    for row, (label, table) in enumerate(tables):
        for ax, name in zip(axes[row], WEIGHTS, strict=True):
            values = table[name].flatten(1).numpy()
            image = ax.imshow(values, cmap=CMAP, aspect="auto", interpolation="nearest")
            n = table["pre"].shape[1]
            ticks = [f"{k}<{j}" for k in range(n) for j in range(n)] if name == "mix" \
                else [str(k) for k in range(n)]
            ax.set_xticks(range(len(ticks)), ticks, fontsize=6 if name == "mix" else 8)
            ax.set_xlabel("stream k<l: l into k" if name == "mix" else "stream")
            ax.set_ylabel("sub-layer c - 1")
            ax.set_title(f"{name} ({label})")
            figure.colorbar(image, ax=ax)
    figure.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path


def _json(tables: dict[str, torch.Tensor]) -> dict[str, list]:
    return {name: tables[name].tolist() for name in WEIGHTS}


def analyze_hc(args, model: torch.nn.Module, source: Path, step_of) -> int:
    """`analyze` of an HC or mHC model: per checkpoint, the heatmaps of its weights
    (`step-XXXXXXXX.png`, `exported.png`) and hc_stats.json. `model`: the model of `source`
    (--checkpoint) or of the run's latest checkpoint (--run); `step_of(path)`: a
    checkpoint's step (None for an exported directory)."""
    config, layout = model.config, model.config.hc_layout
    dynamic = layout.dynamic
    tokens = validation_tokens(data_of(source, args.data), args.batch_size, config.seq_len) \
        if dynamic else None
    models = analyzed_models(args, model, source, step_of)
    out, entries = Path(args.out), []
    for step, path, each in models:
        name = f"step-{step:08d}.png" if step is not None else "exported.png"
        title = f"{layout.name} weights" + (f", step {step}" if step is not None else "")
        entry = {"step": step, "path": str(path), "heatmap": name}
        if dynamic:
            mean, std = recorded_tables(each, tokens)
            write_hc_heatmaps([("mean", mean), ("std over tokens", std)], out / name, title)
            entry.update(mean=_json(mean), std=_json(std))
        else:
            tables = static_tables(each)
            write_hc_heatmaps([("static", tables)], out / name, title)
            entry.update(_json(tables))
        entries.append(entry)
    stats = {"source": str(source),
             "model": {"n_layers": config.n_layers, "connection": layout.kind,
                       "hc_streams": layout.streams, "dynamic": dynamic},
             "checkpoints": entries}
    if tokens is not None:
        stats["batch"] = {"sequences": tokens.shape[0], "tokens": tokens.shape[1]}
    (out / STATS_FILE).write_text(json.dumps(stats, indent=1) + "\n")
    print(f"wrote {len(entries)} heatmap(s) and {STATS_FILE} to {out}")
    return 0
