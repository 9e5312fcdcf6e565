"""Heatmaps of a DenseFormer's DWA weights, as the paper draws them.

Index conventions (docs/design.md#index-conventions): the alpha matrix is (d, d + 1); row
i - 1 is the DWA after block i, column j multiplies X_j (X_0 the embedding output). Entries
outside the k x p pattern are not weights at all and are drawn grey; the weights use a
diverging colour map centred at 0 (red positive, blue negative) with a scale symmetric about 0.

    write_dwa_heatmap(model.dwa_matrix(), model.dwa_pattern.mask(), step, out / "step.png")

matplotlib is imported inside the functions (Agg canvas, no display needed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

CMAP = "RdBu_r"
ANNOTATE_UP_TO = 12  # write each weight in its cell for models of at most this many blocks


def heatmap_name(step: int) -> str:
    """step-XXXXXXXX.png: the file (and MLflow artifact `dwa/<name>`) of one step's heatmap."""
    return f"step-{step:08d}.png"


def write_dwa_heatmap(matrix: torch.Tensor | Sequence, mask: Sequence[Sequence[bool]],
                      step: int | None, path: str | Path, title: str | None = None) -> Path:
    """Draw one (d, d + 1) alpha matrix (entries where `mask` is False greyed) into the PNG
    `path` (parent directories created); the path."""
    figure, axes = _figure(1)
    limit = _limit([matrix], mask)
    image = _draw(axes[0], matrix, mask, limit)
    axes[0].set_title(title or (f"DWA weights, step {step}" if step is not None
                                else "DWA weights"))
    figure.colorbar(image, ax=axes[0], label="alpha[i, j]")
    return _save(figure, path)


def write_dwa_grid(matrices: Sequence[tuple[int | None, torch.Tensor]],
                   mask: Sequence[Sequence[bool]], path: str | Path,
                   title: str | None = None) -> Path:
    """Draw the alpha matrices of several steps side by side, one colour scale for all,
    into the PNG `path`; the path."""
    if not matrices:
        raise ValueError("no DWA matrices to draw")
    figure, axes = _figure(len(matrices))
    limit = _limit([m for _, m in matrices], mask)
    for ax, (step, matrix) in zip(axes, matrices, strict=False):
        image = _draw(ax, matrix, mask, limit)
        ax.set_title(f"step {step}" if step is not None else "exported")
    for ax in axes[len(matrices):]:
        ax.set_visible(False)
    figure.colorbar(image, ax=list(axes), label="alpha[i, j]")
    if title:
        figure.suptitle(title)
    return _save(figure, path)


def _figure(panels: int):
    # deferred: pulls in matplotlib (slow to start, or optional)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    columns = min(panels, 4)
    rows = math.ceil(panels / columns)
    figure = Figure(figsize=(4.6 * columns + 1.2, 4.2 * rows), dpi=100,
                    layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, columns, squeeze=False).ravel().tolist()
    return figure, axes


def _limit(matrices: Sequence, mask: Sequence[Sequence[bool]]) -> float:
    """The colour scale's half-width: the largest |alpha| on the pattern (at least 1e-6)."""
    live = torch.tensor(mask, dtype=torch.bool)
    biggest = max(torch.as_tensor(m, dtype=torch.float32)[live].abs().max().item()
                  if live.any() else 0.0 for m in matrices)
    return max(biggest, 1e-6)


def _draw(ax, matrix, mask: Sequence[Sequence[bool]], limit: float):
    # deferred: pulls in matplotlib (slow to start, or optional)
    from matplotlib import colormaps

    values = torch.as_tensor(matrix, dtype=torch.float32).numpy()
    hidden = ~np.array(mask, dtype=bool)
    cmap = colormaps[CMAP].with_extremes(bad="#d9d9d9")  # grey: not a weight
    image = ax.imshow(np.ma.masked_array(values, hidden), cmap=cmap, vmin=-limit, vmax=limit,
                      aspect="equal", interpolation="nearest")
    d = values.shape[0]
    ax.set_xlabel("input X_j")
    ax.set_ylabel("DWA after block i")
    step = max(1, d // 12)
    ax.set_xticks(range(0, d + 1, step), [str(j) for j in range(0, d + 1, step)])
    ax.set_yticks(range(0, d, step), [str(i + 1) for i in range(0, d, step)])
    if d <= ANNOTATE_UP_TO:
        for i in range(d):
            for j in range(d + 1):
                if not hidden[i, j]:
                    ax.text(j, i, f"{values[i, j]:.2f}", ha="center", va="center",
                            fontsize=7, color="white" if abs(values[i, j]) > 0.6 * limit
                            else "black")
    return image


def _save(figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path
