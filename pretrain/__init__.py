"""DenseFormer pretraining: model, configuration, training loop, checkpoints, tracking."""

import parallel  # noqa: F401  (silences megatron-core's import-time warnings first)
