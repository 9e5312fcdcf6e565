"""ZeRO state in and out of sharded checkpoints: each rank its own partition, no gather.

Under ZeRO a data-parallel rank holds, of each (tensor-parallel shard of a) parameter, one
flat range of the fp32 master weights and of AdamW's moments
(parallel/primitives/deepspeed_compat.py says which). Saving hands DCP those ranges as
FlatShards (pretrain/flat_shards.py: at most three row-blocks of a matrix, with global
offsets) under the same global keys as every other engine (`model.<name>`,
`optim.<name>.<key>`, pretrain/sharded_checkpoint.py): the ranges of the DP ranks tile each
tensor, DCP checks that they do, and a checkpoint written at one ZeRO
stage and DP size reads back at any other, or without ZeRO, and a ZeRO-1 one at any TP x PP.

What each rank writes: its ranges of the parameters it owns, where a parameter held by
several ranks is owned once: a tensor-parallel replica (norms, alphas) by TP rank 0, a
pipeline copy (the tied embedding on the last stage, alphas past the first) by the stage the
pipeline marks as its owner. AdamW's `step` (0-dim, the same everywhere) goes with them.

Loading reads what each rank holds: ZeRO-1/2 keep the whole (TP-shard of each) parameter on
every rank for the forward, so those are read whole, and the master weights of the rank's
ranges are set from them; ZeRO-3 reads only its ranges (model copy and master alike); the
AdamW moments are always read as ranges.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from parallel.primitives.deepspeed_compat import (
    ADAM_MOMENTS,
    OwnedRange,
    create_optimizer_state,
    is_stage3,
    local_shape,
    owned_range,
    update_count,
)
from pretrain.checkpoint import CheckpointError
from pretrain.flat_shards import FlatShard
from pretrain.model.init import local_shard
from pretrain.sharded_checkpoint import (
    empty_like_global,
    load_tensors,
    local_part,
    missing_fill,
    model_key,
    optim_entries,
    optim_key,
    raise_agreed,
    read_metadata,
    tensor_entries,
    tp_mesh,
)


def _tp(model: nn.Module) -> tuple[int, int]:
    return getattr(model, "tp_rank", 0), getattr(model, "tp_size", 1)


def _placement(param: nn.Parameter, tp_rank: int, tp_size: int):
    """(local shape, global shape, offset of the local shard in the global tensor)."""
    shape = local_shape(param)
    full, offset = list(shape), [0] * len(shape)
    if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
        full[param.partition_dim] *= tp_size
        offset[param.partition_dim] = tp_rank * shape[param.partition_dim]
    return shape, tuple(full), tuple(offset)


def _writes(param: nn.Parameter, tp_rank: int) -> bool:
    """Whether this rank owns `param` among the ranks holding a copy (module doc)."""
    if getattr(param, "pipeline_duplicate", False):
        return False
    return getattr(param, "tensor_model_parallel", False) or tp_rank == 0


def _shard(values: torch.Tensor, owned: OwnedRange, placement) -> FlatShard:
    shape, full, offset = placement
    return FlatShard(values, owned.start, shape, full, offset)


def local_state(zero) -> dict:
    """This rank's ZeRO ranges under the global keys (FlatShards of views: no copy)."""
    optimizer, model = zero.engine.optimizer, zero.model
    tp_rank, tp_size = _tp(model)
    step = update_count(optimizer)
    state = {}
    for name, param in model.named_parameters():
        if not _writes(param, tp_rank):
            continue
        if step is not None:  # on every DP rank, like any replicated tensor
            state[optim_key(name, "step")] = step
        owned = owned_range(optimizer, param)
        if owned is None:
            continue
        placement = _placement(param, tp_rank, tp_size)
        state[model_key(name)] = _shard(owned.master, owned, placement)
        if step is not None:
            for key in ADAM_MOMENTS:
                state[optim_key(name, key)] = _shard(owned.state(optimizer, key), owned,
                                                     placement)
    return state


def load_local(checkpoint: Path, manifest: dict, zero, weights_only: bool = False,
               fill: Mapping[str, torch.Tensor] | None = None) -> None:
    """Read this rank's part of a checkpoint of any engine and layout into the ZeRO engine
    (collective); `weights_only`: leave the optimizer fresh; `fill`: full values of the
    parameters the checkpoint lacks."""
    optimizer, model = zero.engine.optimizer, zero.model
    stage3 = is_stage3(optimizer)
    tp_rank, tp_size = _tp(model)
    mesh = None if stage3 else tp_mesh(model)
    entries = tensor_entries(read_metadata(checkpoint, manifest))
    params = dict(model.named_parameters())
    fill = missing_fill(fill, params, entries)
    owned = {name: owned_range(optimizer, param) for name, param in params.items()}
    target, with_state, problem = {}, [], None
    try:
        for name, param in params.items():
            if name in fill:
                continue
            key, placement = model_key(name), _placement(param, tp_rank, tp_size)
            _check_size(checkpoint, key, entries, placement[1])
            if not stage3:  # ZeRO-1/2: every rank runs the forward with the whole parameter
                target[key] = empty_like_global(param, entries[key], mesh, key, checkpoint)
            elif owned[name] is not None:
                target[key] = _shard(torch.empty(owned[name].numel), owned[name], placement)
            saved = {} if weights_only else optim_entries(entries, name)
            if not saved:
                continue
            missing = [k for k in ("step", *ADAM_MOMENTS) if k not in saved]
            if missing:
                raise CheckpointError(f"{checkpoint}: holds no {optim_key(name, missing[0])}")
            target[optim_key(name, "step")] = torch.empty(())
            with_state.append(name)
            for moment in ADAM_MOMENTS:
                _check_size(checkpoint, optim_key(name, moment), entries, placement[1])
                if owned[name] is not None:
                    target[optim_key(name, moment)] = _shard(
                        torch.empty(owned[name].numel), owned[name], placement)
    except CheckpointError as err:
        problem = str(err)
    raise_agreed(problem)
    load_tensors(checkpoint, target, no_dist=not dist.is_initialized())
    with torch.no_grad():
        for name, param in params.items():
            value, whole = _loaded_weights(name, param, target, fill, stage3, tp_rank, tp_size)
            _set_weights(param, owned[name], value, whole, stage3)
        _set_moments(optimizer, params, owned, with_state, target, checkpoint)


def _check_size(checkpoint: Path, key: str, entries: dict, expected) -> None:
    if key not in entries:
        raise CheckpointError(f"{checkpoint}: holds no {key}" if key.startswith("optim.")
                              else f"{checkpoint}: holds no parameter {key[6:]!r}")
    if tuple(entries[key].size) != tuple(expected):
        raise CheckpointError(f"{checkpoint}: {key} has shape {tuple(entries[key].size)}, "
                              f"this model needs {tuple(expected)}")


def _loaded_weights(name, param, target, fill, stage3: bool, tp_rank: int, tp_size: int):
    """(values read for `param`, whether they are its whole TP shard): the whole shard
    (ZeRO-1/2, or a filled parameter), the flat range this rank owns (ZeRO-3), or None."""
    if name in fill:
        return local_shard(fill[name], param, tp_rank, tp_size), True
    value = target.get(model_key(name))
    if value is None:
        return None, False
    return (value.data, False) if stage3 else (local_part(value), True)


def _set_weights(param: nn.Parameter, owned: OwnedRange | None, value, whole: bool,
                 stage3: bool) -> None:
    """The model copy and the fp32 master of `param` from `value` (`_loaded_weights`)."""
    if value is None:
        return
    if whole and not stage3:  # ZeRO-1/2 hold the whole parameter
        param.data.copy_(value.view(param.shape))
    if owned is None:
        return
    part = value.reshape(-1).narrow(0, owned.start, owned.numel) if whole else value
    owned.master.copy_(part)
    if owned.model_copy is not None:  # ZeRO-3's partitioned model copy
        owned.model_copy.copy_(part)


def _set_moments(optimizer, params, owned, with_state, target, checkpoint) -> None:
    """AdamW state of every flat partition, from the ranges read (none: stays fresh)."""
    if not with_state:
        return
    steps = {float(target[optim_key(name, "step")]) for name in with_state}
    if len(steps) != 1:
        raise CheckpointError(f"{checkpoint}: parameters have different AdamW step counts "
                              f"{sorted(steps)}")
    create_optimizer_state(optimizer, steps.pop())
    for name in with_state:
        if owned[name] is None:
            continue
        for moment in ADAM_MOMENTS:
            owned[name].state(optimizer, moment).copy_(target[optim_key(name, moment)].data)
