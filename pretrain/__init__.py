"""DenseFormer pretraining: model, configuration, training loop, checkpoints, tracking.

`pretrain.load_model(path)` returns a trained (model, tokenizer); it is imported on first use,
so that `import pretrain` stays cheap.
"""

import parallel  # noqa: F401  (silences megatron-core's import-time warnings first)

__all__ = ["load_model"]


def __getattr__(name: str):
    if name == "load_model":
        # deferred: pulls in sentencepiece, torch (slow to start, or optional)
        from pretrain.load import load_model

        return load_model
    raise AttributeError(f"module 'pretrain' has no attribute {name!r}")
