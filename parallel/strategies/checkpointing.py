"""Activation checkpointing for DenseFormer, accounting for the stored block outputs X_j.

    apply_activation_checkpointing(model, "dwa_block", every=1)   # or "block", "none"

Modes (`parallel.activation_checkpointing`, units of `parallel.checkpoint_every` = n blocks):

- `none`: autograd keeps every block's internals, plus the X_j that later DWAs read (in the
  DWA buffers of pretrain/model/dwa.py).
- `block`: each unit of n consecutive blocks is recomputed in backward; its input is kept
  (Y_{a-1}, the output of the DWA before it, or X_{a-1}). With DWAs this keeps each Y_i next
  to the X_j in the buffers.
- `dwa_block`: a unit is "the DWA after block a-1 + blocks a..a+n-1", so Y_{a-1} is
  recomputed from the stored X_j (a cheap weighted sum) and never kept. The X_j that later
  DWAs read live once, in the buffers; a unit input that no DWA reads (X_{a-1} of a block
  without a DWA before it) is the only other thing a unit keeps. Each X_j is stored exactly
  once: it is both a DWA input and a checkpoint boundary.

Checkpoints are non-reentrant (torch.utils.checkpoint, use_reentrant=False): the forward graph
is the real one and the saved tensors inside a unit are recomputed on demand, with the RNG
state replayed (same dropout masks). The recomputation writes identical values into the DWA
buffers again, which dwa.py allows. The loss and every gradient equal those of `none`
(tests/test_checkpointing.py), with TP, sequence parallelism and ZeRO.

The buffered DWA (`Combine`) takes the StoreOutput results only to order autograd. A
checkpoint keeps its inputs alive, so a unit given X_j itself would hold a second copy of
it; units get `after(X_j)` instead: a 0-element tensor whose backward runs after the unit's
and before X_j's producer's, holding nothing.

Under pipeline parallelism the stages run their own block loop (parallel/strategies/stage_model.py);
there `block` with n = 1 is available and the other modes are refused by config validation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from pretrain.model.dwa import BufferedDWA, depth_weighted_average, storage_dtype

MODES = ("none", "block", "dwa_block")


class _After(torch.autograd.Function):
    """A 0-element tensor ordered after x in autograd (no gradient flows, nothing kept)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None


def after(x: torch.Tensor) -> torch.Tensor:
    """A stand-in for X_j as an autograd dependency that does not keep X_j alive."""
    return _After.apply(x)


@dataclass(frozen=True)
class ActivationCheckpointing:
    """How `DenseFormer.run_blocks` runs its blocks: units of `every` blocks, per `mode`."""

    mode: str
    every: int = 1
    # When a list, each unit's (function, inputs) is appended to it: the activation-memory
    # probe (parallel/strategies/memory_probe.py) replays units to measure their recompute
    # working set.
    recorder: list | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"activation checkpointing mode must be one of {MODES}, "
                             f"got {self.mode!r}")
        if self.every < 1:
            raise ValueError(f"checkpoint units need every >= 1 block, got {self.every}")

    def units(self, n_layers: int) -> list[tuple[int, int]]:
        """(first, last) block of each checkpoint unit, blocks numbered 1..d."""
        return [(a, min(a + self.every - 1, n_layers))
                for a in range(1, n_layers + 1, self.every)]

    def run_blocks(self, model, x0: torch.Tensor, functional: bool) -> torch.Tensor:
        """Y_d from X_0 as `DenseFormer.run_blocks`, the blocks run in checkpointed units."""
        runner = _UnitRunner(model, x0, functional, self.mode == "dwa_block", self.recorder)
        return runner.run(self.units(model.config.n_layers))


class _UnitRunner:
    """One forward pass through checkpointed units (state: the buffers and the handles)."""

    def __init__(self, model, x0: torch.Tensor, functional: bool, lead_dwa: bool,
                 recorder: list | None = None):
        self.model = model
        self.recorder = recorder
        self.plan = plan = model.dwa_pattern  # pretrain/model/dwa_pattern.py
        self.lead_dwa = lead_dwa
        self.storage = storage_dtype(model.config.dwa_dtype)
        self.impl = model.config.dwa_impl
        self.buffered = None if functional or not plan.slot else BufferedDWA(
            plan.layout, model.dwa_alpha, x0, self.storage, self.impl)
        # j -> autograd handle of an X_j that a later DWA reads: after(X_j) when buffered
        # (X_j itself is in the buffer), else the tensor X_j.
        self.handles: dict[int, torch.Tensor] = {}
        self.x0 = self.keep(0, x0, self.handles)

    # -- pieces shared by the units and the loop ----------------------------------------

    def keep(self, j: int, x: torch.Tensor, handles: dict) -> torch.Tensor:
        if j in self.plan.slot:
            if self.buffered is None:
                handles[j] = x
            else:
                x = self.buffered.store(j, x)
                handles[j] = after(x)
        return x

    def dwa(self, i: int, alpha: torch.Tensor, handles: dict,
            live: torch.Tensor | None = None) -> torch.Tensor:
        """Y_i = sum over S_i of alpha[i, j] X_j (`live`: X_i, where the pass holds it; a
        recomputed leading DWA reads it from its buffer)."""
        deps = [handles[j] for j in self.plan.inputs[i]]
        if self.buffered is None:  # the handles are the X_j themselves
            return depth_weighted_average(alpha[self.plan.layout.weights_index[i]], deps,
                                          self.storage, diagonal=True, impl=self.impl)
        return self.buffered.combine(i, deps, live)

    def read_stored(self, j: int, handle: torch.Tensor) -> torch.Tensor:
        """A fresh copy of the buffered X_j (its gradient goes to the gradient buffer)."""
        return self.buffered.read_stored(j, handle)

    def recomputes_entry(self, a: int) -> bool:
        """Whether the unit starting at block a recomputes its input Y_{a-1} itself."""
        j = a - 1
        return self.lead_dwa and (j in self.plan.inputs
                                  or (self.buffered is not None and j in self.plan.slot))

    # -- the loop ------------------------------------------------------------------------

    def run(self, units: list[tuple[int, int]]) -> torch.Tensor:
        alpha, plan = self.model.dwa_alpha, self.plan
        x = self.x0
        for a, b in units:
            if self.recomputes_entry(a):
                entry = None
            elif a - 1 in plan.inputs:
                entry = self.dwa(a - 1, alpha, self.handles, x)  # kept as the unit's input
            else:
                entry = x
            reads = self._reads_before(a, b)
            produced = [i for i in range(a, b + 1) if i in plan.slot]
            unit, inputs = self._unit_fn(a, b, reads, produced), (
                entry, alpha, *[self.handles[j] for j in reads])
            if self.recorder is not None:
                self.recorder.append((unit, inputs))
            outputs = checkpoint(unit, *inputs, use_reentrant=False)
            x = outputs[0]
            self.handles.update(zip(produced, outputs[1:], strict=True))
        d = self.model.config.n_layers
        return self.dwa(d, alpha, self.handles, x) if d in plan.inputs else x

    def _reads_before(self, a: int, b: int) -> list[int]:
        """The X_j (j < a) that the DWAs computed inside unit [a, b] read."""
        inside = [i for i in range(a - 1, b) if i in self.plan.inputs]
        if not self.recomputes_entry(a):
            inside = [i for i in inside if i >= a]
        reads = {j for i in inside for j in self.plan.inputs[i]}
        if self.recomputes_entry(a) and a - 1 not in self.plan.inputs:
            reads.add(a - 1)  # read back from its buffer
        return sorted(j for j in reads if j < a)

    def _unit_fn(self, a: int, b: int, reads: list[int], produced: list[int]):
        def unit(entry, alpha, *read_handles):
            handles = dict(zip(reads, read_handles, strict=True))
            if entry is not None:
                y = entry
            elif a - 1 in self.plan.inputs:
                y = self.dwa(a - 1, alpha, handles)
            else:
                y = self.read_stored(a - 1, handles[a - 1])
            for i in range(a, b + 1):
                x = self.keep(i, self.model.blocks[i - 1](y), handles)
                if i < b:
                    y = self.dwa(i, alpha, handles, x) if i in self.plan.inputs else x
            return (x, *[handles[i] for i in produced])

        return unit


def apply_activation_checkpointing(model, mode: str, every: int = 1) -> None:
    """Make `model.run_blocks` (a DenseFormer) checkpoint as `mode`; "none" undoes it."""
    model.activation_checkpointing = (None if mode == "none"
                                      else ActivationCheckpointing(mode, every))
