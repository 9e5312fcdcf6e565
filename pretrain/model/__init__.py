"""DenseFormer model: `from pretrain.model import DenseFormerConfig, DenseFormer`."""

from pretrain.model.config import DenseFormerConfig, ModelConfigError
from pretrain.model.denseformer import DenseFormer

__all__ = ["DenseFormer", "DenseFormerConfig", "ModelConfigError"]
