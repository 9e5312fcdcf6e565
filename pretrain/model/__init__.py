"""DenseFormer model: `from pretrain.model import DenseFormerConfig, DenseFormer`.

`DenseFormer` is imported lazily: it pulls in megatron-core (seconds), which config-only
users (config validation, `python -m pretrain config`, the memory estimator) do not need.
"""

from pretrain.model.config import DenseFormerConfig, ModelConfigError

__all__ = ["DenseFormer", "DenseFormerConfig", "ModelConfigError"]


def __getattr__(name: str):
    if name == "DenseFormer":
        # deferred: pulls in megatron-core, torch (slow to start, or optional)
        from pretrain.model.denseformer import DenseFormer

        return DenseFormer
    raise AttributeError(f"module 'pretrain.model' has no attribute {name!r}")
