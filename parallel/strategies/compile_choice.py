"""`train.compile: auto`: which torch.compile mode (parallel/strategies/compile.py) a run gets.

On an H200 (2026-12-04) compiling every block took our Transformer from 24% to 33% MFU at
micro-batch 64; compiling the whole loss also fuses the embedding, the final norm and the
head with the blocks. So on CUDA:

- the whole model (`model`) for a Transformer without pipeline stages;
- every block (`blocks`) with pipeline stages, whose schedule runs each stage itself;
- every block for a DenseFormer: its buffered DWAs (pretrain/model/dwa.py, on the Triton
  kernels where `model.dwa_impl` picks them) run between the compiled blocks. The whole-model
  mode would run the functional DWA instead (the custom op of pretrain/model/dwa_op.py),
  which moves more bytes (1,272 + 3,770 hidden-size tensors forward + backward against
  1,370 + 1,419 for 1x1 at 48 blocks, docs/design.md). Which is faster on a GPU is for
  `gpu_check --only dwa_compiled` to measure; until it does, blocks.
- the whole model for Attention Residuals without pipeline stages: their mixes are custom
  autograd functions that trace into the one graph without a break (tests/test_compile.py),
  so the mixes fuse with the norms and branches around them; `blocks` would compile only the
  branches and leave every mix eager. Not yet timed on a GPU against `blocks`.

- none for MUDD (pretrain/model/mudd_mix.py): its mixes write into buffers in custom
  autograd functions; `train.compile` other than none or auto is refused for it.

On a CPU: none (compilation takes longer than the short runs made there save). With ZeRO-3:
none, as any compiled mode is refused there (DeepSpeed gathers parameters in module hooks).
"""

from __future__ import annotations

from parallel.strategies.config import ParallelSection
from pretrain.model.config import DenseFormerConfig

AUTO = "auto"


def compile_mode(setting: str, parallel: ParallelSection, model: DenseFormerConfig,
                 device_type: str) -> tuple[str, str]:
    """(mode, why) for `setting` (train.compile) with this parallel section and model on
    `device_type` ("cuda" or "cpu"): the setting itself unless it is auto."""
    if setting != AUTO:
        return setting, "train.compile"
    p, m = parallel, model
    if device_type != "cuda":
        return "none", f"train.compile=auto on {device_type}"
    if p.zero_stage >= 3:
        return "none", "train.compile=auto with ZeRO-3, which refuses compiled modules"
    if m.mudd_layout is not None:
        return "none", "train.compile=auto for MUDD (its buffered mixes run eagerly)"
    if p.pp > 1:
        return "blocks", "train.compile=auto with pipeline stages"
    if m.has_dwa:
        return "blocks", "train.compile=auto for a DenseFormer (its buffered DWAs stay eager)"
    if m.hc_layout is not None:
        return "model", ("train.compile=auto for Hyper-Connections without pipeline stages "
                         "(the mixes trace into the one graph)")
    if m.attnres_layout is not None:
        return "model", ("train.compile=auto for Attention Residuals without pipeline stages "
                         "(the mixes trace into the one graph)")
    return "model", "train.compile=auto for a Transformer without pipeline stages"
