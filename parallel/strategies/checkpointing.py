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

A unit is a slice of the model's block program (pretrain/model/program.py): the steps of
blocks a..b, run by the same interpreter (`ProgramRun`) as the whole forward, with the same
connection state, whose `hold` hands out `after(X_j)` instead of X_j here. Held X_j are
named by the index of the step output that makes them: a block's (X_i) or, under Attention
Residuals, a sub-layer's (X_1..X_2d), and a unit also receives the residual its steps add
when that was made before it (the open group's partial sum).

Attention Residuals (pretrain/model/attnres.py): `dwa_block` makes a unit "the mix into
sub-layer 2a - 1 + blocks a..b", recomputing that mix from the held X_j, so the only things
kept are the X_j that cross unit boundaries (each once) and the output mix's per-token
state; `block` also keeps each unit's entry. Each unit runs on a connection state `within`
its own consumers, so the phase-1 prefixes it makes are read inside it only and made again
when it is recomputed; outside the units the mixes run one consumer at a time
(docs/memory.md#attention-residuals).

Hyper-Connections (pretrain/model/hc.py): the unit's input and output are the n-stream state
(X_{2a-2} in, X_{2b} out), in every mode; the mix into the unit's first sub-layer and its
write are one step, so a unit always recomputes that mix from the state (`block` and
`dwa_block` are the same). Under
pipeline parallelism each stage runs its own slice of the program
(parallel/strategies/stage_model.py); there `block` with n = 1 is available and the other
modes are refused by config validation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from pretrain.model.attnres import AttnResConnections
from pretrain.model.dwa import BufferedDWA
from pretrain.model.hc import HCConnections
from pretrain.model.program import ProgramRun, StageProgram

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


class _HandedAfter:
    """A buffered connection state whose `hold` hands the readers of X_j `after(X_j)`: the
    value lives in the buffer, and a unit that reads X_j must not keep a second copy."""

    def __init__(self, buffered: BufferedDWA):
        self.buffered = buffered

    def hold(self, j: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, _ = self.buffered.hold(j, x)
        return x, after(x)

    def mix(self, source, handles: list, live: torch.Tensor | None) -> torch.Tensor:
        return self.buffered.mix(source, handles, live)

    def read_stored(self, j: int, handle: torch.Tensor) -> torch.Tensor:
        return self.buffered.read_stored(j, handle)


class _UnitRunner:
    """One forward pass through checkpointed units: a run of the model's program, each
    unit a slice of its steps run in a `ProgramRun` of its own inside the checkpoint."""

    def __init__(self, model, x0: torch.Tensor, functional: bool, lead_dwa: bool,
                 recorder: list | None = None):
        self.model, self.recorder, self.lead_dwa = model, recorder, lead_dwa
        self.program: StageProgram = model.program
        connections = model.training_connections(x0, functional)
        self.buffered = isinstance(connections, BufferedDWA)
        self.hc = isinstance(connections, HCConnections)
        self.connections = _HandedAfter(connections) if self.buffered else connections
        outer = self.connections
        if isinstance(connections, AttnResConnections):  # one consumer at a time outside units
            outer = connections.within(0)
        self.outer = ProgramRun(self.program, model.block, outer)
        self.outer.receive({0: x0})

    def recomputes_entry(self, start: int) -> bool:
        """Whether the unit whose first step is `start` recomputes that step's input (a
        DWA from the held X_j, or an X_j read back from its buffer) instead of keeping it."""
        src = self.program.steps[start].input
        if self.hc:  # the mix and the write of one step run in the same unit
            return True
        return self.lead_dwa and (src.kind not in ("x", "h") or (
            self.buffered and src.kind == "x" and src.index in self.program.held))

    def run(self, units: list[tuple[int, int]]) -> torch.Tensor:
        program = self.program
        for a, b in units:
            start, stop = program.block_steps[a][0], program.block_steps[b][1]
            recompute = self.recomputes_entry(start)
            reads = self._reads(start, stop, recompute)
            held = [self.outer.held[j] for j in reads]  # before `form` drops the entry's
            entry = None if recompute else self.outer.form(start)
            # The X_j made in the unit (by output index: a block's, or a sub-layer's under
            # Attention Residuals) that a source after it reads.
            made = [step.output[1] for step in program.steps[start:stop]
                    if step.output[0] == "x"]
            produced = [j for j in made if any(j in js for js in program.reads[stop:])]
            unit = self._unit_fn(start, stop, reads, produced)
            inputs = (entry, *held)
            if self.recorder is not None:
                self.recorder.append((unit, inputs))
            outputs = checkpoint(unit, *inputs, use_reentrant=False)
            self.outer.skip(start, stop, outputs[0], dict(zip(produced, outputs[1:],
                                                              strict=True)))
        return self.outer.outputs()[0]

    def _reads(self, start: int, stop: int, recompute: bool) -> list[int]:
        """The held X_j made before the unit that its sources read (the first step's input
        only when the unit recomputes it), and the residuals its steps add."""
        steps = self.program.steps
        first = steps[start]
        made_before = first.output[1]  # X_j with a smaller index: a block's or a sub-layer's
        reads = {j for n in range(start + (not recompute), stop)
                 for j in self.program.reads[n] if j < made_before}
        reads |= {s.residual for s in steps[start:stop]
                  if s.residual is not None and s.residual < made_before}
        if recompute and first.input.kind == "x":
            reads.add(first.input.index)  # read back from its buffer
        return sorted(reads)

    def _unit_fn(self, start: int, stop: int, reads: list[int], produced: list[int]):
        attnres = isinstance(self.connections, AttnResConnections)
        last_consumer = self.program.steps[stop - 1].input.index

        def unit(entry, *read_handles):
            # A fresh AttnRes state per call (the forward, its recomputation), whose prefix
            # spans end with the unit: none is read outside it, none survives a call.
            connections = self.connections.within(last_consumer) if attnres \
                else self.connections
            run = ProgramRun(self.program, self.model.block, connections)
            run.held.update(zip(reads, read_handles, strict=True))
            src = self.program.steps[start].input
            if entry is None and src.kind == "x":
                entry = self.connections.read_stored(src.index, run.held[src.index])
            x = run.run(start, stop, entry)
            return (x, *[run.held[i] for i in produced])

        return unit


def apply_activation_checkpointing(model, mode: str, every: int = 1) -> None:
    """Make `model.run_blocks` (a DenseFormer) checkpoint as `mode`; "none" undoes it."""
    model.activation_checkpointing = (None if mode == "none"
                                      else ActivationCheckpointing(mode, every))
