"""Parallelism: `primitives/` (below the model: groups, layout, TP helpers, library compat),
`strategies/` (applied to the model from outside: pipeline, DDP, ZeRO, checkpointing,
compile, memory estimates) and `cli/` (their command lines)."""

import warnings

# megatron-core warns at import that Transformer Engine / Apex are absent (we use neither),
# and on each TP matmul about CUDA_DEVICE_MAX_CONNECTIONS (we set it, see primitives/groups.py;
# on CPU it means nothing); torch deprecates the collective names megatron-core 0.16 calls.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS")
warnings.filterwarnings("ignore", message=r".*`torch\.distributed\.(reduce_scatter_tensor|"
                        r"all_gather_into_tensor)` is deprecated")
