"""The alpha matrix of a DWA pattern, shared by the whole model and a pipeline rank's part.

Index conventions as in dwa_pattern.py: one (d, d + 1) matrix, row i - 1 the DWA after block
i, column j the weight on X_j, entries outside the pattern structurally zero. The module
that owns the weights registers the parameter (`dwa_alpha`) and the mask buffer (`dwa_mask`)
under its own names (checkpoints and pretrain/model/init.py know those); `DWAWeights` makes
them and reads them, so `DenseFormer` and `StageModel` (parallel/strategies/stage_model.py) share
this code instead of copying it.
"""

from __future__ import annotations

import torch
from torch import nn

from pretrain.model.dwa_pattern import DWAPattern


class DWAWeights:
    """The alphas of `pattern`: their initial parameter, mask, dense matrix and count."""

    def __init__(self, pattern: DWAPattern):
        self.pattern = pattern

    def new_parameter(self) -> nn.Parameter | None:
        """The full alpha matrix at its initial value; None when no block has a DWA."""
        if not self.pattern.inputs:
            return None
        return nn.Parameter(torch.tensor(self.pattern.initial_alpha(), device="cpu"))

    def new_mask(self) -> torch.Tensor:
        """The pattern's (d, d + 1) live alpha entries as a boolean tensor."""
        return torch.tensor(self.pattern.mask(), dtype=torch.bool, device="cpu")

    def uncounted(self, alpha: torch.Tensor | None) -> int:
        """Entries of the alpha parameter that are not learned connections."""
        return 0 if alpha is None else alpha.numel() - self.pattern.n_connections

    def per_dwa(self, alpha: torch.Tensor | None):
        """(i, alpha[i, j] for j in S_i) for every DWA, detached."""
        for i, js in self.pattern.inputs.items():
            yield i, alpha[i - 1, list(js)].detach()

    def matrix(self, alpha: torch.Tensor | None) -> torch.Tensor:
        """alpha as a dense (d, d + 1) float tensor; identity rows for blocks without DWA."""
        d = self.pattern.n_layers
        matrix = torch.zeros(d, d + 1)
        if alpha is not None:
            matrix.copy_(alpha.detach().float().cpu())
        for i in range(1, d + 1):
            if not self.pattern.has_dwa(i):
                matrix[i - 1, i] = 1.0
        return matrix

    @torch.no_grad()
    def load(self, alpha: torch.Tensor | None, mask: torch.Tensor,
             matrix: torch.Tensor) -> None:
        """Set `alpha` from a dense (d, d + 1) matrix; raise if it leaves the pattern."""
        d, pattern = self.pattern.n_layers, self.pattern
        matrix = torch.as_tensor(matrix, dtype=torch.float32)
        if matrix.shape != (d, d + 1):
            raise ValueError(f"DWA matrix must have shape {(d, d + 1)}, got {tuple(matrix.shape)}")
        live = mask.cpu()
        expected_fixed = self.matrix(alpha) * ~live
        outside = (matrix * ~live - expected_fixed).abs() > 0
        if outside.any():
            i, j = outside.nonzero()[0].tolist()
            raise ValueError(
                f"DWA matrix puts weight {matrix[i, j].item():g} at row {i} (block {i + 1}), "
                f"column {j} (X_{j}), outside the {pattern.dilation}x{pattern.period} pattern")
        if alpha is not None:
            alpha.copy_(matrix * live)
