"""Parallelism: process groups, tensor/pipeline parallel pieces, ZeRO, checkpointing."""

import warnings

# megatron-core warns at import that Transformer Engine / Apex are absent; we use neither.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
