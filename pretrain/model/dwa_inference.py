"""The DWA state of a cached forward (pretrain/generation.py drives it): the connection
states that `DenseFormer.forward_cached` runs its block program with (pretrain/model/program.py).

A DWA mixes block outputs of the same token, so a cached forward over new tokens needs only
those tokens' X_j, never past tokens' (their keys and values are in the KV cache).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pretrain.model.dwa import stream_precision
from pretrain.model.dwa_impl import dwa_ops
from pretrain.model.dwa_pattern import DWAPattern


def _whole_dwa(pattern: DWAPattern, source) -> int:
    """The consumer of a `dwa` source that reads all of S_i (what a whole model's program
    has); a cached forward runs no other kind."""
    if source.kind != "dwa" or source.base or source.terms != pattern.inputs[source.index]:
        raise ValueError(f"a cached forward runs whole DWAs only, not {source}")
    return source.index

class PrefillDWAState:
    """The X_j of a cached forward over many tokens (a prompt), each dropped as soon as the
    last DWA that reads it (`DWAPattern.last_reader`) has run, so that no block output is
    kept longer than the pattern needs. `weights[i]`: alpha[i, j] for j in S_i, as floats.
    The X_j are kept in `storage_dtype` (None: as given), as training stores them."""

    def __init__(self, pattern: DWAPattern, weights: Mapping[int, list[float]],
                 storage_dtype: torch.dtype | None = None):
        self.pattern, self.weights, self.storage_dtype = pattern, weights, storage_dtype
        self.kept: dict[int, torch.Tensor] = {}
        self.peak = 0  # the most X_j held at once, for tests

    def keep(self, j: int, x: torch.Tensor) -> None:
        if j in self.pattern.slot:
            self.kept[j] = x if self.storage_dtype is None else x.to(self.storage_dtype)
            self.peak = max(self.peak, len(self.kept))

    def combine(self, i: int, live: torch.Tensor) -> torch.Tensor:
        """Y_i, summed in place into a new tensor (no stacked copy of the X_j); the diagonal
        term takes `live`, X_i as the block gave it."""
        js = self.pattern.inputs[i]
        xs = [live if j == i else self.kept[j] for j in js]
        with stream_precision(live):
            y = xs[0].to(live.dtype) * self.weights[i][0]
            for x, w in zip(xs[1:], self.weights[i][1:], strict=True):
                y.add_(x, alpha=w)  # in the stream's dtype, whatever x's
        for j in js:
            if self.pattern.last_reader[j] == i:
                del self.kept[j]
        return y

    def hold(self, j: int, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        self.keep(j, x)
        return x, None  # the X_j live here, dropped by `combine`

    def mix(self, source, handles: list, live: torch.Tensor | None) -> torch.Tensor:
        return self.combine(_whole_dwa(self.pattern, source), live)


class DecodeDWAState:
    """The DWA state of one decoding step: per residue class a buffer (n_r, B, 1, H) of the
    current tokens' X_j that later DWAs of the step read, in `DWAPattern.slot` order, written
    again every step; so it holds exactly `len(pattern.stored)` tensors of one token per
    sequence, in `storage_dtype` (None: `like`'s). `weights[i]`: alpha[i, j] for j in S_i
    as a tensor, made once."""

    def __init__(self, pattern: DWAPattern, weights: Mapping[int, torch.Tensor],
                 like: torch.Tensor, storage_dtype: torch.dtype | None = None,
                 impl: str = "auto"):
        self.pattern = pattern
        self.ops = dwa_ops(impl, like.device)
        dtype = storage_dtype or like.dtype
        self.values = {r: like.new_empty((n, *like.shape), dtype=dtype)
                       for r, n in pattern.class_sizes.items()}
        self.weights = {i: w.to(like.dtype) for i, w in weights.items()}

    @property
    def num_tensors(self) -> int:
        return sum(v.shape[0] for v in self.values.values())

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.values.values())

    def keep(self, j: int, x: torch.Tensor) -> None:
        slot = self.pattern.slot.get(j)
        if slot is not None:
            self.values[slot[0]][slot[1]].copy_(x)

    def combine(self, i: int, live: torch.Tensor) -> torch.Tensor:
        """Y_i: one matrix-vector product over the slice of its class (the diagonal term
        from `live` when the slice is stored in another dtype)."""
        r, start, stop = self.pattern.reads[i]
        narrow = self.values[r].dtype != live.dtype
        values = self.values[r]
        with stream_precision(values):
            y = self.ops.weighted_rows(values[start:stop - narrow].flatten(1), self.weights[i],
                                       live if narrow else None)
            return y.view(values.shape[1:])

    def hold(self, j: int, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        self.keep(j, x)
        return x, None

    def mix(self, source, handles: list, live: torch.Tensor | None) -> torch.Tensor:
        return self.combine(_whole_dwa(self.pattern, source), live)
