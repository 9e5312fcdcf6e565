"""`train.compile`: torch.compile applied to the model the engine trains.

- `blocks`: every transformer block is compiled in place (`nn.Module.compile`, so parameter
  names and checkpoints do not change), as torchtitan does: one graph per block shape,
  reused by all blocks; the DWAs, the embedding and the head stay eager. Works inside
  pipeline stages and under activation checkpointing (the checkpoint wraps the compiled
  block). Attention Residuals run each block as its two branches with a mix before each
  (pretrain/model/program.py `attention_branch`, `mlp_branch`), which a block's own compiled
  call would never see: those two methods are compiled too (one graph each), the mixes stay
  eager.
- `model`: the whole loss (embedding, blocks, DWAs, head, cross entropy) as one graph per
  micro-batch shape. Under the compiler the model takes the functional DWA
  (`pretrain.model.denseformer.DenseFormer.run_blocks`, pretrain/model/dwa_op.py: with the
  Triton kernels the custom op `denseformer::dwa_sum`, one graph node per DWA; with torch
  its products traced; no graph break either way) instead of the eager buffered one, whose
  custom autograd functions write into preallocated buffers. Attention Residuals' mixes
  (the custom autograd functions of pretrain/model/attnres_mix.py) trace into the same
  graph, with no graph break (`fullgraph=True` holds, tests/test_compile.py). Not with
  pipeline stages (the schedule runs each stage).

Both refuse ZeRO-3 before launch (pretrain/config/validation.py). Tensor-parallel
collectives (megatron-core's, through torch.distributed) split the graph where they are,
which costs graph breaks, not correctness; parallel/primitives/megatron_compat.py removes the one
megatron-core call that dynamo cannot trace (`warnings.warn` in RowParallelLinear).
Compilation happens at the first step (tens of seconds on CPU with inductor).
"""

from __future__ import annotations

import torch
from torch import nn


def apply_compile(model: nn.Module, mode: str, backend: str) -> None:
    """Compile `model`'s blocks (`blocks`) or its `loss` (`model`) in place; `none`: nothing.
    `model` is a DenseFormer or a pipeline StageModel (blocks only)."""
    if mode == "none":
        return
    if mode == "blocks":
        blocks = model.blocks.values() if isinstance(model.blocks, nn.ModuleDict) \
            else model.blocks
        for block in blocks:
            block.compile(backend=backend)
            # Instance attributes shadow the methods; parameter names do not change.
            block.attention_branch = torch.compile(block.attention_branch, backend=backend)
            block.mlp_branch = torch.compile(block.mlp_branch, backend=backend)
    elif mode == "model":
        model.loss = torch.compile(model.loss, backend=backend)
    else:
        raise ValueError(f"train.compile must be none, blocks or model, got {mode!r}")
