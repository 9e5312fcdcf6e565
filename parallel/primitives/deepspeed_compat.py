"""The DeepSpeed (0.19.8) internals our ZeRO checkpoints use, all in one place.

DeepSpeed's public state helpers (`safe_get_full_fp32_param`, `safe_get_full_optimizer_state`
and their setters) move a whole parameter: each all-reduces the full tensor over the
data-parallel group, so saving through them puts the whole state on every rank. What a rank
owns is not public API; these functions read it from DeepSpeed's optimizer:

- ZeRO-1/2 (`DeepSpeedZeroOptimizer`): each parameter's `_hp_mapping`, a `tensor_fragment`
  whose `lp_fragment_address` is the (start, numel) of the elements this rank owns in the
  flattened parameter and `hp_fragment_address` where they sit in the rank's flat fp32
  partition of the parameter group (`single_partition_of_fp32_groups[param_group_index]`);
  None if the rank owns none. The AdamW state is `optimizer.state[that partition]`.
- ZeRO-3 (`DeepSpeedZeroOptimizer_Stage3`): `grad_position[get_param_id(param)]` is
  (group, offset in the group's flat fp32 partition `fp32_partitioned_groups_flat[group]`,
  partition size P); the rank owns elements [r P, r P + P) of the flattened parameter
  (r = `_get_param_partition_rank(param)`), the part past `ds_numel` being padding, and
  keeps them in `param.ds_tensor` (the model copy) too; `param.ds_shape` is the full shape.

One function per internal, each saying what it relies on. tests/test_zero_checkpoint.py
pins the version and checks every one against DeepSpeed's public helpers, so an upgrade
that changes them fails a test instead of writing wrong checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TESTED_VERSION = "0.19.8"
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def is_stage3(zero_optimizer) -> bool:
    return hasattr(zero_optimizer, "fp32_partitioned_groups_flat")


def flat_partitions(zero_optimizer) -> list[torch.Tensor]:
    """The rank's flat fp32 master partitions, one per parameter group: the tensors the
    inner AdamW updates and keys its state by (ZeRO-3 puts them into its param groups only
    while stepping)."""
    for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        flats = getattr(zero_optimizer, attr, None)
        if flats is not None:
            return list(flats)
    raise TypeError(f"unknown DeepSpeed ZeRO optimizer {type(zero_optimizer).__name__}")


def update_count(zero_optimizer) -> torch.Tensor | None:
    """AdamW's step count (the same in every group) as a float tensor, None before the
    first update."""
    state = zero_optimizer.optimizer.state
    for flat in flat_partitions(zero_optimizer):
        if "step" in state.get(flat, {}):
            return torch.as_tensor(state[flat]["step"]).detach().cpu().float()
    return None


def create_optimizer_state(zero_optimizer, step: float) -> None:
    """Zero AdamW state at `step` for every flat partition (values are set next)."""
    state = zero_optimizer.optimizer.state
    for flat in flat_partitions(zero_optimizer):
        state[flat] = {"step": torch.tensor(step, dtype=torch.float32),
                       **{key: torch.zeros_like(flat) for key in ADAM_MOMENTS}}
    relink_optimizer_state(zero_optimizer)


def relink_optimizer_state(zero_optimizer) -> None:
    """Point each parameter's ZeRO-1/2 fragment at the current AdamW state tensors.

    DeepSpeed links them once, right after the update of the first parameter group, when
    the other groups have no state yet: with our two weight-decay groups the no-decay
    group's state stays unreachable to `safe_get_full_optimizer_state` (which only the
    full-state helpers of parallel/strategies/zero.py use; `OwnedRange.state` reads the state
    itself). tests/test_zero.py checks that this is still needed."""
    if hasattr(zero_optimizer, "_hp_optimizer_states_linked"):
        zero_optimizer._hp_optimizer_states_linked = False
        zero_optimizer._lazy_init_hp_params_optimizer_state()


@dataclass
class OwnedRange:
    """The elements [start, start + numel) of a flattened (tensor-parallel shard of a)
    parameter that this rank's ZeRO partition holds."""

    start: int
    numel: int
    flat: torch.Tensor  # the group's flat fp32 partition (the AdamW state's key)
    offset: int  # where the range starts in `flat`
    model_copy: torch.Tensor | None  # ZeRO-3: the range in `param.ds_tensor`

    @property
    def master(self) -> torch.Tensor:
        """The fp32 master weights of the range (a view)."""
        return self.flat.narrow(0, self.offset, self.numel)

    def state(self, zero_optimizer, key: str) -> torch.Tensor:
        """AdamW's `key` ("exp_avg", "exp_avg_sq") over the range (a view)."""
        return zero_optimizer.optimizer.state[self.flat][key].narrow(0, self.offset,
                                                                     self.numel)


def owned_range(zero_optimizer, param: torch.nn.Parameter) -> OwnedRange | None:
    """What this rank owns of `param` (module doc), or None."""
    if is_stage3(zero_optimizer):
        group, offset, size = zero_optimizer.grad_position[zero_optimizer.get_param_id(param)]
        start = zero_optimizer._get_param_partition_rank(param) * size
        numel = min(size, param.ds_numel - start)
        if numel <= 0:
            return None
        return OwnedRange(start, numel, zero_optimizer.fp32_partitioned_groups_flat[group],
                          offset, param.ds_tensor.data.narrow(0, 0, numel))
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return None
    return OwnedRange(mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel,
                      flat_partitions(zero_optimizer)[mapping.param_group_index],
                      mapping.hp_fragment_address.start, None)


def local_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    """The shape of this rank's (tensor-parallel shard of the) parameter; ZeRO-3 leaves an
    empty `param.shape` outside its gathering hooks and keeps the real one as `ds_shape`."""
    return tuple(param.ds_shape) if hasattr(param, "ds_shape") else tuple(param.shape)
