"""Tensor-parallel helpers that are not megatron-core layers: per-rank dropout streams and
the gradient reduction of replicated parameters under sequence parallelism."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from parallel.primitives.groups import allreduce_in_one_bucket

# Replicated parameters whose gradients are partial under sequence parallelism (each TP rank
# sees only its slice of the sequence) carry this attribute, as in Megatron.
SEQUENCE_PARALLEL_ATTR = "sequence_parallel"


@contextlib.contextmanager
def tp_rank_rng(tp_group, enabled: bool = True):
    """A dropout stream of this TP rank's own, for activations that differ between TP ranks
    (attention heads; sequence shards under SP), as Megatron's model-parallel RNG tracker.

    The seed is drawn from the default generator, which all TP ranks of a data-parallel
    rank share, so they stay in step; the stream then differs by TP rank."""
    if not enabled or tp_group is None or tp_group.size() == 1:
        yield
        return
    seed = int(torch.randint(0, 2**62, (1,)).item()) + 7919 * tp_group.rank()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def mark_sequence_parallel(module: nn.Module) -> None:
    """Tag every replicated (not TP-sharded) parameter of `module` as sequence-parallel."""
    for param in module.parameters():
        if not getattr(param, "tensor_model_parallel", False):
            setattr(param, SEQUENCE_PARALLEL_ATTR, True)


def allreduce_sequence_parallel_grads(model: nn.Module, tp_group) -> None:
    """Sum the partial gradients of replicated parameters over the TP group (one bucket).

    Under sequence parallelism each TP rank computes the gradient of a norm weight, an
    alpha or a gain from its own sequence slice only; the full gradient is their sum."""
    if tp_group is None or tp_group.size() == 1:
        return
    grads = [p.grad for p in model.parameters()
             if getattr(p, SEQUENCE_PARALLEL_ATTR, False) and p.grad is not None]
    allreduce_in_one_bucket(grads, tp_group)
