"""What the GPU check's timed sections share: shapes, models, the train step, MFU; and the
memory and compile sections.

Every model of ours comes from a paper config (configs/paper/) through
`pretrain.config.load_config`, with `--set`-style overrides for the tiny CPU shapes, so a change
of the model's config keys shows up here as a config error, not as a silently different model.
Every configuration trains with torch's fused AdamW where this torch supports it on the device
(the JSON says whether), over `pretrain.optim.param_groups`, the paper's hyper-parameters.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from gpu_check_timing import INTERVAL, interleaved, ratio_ci, sync, timer_name
from torch import nn

from pretrain.mfu import spec_peak

ROOT = Path(__file__).resolve().parent.parent

PAPER = {  # name -> paper config
    "transformer": "configs/paper/transformer-48.yaml",
    "dense-1x1": "configs/paper/dense-48-1x1.yaml",
    "dense-4x1": "configs/paper/dense-48-4x1.yaml",
    "dense-4x5": "configs/paper/dense-48-4x5.yaml",
}


@dataclass(frozen=True)
class Shapes:
    """How big the check runs: the paper shape on a GPU, a tiny one on the CPU."""

    overrides: tuple[str, ...]  # applied to every paper config
    batch: int  # sequences per timed step (one micro-batch)
    warmup_steps: int  # untimed steps of each configuration before the rounds
    rounds: int  # interleaved rounds (>= 6 for a 95% interval of a median)
    steps_per_round: int
    memory_batch: int  # micro-batch of the memory section
    copy_bytes: int  # the copy that measures the memory bandwidth
    dtype: torch.dtype


# 12 rounds x 5 steps: 60 timed steps of each configuration.
GPU_SHAPES = Shapes(overrides=(), batch=32, warmup_steps=3, rounds=12, steps_per_round=5,
                    memory_batch=8, copy_bytes=1 << 30, dtype=torch.bfloat16)
# 10 blocks so that the 4x5 model has two DWAs; fp32, as CPU bf16 matmuls are far slower.
CPU_SHAPES = Shapes(overrides=("model.n_layers=10", "model.d_model=64", "model.n_heads=4",
                               "model.vocab_size=512", "model.seq_len=32"),
                    batch=4, warmup_steps=1, rounds=6, steps_per_round=1, memory_batch=2,
                    copy_bytes=64 << 20, dtype=torch.float32)


def load(variant: str, shapes: Shapes, *extra: str):
    """The pretrain.config.Config of a paper variant at the check's shape."""
    from pretrain.config import load_config

    return load_config(ROOT / PAPER[variant], [*shapes.overrides, *extra], world_size=1)


def goal_reason(device: torch.device, shapes: Shapes) -> str | None:
    """Why the issues' goals cannot be judged from this run, or None when they can."""
    if device.type != "cuda" or shapes != GPU_SHAPES:
        return "the goals are for a GPU at the paper shape; this run is not"
    return None


def fused_adamw_supported(device: torch.device) -> bool:
    """Whether this torch runs torch.optim.AdamW(fused=True) on `device` (one tiny step)."""
    p = nn.Parameter(torch.ones(2, device=device))
    p.grad = torch.ones_like(p)
    try:
        torch.optim.AdamW([p], fused=True).step()
    except (RuntimeError, TypeError, ValueError):
        return False
    return True


def adamw(model: nn.Module, optim_cfg, fused: bool) -> torch.optim.AdamW:
    """AdamW over pretrain.optim's weight-decay groups, the config's hyper-parameters."""
    from pretrain.optim import param_groups

    groups = param_groups(model, optim_cfg.weight_decay, optim_cfg.decay_alphas)
    return torch.optim.AdamW(groups, lr=optim_cfg.lr, betas=(optim_cfg.beta1, optim_cfg.beta2),
                             eps=optim_cfg.eps, fused=fused)


def build(cfg, device: torch.device) -> nn.Module:
    """Our model of `cfg` as the trainer builds it for one process."""
    from pretrain.model import DenseFormer

    return DenseFormer(cfg.model, seed=cfg.train.seed).to(device)


def synthetic_batch(cfg, batch: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """Uniform random token ids (B, S + 1): step time does not depend on the text."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.seq_len + 1),
                         generator=gen).to(device)


@dataclass
class Trainee:
    """One timed configuration: a model, its AdamW, its loss on a fixed batch, and what one
    step means (tokens, model FLOPs per token, dtype, clip)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable[[], torch.Tensor]
    flops_per_token: float
    tokens: int
    dtype: torch.dtype
    clip: float
    batch: torch.Tensor | None = None  # the token ids (B, S + 1) the loss reads

    @property
    def inputs_and_targets(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch[:, :-1], self.batch[:, 1:]

    def step(self) -> torch.Tensor:
        """Forward, backward, clip, AdamW: one step as the trainer runs it; no host sync."""
        from pretrain.evaluate import autocast_for

        device = next(self.model.parameters()).device
        with autocast_for(device, self.dtype):
            loss = self.loss()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def ours(cfg, device: torch.device, shapes: Shapes, fused: bool, seed: int = 0) -> Trainee:
    """Our model of `cfg`, fused AdamW, on a synthetic batch."""
    model = build(cfg, device)
    m = cfg.model
    batch = synthetic_batch(cfg, shapes.batch, device, seed)
    return Trainee(model, adamw(model, cfg.optim, fused),
                   lambda: model.loss(batch[:, :-1], batch[:, 1:]), m.flops_per_token(),
                   shapes.batch * m.seq_len, shapes.dtype, cfg.optim.grad_clip, batch)


def anchor(cfg, device: torch.device, shapes: Shapes, fused: bool, dwa: nn.Module | None = None,
           rope: bool = False, seed: int = 0) -> Trainee:
    """benchmarks/nanogpt_anchor.py's AnchorGPT at `cfg`'s shape (with `dwa` or RoPE), fused
    AdamW with our hyper-parameters, on the same synthetic batch as `ours(cfg, ...)`; its
    FLOPs per token are counted as ours of the same shape and pattern."""
    from nanogpt_anchor import AnchorGPT

    m = cfg.model
    model = AnchorGPT(m.n_layers, m.d_model, m.n_heads, m.seq_len, m.vocab_size, dwa,
                      rope=rope).to(device)
    batch = synthetic_batch(cfg, shapes.batch, device, seed)
    return Trainee(model, adamw(model, cfg.optim, fused),
                   lambda: model(batch[:, :-1], batch[:, 1:]), m.flops_per_token(),
                   shapes.batch * m.seq_len, shapes.dtype, cfg.optim.grad_clip, batch)


def peak_flops(device: torch.device, dtype: torch.dtype) -> dict:
    """The MFU denominator: the spec peak of a known GPU (pretrain/mfu.py's table), else the
    measured matmul peak."""
    from pretrain.mfu import measure_matmul_flops

    size = 8192 if device.type == "cuda" else 512
    measured = measure_matmul_flops(device, dtype, size=size, seconds=1.0 if
                                    device.type == "cuda" else 0.3)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    spec = spec_peak(name)
    if device.type == "cuda" and dtype == torch.bfloat16 and spec is not None:
        return {"flops": spec, "source": f"spec: dense bf16 peak of {name}",
                "measured_matmul_flops": measured}
    return {"flops": measured, "source": f"measured {dtype} matmul of {size}^3 on {name} "
            "(no spec peak known for this device and dtype)", "measured_matmul_flops": measured}


def timed_rows(trainees: dict[str, Trainee], device: torch.device, shapes: Shapes,
               peak: dict | None = None) -> tuple[dict, dict]:
    """Time every trainee interleaved; ({name: figures}, {name: per-round step times})."""
    times = interleaved({name: t.step for name, t in trainees.items()}, device,
                        rounds=shapes.rounds, steps=shapes.steps_per_round,
                        warmup=shapes.warmup_steps)
    rows = {}
    for name, t in trainees.items():
        steps = [s for r in times[name] for s in r]
        med = statistics.median(steps)
        rows[name] = {"median_step_s": med, "min_step_s": min(steps),
                      "max_step_s": max(steps), "steps": len(steps),
                      "tokens_per_s": t.tokens / med, "params": sum(
                          p.numel() for p in t.model.parameters()),
                      "last_loss": float(t.step())}
        if peak is not None:
            flops = t.flops_per_token * t.tokens / med
            rows[name].update(model_tflops=flops / 1e12, mfu=flops / peak["flops"],
                              mfu_vs_measured_matmul=flops / peak["measured_matmul_flops"])
    return rows, times


def timing_header(device: torch.device, shapes: Shapes, fused: bool) -> dict:
    """How a timed section ran (the same keys in every one)."""
    return {"timer": timer_name(device), "rounds": shapes.rounds,
            "steps_per_round": shapes.steps_per_round, "warmup_steps": shapes.warmup_steps,
            "batch": shapes.batch, "dtype": str(shapes.dtype).removeprefix("torch."),
            "optimizer": f"torch.optim.AdamW(fused={fused})", "order": "rotated each round",
            "interval": INTERVAL}


def cuda_activation_bytes(model, batch: torch.Tensor, dtype: torch.dtype) -> dict:
    """Bytes one forward + backward adds to what the allocator holds: after the forward
    (what autograd keeps) and at the peak. Gradients are allocated first, so that the
    baseline holds them and the difference is activations plus backward temporaries."""
    from pretrain.evaluate import autocast_for

    device = batch.device
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    with autocast_for(device, dtype):
        loss = model.loss(batch[:, :-1], batch[:, 1:])
    kept = torch.cuda.memory_allocated(device) - base
    loss.backward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    model.zero_grad(set_to_none=True)
    return {"measured_bytes": peak, "after_forward_bytes": kept,
            "method": "torch.cuda.max_memory_allocated over a forward + backward, minus the "
                      "allocation before it (parameters, gradients, optimizer state)"}


def section_memory(device: torch.device, shapes: Shapes) -> dict:
    """parallel.strategies.memory's activation estimate (on a GPU with autocast's weight copies and
    the chunked loss's working set, which the measured peak holds too) against what a
    micro-batch really takes, for `block` and `dwa_block` checkpointing (on the CPU: the
    autograd probe, fp32)."""
    from parallel.strategies.checkpointing import apply_activation_checkpointing
    from parallel.strategies.memory import estimate

    dtypes = ("bf16", "fp32") if device.type == "cuda" else ("fp32",)
    rows = []
    for name in ("dense-1x1", "dense-4x5"):
        cfg = load(name, shapes)
        model = build(cfg, device)
        batch = synthetic_batch(cfg, shapes.memory_batch, device, seed=7)
        for mode in ("block", "dwa_block"):
            apply_activation_checkpointing(model, mode, 1)
            for dtype in dtypes:
                est_cfg = load(name, shapes, f"train.batch_size={shapes.memory_batch}",
                               "parallel.microbatches=1", f"train.dtype={dtype}",
                               f"parallel.activation_checkpointing={mode}")
                est = estimate(est_cfg.parallel, est_cfg.model, est_cfg.train.batch_size,
                               est_cfg.train.dtype, 1, device.type)[0]
                estimated = est.activation_bytes
                if device.type == "cuda":  # the peak holds autocast's copies, the loss's chunk
                    estimated += est.autocast_copies_bytes + est.loss_working_set_bytes
                    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
                    measured = cuda_activation_bytes(model, batch, torch_dtype)
                else:
                    from parallel.strategies.memory_probe import measure_activations

                    report = measure_activations(model, batch[:, :-1], batch[:, 1:])
                    measured = {"measured_bytes": report.total_bytes,
                                "method": "parallel.strategies.memory_probe (saved tensors, fp32)"}
                rows.append({"model": name, "mode": mode, "dtype": dtype,
                             "estimated_bytes": estimated, **measured,
                             "estimate_terms": {
                                 "activation_bytes": est.activation_bytes,
                                 "autocast_copies_bytes": est.autocast_copies_bytes,
                                 "loss_working_set_bytes": est.loss_working_set_bytes},
                             "measured_over_estimated": measured["measured_bytes"] / estimated})
        del model
    return {"micro_batch": shapes.memory_batch, "rows": rows}


def section_compile(device: torch.device, shapes: Shapes, fused: bool) -> dict:
    """Our Transformer and DenseFormer 4x5: eager against every block compiled
    (torch.compile per block, as torchtitan does; the DWAs stay eager), same weights and
    data, interleaved; the speedup (eager / compiled step) as a median with its interval."""
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    trainees, first = {}, {}
    for name in ("transformer", "dense-4x5"):
        cfg = load(name, shapes)
        trainees[f"{name}/eager"] = ours(cfg, device, shapes, fused)
        compiled = trainees[f"{name}/compiled"] = ours(cfg, device, shapes, fused)
        for block in compiled.model.blocks:
            block.compile(backend=backend)
        eager_loss = float(trainees[f"{name}/eager"].step())
        sync(device)
        start = time.perf_counter()
        compiled_loss = float(compiled.step())
        first[name] = {"first_step_s_with_compile": time.perf_counter() - start,
                       "first_loss_abs_diff": abs(eager_loss - compiled_loss)}
    rows, times = timed_rows(trainees, device, shapes)
    speedups = {name: {**first[name], "speedup": ratio_ci(times[f"{name}/eager"],
                                                          times[f"{name}/compiled"])}
                for name in first}
    return {**timing_header(device, shapes, fused), "backend": backend, "rows": rows,
            "models": speedups}
