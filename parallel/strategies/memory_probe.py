"""What autograd really keeps for one micro-batch: saved-activation bytes, measured.

    report = measure_activations(model, tokens, targets)    # an ActivationReport, bytes
    report = measure_stage(stage, received, loss_fn)        # of one pipeline stage

- `saved_bytes`: every tensor autograd saves for backward during the forward pass, seen by
  a `torch.autograd.graph.saved_tensors_hooks` counter, deduplicated by storage (a view
  counts its whole storage once), parameters and module buffers excluded. Inside a
  checkpointed unit the checkpoint's own hooks take over: those tensors are recomputed, not
  kept, and are not counted.
- `dwa_buffer_bytes`: the stored X_j of the buffered DWA (pretrain/model/dwa.py) and of
  MUDD's mix (pretrain/model/mudd_mix.py, its token-major buffer) live outside autograd, so
  the hooks never see them. They are found by walking the loss's autograd graph (the
  StoreOutput / Combine, Store / Mix nodes hold the buffers of their forward pass) and
  counted explicitly; `stored_outputs` is the number of X_j slots in them.
- the inputs of a checkpointed unit that are not tensors themselves (a tuple of MUDD's
  streams) are kept by the checkpoint outside the hooks' sight: counted in `saved_bytes`.
- `recompute_bytes`: the largest working set of one checkpointed unit, measured by running
  each unit's function once more, outside the checkpoint, under the same counter (its kept
  inputs excluded): what backward holds on top of the kept tensors while it recomputes a unit.
- `total_bytes` = saved + DWA buffers + boundary + recompute: the activation memory of the
  micro-batch.
- `boundary_bytes` (`measure_stage`, a pipeline stage): the received and sent tensors that
  autograd does not save, which the pipeline holds until the stage's backward.
- `autocast_copy_bytes`: under autocast, the low-precision copies of parameters that autocast
  makes (and caches until its region ends), seen as casts of a parameter by a dispatch mode;
  a copy that autograd also saves is counted here, not in `saved_bytes`. 0 without autocast.

Exact on CPU. On a GPU, `torch.cuda.max_memory_allocated` around a step measures the same
thing plus the allocator's rounding and temporary buffers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from parallel.strategies.checkpointing import ActivationCheckpointing
from pretrain.model.dwa import DWABuffers
from pretrain.model.mudd_mix import MuddBuffers


@dataclass
class ActivationReport:
    saved_bytes: int
    dwa_buffer_bytes: int
    stored_outputs: int
    recompute_bytes: int
    largest: list[tuple[int, tuple, str]] = field(default_factory=list, repr=False)
    autocast_copy_bytes: int = 0
    boundary_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.saved_bytes + self.dwa_buffer_bytes + self.boundary_bytes + \
            self.recompute_bytes

    def as_dict(self) -> dict:
        return {"saved_bytes": self.saved_bytes, "dwa_buffer_bytes": self.dwa_buffer_bytes,
                "stored_outputs": self.stored_outputs, "recompute_bytes": self.recompute_bytes,
                "autocast_copy_bytes": self.autocast_copy_bytes,
                "boundary_bytes": self.boundary_bytes, "total_bytes": self.total_bytes}


class SavedTensorCounter:
    """Context manager: bytes of the distinct storages autograd saves, minus `exclude`."""

    def __init__(self, exclude: set[int] = frozenset()):
        self.exclude = set(exclude)
        self.storages: dict[int, tuple[int, tuple, str]] = {}
        self._saved: dict[int, list[weakref.ref]] = {}  # key -> the tensors saved with it

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self.exclude and storage.nbytes():
            if key not in self.storages:
                origin = type(tensor.grad_fn).__name__ if tensor.grad_fn is not None else "leaf"
                self.storages[key] = (storage.nbytes(), tuple(tensor.shape), origin)
            self._saved.setdefault(key, []).append(weakref.ref(tensor))
        return tensor

    def alive(self) -> dict[int, tuple[int, tuple, str]]:
        """The `storages` some node still holds a tensor of: a node whose output was
        dropped in the forward (a result nobody reads) frees what it saved, and its
        storage's address may be reused by a tensor saved later."""
        return {k: v for k, v in self.storages.items()
                if any(ref() is not None for ref in self._saved[k])}

    @property
    def bytes(self) -> int:
        return sum(n for n, _, _ in self.storages.values())

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


class ParameterCasts(TorchDispatchMode):
    """Dispatch mode: the dtype casts of `parameters`. `copies()`: those still alive, by
    storage address, with their bytes: autocast's cached weight copies (a cast made and
    dropped inside the forward, as the chunked loss's of the head weight, is not one)."""

    def __init__(self, parameters: list[torch.Tensor]):
        super().__init__()
        self.sources = {p.untyped_storage().data_ptr() for p in parameters}
        self.casts: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        source = args[0] if args else None
        # Autocast casts whole parameters (never views) to a narrower dtype.
        if func is torch.ops.aten._to_copy.default and isinstance(source, torch.Tensor) \
                and not source._is_view() and out.itemsize < source.itemsize \
                and source.untyped_storage().data_ptr() in self.sources:
            self.casts.append(weakref.ref(out))
        return out

    def copies(self) -> dict[int, int]:
        alive = [ref() for ref in self.casts]
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in alive if t is not None}


def model_storages(model: nn.Module) -> set[int]:
    """Storage addresses of the parameters and buffers of `model` (not activations)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return {t.untyped_storage().data_ptr() for t in tensors}


def _buffer_slots(buffers) -> list[tuple[torch.Tensor, int]]:
    """(tensor, X_j slots) of one forward pass's buffers: the DWA's per residue class
    (slots first), MUDD's one token-major tensor (slots second)."""
    if isinstance(buffers, MuddBuffers):
        return [(buffers.values, buffers.values.shape[1])]
    return [(v, v.shape[0]) for v in buffers.values.values()]


def dwa_buffers_of(output: torch.Tensor) -> list:
    """The DWABuffers and MuddBuffers reachable from `output`'s autograd graph (one per
    forward pass)."""
    found, seen, stack = {}, set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        buffers = getattr(node, "buffers", None)  # custom Function ctx attributes
        if isinstance(buffers, (DWABuffers, MuddBuffers)):
            found[id(buffers)] = buffers
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(found.values())


def measure_activations(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor,
                        loss_fn: Callable | None = None) -> ActivationReport:
    """Forward one micro-batch through `model.loss` (or `loss_fn(tokens, targets)`) and
    report what it keeps (no backward)."""
    exclude = model_storages(model)
    checkpointing = getattr(model, "activation_checkpointing", None)
    recorder: list = []
    with contextlib.ExitStack() as stack:
        if isinstance(checkpointing, ActivationCheckpointing):
            model.activation_checkpointing = dataclasses.replace(checkpointing,
                                                                 recorder=recorder)
            stack.callback(setattr, model, "activation_checkpointing", checkpointing)
        casts = ParameterCasts(list(model.parameters()))
        with SavedTensorCounter(exclude) as counter, casts:
            loss = (loss_fn or model.loss)(tokens, targets)
        buffers = dwa_buffers_of(loss)
        buffer_storages = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
                           for b in buffers for v, _ in _buffer_slots(b)}
        copies = casts.copies()
        saved = {k: v for k, v in counter.storages.items()
                 if k not in buffer_storages and k not in copies}
        for _, inputs in recorder:  # tensors inside a unit's non-tensor inputs (a tuple)
            for k, n in _storages(t for x in inputs if isinstance(x, tuple) for t in x).items():
                if k not in exclude and k not in buffer_storages:
                    saved.setdefault(k, (n, (), "checkpoint input"))
        recompute = _recompute_bytes(recorder, exclude | set(saved) | set(buffer_storages)
                                     | set(copies))
        del loss
    largest = sorted(saved.values(), key=lambda item: -item[0])[:10]
    return ActivationReport(
        saved_bytes=sum(n for n, _, _ in saved.values()),
        dwa_buffer_bytes=sum(buffer_storages.values()),
        stored_outputs=sum(n for b in buffers for _, n in _buffer_slots(b)),
        recompute_bytes=recompute, largest=largest,
        autocast_copy_bytes=sum(copies.values()))


def _recompute_bytes(recorder: list, kept: set[int]) -> int:
    """The largest working set of the recorded (unit, inputs): each run once more under the
    counter, the `kept` storages and its own inputs excluded."""
    recompute = 0
    for unit, inputs in recorder:
        flat = [t for x in inputs for t in (x if isinstance(x, tuple) else (x,))]
        own = {t.untyped_storage().data_ptr() for t in flat if isinstance(t, torch.Tensor)}
        with torch.random.fork_rng(devices=[]), SavedTensorCounter(kept | own) as counter:
            unit(*inputs)
        recompute = max(recompute, counter.bytes)
    return recompute


def _storages(tensors) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
            if isinstance(t, torch.Tensor)}


def measure_stage(stage: nn.Module, received: tuple, loss_fn: Callable | None = None
                  ) -> ActivationReport:
    """Forward one micro-batch through a pipeline stage (parallel/strategies/stage_model.py
    `StageModule`) from the `received` tensors (the tokens on the first stage), then through
    `loss_fn(outputs)` if given (the last stage's loss), and report what it keeps: the saved
    tensors, the received and sent ones that autograd does not save (`boundary_bytes`: the
    schedule holds a stage's inputs and outputs until its backward), and the largest
    checkpointed layer's recomputation; autocast's weight copies apart, as in
    `measure_activations`. MUDD's buffer of the stage's X_j (pretrain/model/mudd_mix.py)
    counts as `dwa_buffer_bytes`, and the streams a checkpointed block keeps in a tuple as
    saved (the DWA's buffers are not looked for: the pipeline estimates them apart)."""
    exclude = model_storages(stage)
    recorder: list = []
    stage.recorder = recorder if stage.activation_checkpointing else None
    casts = ParameterCasts(list(stage.parameters()))
    try:
        with SavedTensorCounter(exclude) as counter, casts:
            outputs = stage(*received)
            loss = loss_fn(outputs) if loss_fn is not None else None
    finally:
        stage.recorder = None
    ends = [t for t in (*outputs, loss) if isinstance(t, torch.Tensor) and t.grad_fn]
    buffers = {id(b): b for t in ends for b in dwa_buffers_of(t)
               if isinstance(b, MuddBuffers)}.values()
    buffer_storages = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
                       for b in buffers for v, _ in _buffer_slots(b)}
    copies = casts.copies()
    saved = {k: v for k, v in counter.alive().items()
             if k not in copies and k not in buffer_storages}
    for _, inputs in recorder:  # tensors inside a layer's non-tensor input (a tuple)
        for k, n in _storages(t for x in inputs if isinstance(x, tuple) for t in x).items():
            if k not in exclude and k not in buffer_storages:
                saved.setdefault(k, (n, (), "checkpoint input"))
    boundary = {k: n for k, n in {**_storages(received), **_storages(outputs)}.items()
                if k not in saved and k not in exclude and k not in copies}
    recompute = _recompute_bytes(recorder, exclude | set(saved) | set(boundary) | set(copies)
                                 | set(buffer_storages))
    del loss
    return ActivationReport(
        saved_bytes=sum(n for n, _, _ in saved.values()),
        dwa_buffer_bytes=sum(buffer_storages.values()),
        stored_outputs=sum(n for b in buffers for _, n in _buffer_slots(b)),
        recompute_bytes=recompute,
        largest=sorted(saved.values(), key=lambda item: -item[0])[:10],
        boundary_bytes=sum(boundary.values()), autocast_copy_bytes=sum(copies.values()))
