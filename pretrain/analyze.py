"""`python -m pretrain analyze`: the DWA weights of a checkpoint, or of every checkpoint of a run
(for Attention Residuals, their depth weights over a validation batch: attnres_analysis.py;
for MUDD its mixes' weights: mudd_analysis.py; for Hyper-Connections, their weights per
sub-layer: hc_analysis.py).

    python -m pretrain analyze --checkpoint runs/tiny/checkpoints/step-00000300 --out dwa/
    python -m pretrain analyze --run runs/tiny --out dwa/

Writes into --out one heatmap per checkpoint (`step-XXXXXXXX.png`; `exported.png` for an
exported directory), for a run also `grid.png` (every checkpoint side by side, one colour
scale), and `dwa_stats.json`: the model's shape, the pattern mask, and per checkpoint its
step, the (d, d + 1) alpha matrix (`DenseFormer.dwa_matrix()`: identity rows for blocks
without a DWA) and the statistics below, per DWA and summarised (docs/evaluation.md).
Index conventions as in docs/design.md: row i - 1 is the DWA after block i, column j X_j.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from pretrain import checkpoint
from pretrain.config import ConfigError

if TYPE_CHECKING:  # torch is imported where it is used: `python -m pretrain` stays quick
    import torch

STATS_FILE = "dwa_stats.json"
GRID_FILE = "grid.png"


def add_parser(subparsers) -> None:
    """The `analyze` subcommand and its options."""
    parser = subparsers.add_parser("analyze", help="DWA weight heatmaps and statistics of a "
                                   "checkpoint or of every checkpoint of a run (AttnRes, MUDD: "
                                   "depth weights over a validation batch)")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--run", help="run directory: every complete checkpoint, by step")
    where.add_argument("--checkpoint", help="one checkpoint, or an exported directory")
    parser.add_argument("--out", required=True, help="directory to write (created)")
    parser.add_argument("--data", help="AttnRes, MUDD: the prepared dataset whose first validation "
                                       "batch the weights are taken over (default: the run "
                                       "config's data.path)")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="AttnRes, MUDD: sequences in that batch (default 8)")


def dwa_row_stats(matrix: torch.Tensor, mask: list[list[bool]]) -> list[dict]:
    """Per DWA (block i with one): the sum of its weights, its weight on X_0 (None when it
    does not read X_0) and on the block's own output X_i, and how many of its weights are
    negative (share) and how large they are (summed and mean |alpha|)."""
    rows = []
    for i in range(1, matrix.shape[0] + 1):
        live = [j for j, on in enumerate(mask[i - 1]) if on]
        if not live:
            continue
        weights = [float(matrix[i - 1, j]) for j in live]
        negative = [-w for w in weights if w < 0]
        rows.append({
            "block": i,
            "inputs": live,
            "row_sum": sum(weights),
            "x0": float(matrix[i - 1, 0]) if 0 in live else None,
            "own": float(matrix[i - 1, i]),
            "negative_share": len(negative) / len(weights),
            "negative_mass": sum(negative),
            "negative_mean": sum(negative) / len(negative) if negative else None,
        })
    return rows


def dwa_summary(rows: list[dict], matrix: torch.Tensor, mask: list[list[bool]]) -> dict:
    """The row statistics over all DWAs: means of row sum, X_0 and own weight; the share of
    all weights that are negative, their mean |alpha| and the most negative one."""
    # deferred: pulls in torch (slow to start, or optional)
    import torch

    live = torch.tensor(mask, dtype=torch.bool)
    weights = matrix[live]
    negative = weights[weights < 0]

    def mean(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    return {
        "dwas": len(rows),
        "weights": int(weights.numel()),
        "mean_row_sum": mean([r["row_sum"] for r in rows]),
        "mean_x0": mean([r["x0"] for r in rows]),
        "mean_own": mean([r["own"] for r in rows]),
        "negative_share": negative.numel() / max(1, weights.numel()),
        "negative_mean": float(negative.abs().mean()) if negative.numel() else None,
        "most_negative": float(negative.min()) if negative.numel() else None,
    }


def checkpoint_entry(step: int | None, path: Path, matrix: torch.Tensor,
                     mask: list[list[bool]]) -> dict:
    """One checkpoint's record in dwa_stats.json."""
    rows = dwa_row_stats(matrix, mask)
    return {"step": step, "path": str(path), "matrix": matrix.tolist(), "rows": rows,
            "summary": dwa_summary(rows, matrix, mask)}


def _saved_alpha(path: Path) -> torch.Tensor:
    """The dwa_alpha tensor of a native checkpoint, read without the other weights."""
    # deferred: pulls in torch (slow to start, or optional)
    from pretrain import checkpoint, sharded_checkpoint

    manifest = checkpoint.read_manifest(path)
    checkpoint.require_current_format(path, manifest)
    model_state, _ = sharded_checkpoint.read_full(path, manifest, names=["dwa_alpha"],
                                                  optimizer=False)
    return model_state["dwa_alpha"]


def write_checkpoint_heatmap(path: Path, pattern, directory: Path) -> Path | None:
    """The heatmap of checkpoint `path`'s alphas as directory/step-XXXXXXXX.png, read from
    the files (so any layout, ZeRO-3 included); None for a model without DWA. `pattern`:
    the model's `DWAPattern`. The trainer calls it on rank 0 after each save."""
    # deferred: pulls in torch (slow to start, or optional)
    from pretrain.dwa_plots import heatmap_name, write_dwa_heatmap

    if pattern.period is None:
        return None
    step = _step(path)
    # The raw parameter is zero off the pattern, where the heatmap draws grey anyway.
    return write_dwa_heatmap(_saved_alpha(path), pattern.mask(), step,
                             Path(directory) / heatmap_name(step))


def _step(path: Path) -> int | None:
    if not (path / checkpoint.MANIFEST).is_file():
        return None  # an exported directory
    return int(checkpoint.read_manifest(path)["step"])


def collect(args: argparse.Namespace, model: torch.nn.Module
            ) -> list[tuple[int | None, Path, torch.Tensor]]:
    """[(step, checkpoint path, alpha matrix)] of --checkpoint or --run; `model`: the model
    of --checkpoint or of the run's latest checkpoint."""
    # deferred: pulls in torch (slow to start, or optional)
    import torch

    source = Path(args.run or args.checkpoint)
    if model.dwa_alpha is None:
        raise ConfigError("--run" if args.run else "--checkpoint",
                          f"{source} is a model without DWA (model.dwa: false): no weights "
                          "to analyze")
    if args.checkpoint:
        return [(_step(source), source, model.dwa_matrix())]
    found = []
    for step, path in checkpoint.list_checkpoints(source / "checkpoints"):
        try:
            alpha = _saved_alpha(path)
        except checkpoint.CheckpointError:
            continue  # an incomplete checkpoint (a save that was cut short)
        with torch.no_grad():
            model.dwa_alpha.copy_(alpha)
        found.append((step, path, model.dwa_matrix()))
    return found


def cmd_analyze(args: argparse.Namespace) -> int:
    """Write the heatmap(s), the grid for a run, and dwa_stats.json into --out (for an
    AttnRes model: pretrain/attnres_analysis.py; MUDD: pretrain/mudd_analysis.py; HC or mHC:
    pretrain/hc_analysis.py)."""
    # deferred: pulls in sentencepiece, torch (slow to start, or optional)
    from parallel.primitives import groups
    from pretrain.dwa_plots import heatmap_name, write_dwa_grid, write_dwa_heatmap
    from pretrain.load import load_model

    out = Path(args.out)
    source = Path(args.run or args.checkpoint)
    try:
        model, _ = load_model(source, device="cpu")
        if model.attnres_query is not None:
            # deferred: pulls in torch (slow to start, or optional)
            from pretrain.attnres_analysis import analyze_attnres

            return analyze_attnres(args, model, source, _step)
        if model.mudd_static is not None:
            # deferred: pulls in torch (slow to start, or optional)
            from pretrain.mudd_analysis import analyze_mudd

            return analyze_mudd(args, model, source, _step)
        if model.hc_names:
            # deferred: pulls in torch (slow to start, or optional)
            from pretrain.hc_analysis import analyze_hc

            return analyze_hc(args, model, source, _step)
        found = collect(args, model)
    finally:
        groups.destroy()
    mask = model.dwa_pattern.mask()
    config = model.config
    entries = []
    for step, path, matrix in found:
        name = heatmap_name(step) if step is not None else "exported.png"
        write_dwa_heatmap(matrix, mask, step, out / name)
        entries.append({**checkpoint_entry(step, path, matrix, mask), "heatmap": name})
    if args.run:
        write_dwa_grid([(step, matrix) for step, _, matrix in found], mask, out / GRID_FILE,
                       title=f"DWA weights of {Path(args.run).name}")
    stats = {"source": str(args.run or args.checkpoint),
             "model": {"n_layers": config.n_layers, "dilation": config.dwa_dilation,
                       "period": config.dwa_period, "window": config.dwa_window},
             "mask": mask, "checkpoints": entries}
    (out / STATS_FILE).write_text(json.dumps(stats, indent=1) + "\n")
    print(f"wrote {len(entries)} heatmap(s){' and ' + GRID_FILE if args.run else ''} and "
          f"{STATS_FILE} to {out}")
    return 0
