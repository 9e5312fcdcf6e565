"""A flat range of a tensor as rectangular blocks of the global tensor, for DCP.

ZeRO partitions each data-parallel rank's optimizer state (and, at stage 3, its parameters)
as one flat range of every tensor it touches: elements [start, start + numel) of the
row-major flattened tensor. Neither DTensor nor DCP's chunks express that directly: a chunk
is a box (offsets, sizes). But a flat range is a union of at most 2 (n - 1) + 1 boxes of an
n-dimensional tensor, in order: for a matrix, a partial first row, the full rows, a partial
last row; for a vector, one box. `flat_range_blocks` computes them; a `FlatShard` hands them
to DCP as chunks of the global tensor (shifted by the tensor-parallel offset of this rank's
shard), so DCP stores them like any shard, checks that the ranks' chunks tile every tensor
without overlap, and reads the overlap of any saved chunk with any requested one: a
checkpoint of flat ranges loads at any layout, and into flat ranges of any other partition.

DCP finds a state-dict entry's chunks through its checkpointable protocol
(`__create_write_items__`, `__create_chunk_list__`, `__get_tensor_shard__`) but looks a
block up by offset only in tensors, so `SavePlanner` and `LoadPlanner` (DCP's default
planners) also look blocks up in FlatShards. tests/test_zero_checkpoint.py checks these
blocks against DCP's own checks (chunks tile each tensor, no overlap).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

Block = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def flat_range_blocks(shape: Sequence[int], start: int, numel: int) -> list[Block]:
    """The boxes that make up elements [start, start + numel) of a row-major tensor of
    `shape`, in flat order; each box is a contiguous part of the range."""
    shape = tuple(shape)
    if numel <= 0:
        return []
    if start < 0 or start + numel > math.prod(shape):
        raise ValueError(f"range [{start}, {start + numel}) outside a tensor of shape {shape}")
    if len(shape) <= 1:
        return [((start,) * len(shape), (numel,) * len(shape))]
    inner, rest = math.prod(shape[1:]), shape[1:]
    end, blocks = start + numel, []
    if start % inner:  # a partial first slab: its own range inside one index of dim 0
        stop = min(end, (start // inner + 1) * inner)
        blocks += [((start // inner, *o), (1, *s))
                   for o, s in flat_range_blocks(rest, start % inner, stop - start)]
        start = stop
    full = (end - start) // inner
    if full:  # whole slabs: one box
        blocks.append(((start // inner, *(0,) * len(rest)), (full, *rest)))
        start += full * inner
    if start < end:  # a partial last slab, from its beginning
        blocks += [((start // inner, *o), (1, *s))
                   for o, s in flat_range_blocks(rest, 0, end - start)]
    return blocks


class Blocks:
    """Boxes of a global tensor with their values, as DCP chunks (DCP's checkpointable
    protocol): `blocks` maps each box's offsets to a tensor of the box's sizes."""

    def __init__(self, blocks: dict[tuple[int, ...], torch.Tensor], global_size: Sequence[int]):
        self.blocks = {torch.Size(offsets): value for offsets, value in blocks.items()}
        self.global_size = torch.Size(global_size)

    def size(self) -> torch.Size:
        """The global tensor's size (DCP checks it against the checkpoint's)."""
        return self.global_size

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.blocks.values())

    def copy_to(self, device: str | torch.device = "cpu", pin_memory: bool = False,
                into: Blocks | None = None) -> Blocks:
        """The same boxes over copies of the values, each in its own storage (so DCP's
        writer does not copy them again); into `into`'s tensors when it has the same boxes
        (an earlier copy: no new memory to allocate, pin and fault in)."""
        copies = {}
        for offsets, value in self.blocks.items():
            copy = None if into is None else into.blocks.get(offsets)
            if copy is None or copy.shape != value.shape or copy.dtype != value.dtype:
                copy = torch.empty(value.shape, dtype=value.dtype, device=device,
                                   pin_memory=pin_memory)
            copies[offsets] = copy.copy_(value.detach(), non_blocking=pin_memory)
        return Blocks(copies, self.global_size)

    # -- DCP's checkpointable protocol ---------------------------------------------------

    def __create_write_items__(self, fqn: str, _object) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=offsets, sizes=value.shape),
                              properties=TensorProperties.create_from_tensor(value),
                              size=self.global_size))
                for offsets, value in self.blocks.items()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=value.shape)
                for offsets, value in self.blocks.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.blocks[torch.Size(index.offset)]


class FlatShard(Blocks):
    """Elements [start, start + data.numel()) of this rank's part of a global tensor.

    `data`: the range's values, 1-D (a view of the optimizer's flat partition, or a buffer
    to load into); `local_shape`: the shape of the tensor the range is flat in (this rank's
    tensor-parallel shard); `shard_offset`: that shard's offset in the global tensor of
    `global_size`. The blocks are views of `data`."""

    def __init__(self, data: torch.Tensor, start: int, local_shape: Sequence[int],
                 global_size: Sequence[int], shard_offset: Sequence[int] | None = None):
        if data.dim() != 1:
            raise ValueError(f"FlatShard data must be 1-D, got shape {tuple(data.shape)}")
        shift = tuple(shard_offset) if shard_offset is not None else (0,) * len(global_size)
        blocks, position = {}, 0
        for offsets, sizes in flat_range_blocks(local_shape, start, data.numel()):
            count = math.prod(sizes)
            shifted = tuple(o + s for o, s in zip(offsets, shift, strict=True))
            blocks[shifted] = data[position: position + count].view(sizes)
            position += count
        super().__init__(blocks, global_size)
        self.data = data


def _lookup(state_dict: dict, index: MetadataIndex):
    value = state_dict.get(index.fqn)
    return value.__get_tensor_shard__(index) if isinstance(value, Blocks) else None


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner; Blocks are found by their offsets."""

    def lookup_object(self, index: MetadataIndex):
        block = _lookup(self.state_dict, index)
        return super().lookup_object(index) if block is None else block


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner; Blocks are found by their offsets. Its
    set-up rewrites the state dict in place, turning objects it does not know into None,
    so Blocks (top-level entries) skip it."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        shards = {k: v for k, v in state_dict.items() if isinstance(v, Blocks)}
        super().set_up_planner({k: v for k, v in state_dict.items() if k not in shards},
                               metadata, is_coordinator)
        self.state_dict.update(shards)
        self.original_state_dict.update(shards)
        if self.flatten_state_dict:
            self.mappings.update({key: (key,) for key in shards})

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        block = _lookup(self.state_dict, index)
        return super().lookup_tensor(index) if block is None else block
