"""Sections of the GPU check that measure: step time and MFU, memory, compile on vs off.

Used by benchmarks/gpu_check.py (which documents the JSON it writes). Every model comes from
a paper config (configs/paper/) through `pretrain.config.load_config`, with `--set`-style
overrides for the tiny CPU shapes, so a change of the model's config keys shows up here as a
config error, not as a silently different model.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pretrain.mfu import spec_peak

ROOT = Path(__file__).resolve().parent.parent

VARIANTS = {  # name -> paper config
    "transformer": "configs/paper/transformer-48.yaml",
    "dense-4x5": "configs/paper/dense-48-4x5.yaml",
    "dense-1x1": "configs/paper/dense-48-1x1.yaml",
}


@dataclass(frozen=True)
class Shapes:
    """How big the check runs: the paper shape on a GPU, a tiny one on the CPU."""

    overrides: tuple[str, ...]  # applied to every paper config
    batch: int  # sequences per timed step (one micro-batch)
    warmup_steps: int
    rounds: int  # interleaved rounds; each runs steps_per_round steps of every variant
    steps_per_round: int
    memory_batch: int  # micro-batch of the memory section
    compile_steps: int  # timed steps per round in the compile section
    dtype: torch.dtype


GPU_SHAPES = Shapes(overrides=(), batch=32, warmup_steps=3, rounds=6, steps_per_round=5,
                    memory_batch=8, compile_steps=5, dtype=torch.bfloat16)
# 10 blocks so that the 4x5 model has two DWAs; fp32, as CPU bf16 matmuls are far slower.
CPU_SHAPES = Shapes(overrides=("model.n_layers=10", "model.d_model=64", "model.n_heads=4",
                               "model.vocab_size=512", "model.seq_len=32"),
                    batch=4, warmup_steps=1, rounds=3, steps_per_round=2, memory_batch=2,
                    compile_steps=2, dtype=torch.float32)


def load(variant: str, shapes: Shapes, *extra: str):
    """The pretrain.config.Config of a paper variant at the check's shape."""
    from pretrain.config import load_config

    return load_config(ROOT / VARIANTS[variant], [*shapes.overrides, *extra], world_size=1)


def build(cfg, device: torch.device):
    """(model, optimizer) as the trainer builds them for one process."""
    from pretrain.model import DenseFormer
    from pretrain.optim import build_optimizer

    model = DenseFormer(cfg.model, seed=cfg.train.seed).to(device)
    return model, build_optimizer(model, cfg.optim)


def synthetic_batch(cfg, batch: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """Uniform random token ids (B, S + 1): step time does not depend on the text."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.seq_len + 1),
                         generator=gen).to(device)


def train_step(model, optimizer, batch: torch.Tensor, dtype: torch.dtype, clip: float) -> float:
    """Forward, backward, clip, AdamW: one step as the trainer runs it (one micro-batch)."""
    from pretrain.evaluate import autocast_for

    with autocast_for(batch.device, dtype):
        loss = model.loss(batch[:, :-1], batch[:, 1:])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    """Wall seconds of fn(), the device's queue drained before and after."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


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


def section_speed(device: torch.device, shapes: Shapes, models: dict) -> dict:
    """Paper-shape Transformer, DenseFormer 4x5 and 1x1, interleaved round-robin (the order
    reversed every other round, so drift hits each alike): medians, tokens/s, MFU, ratios."""
    runs = {}
    for name in VARIANTS:
        cfg = load(name, shapes)
        models[name] = (cfg, *build(cfg, device))
        runs[name] = []
    peak = peak_flops(device, shapes.dtype)
    batches = {name: synthetic_batch(cfg, shapes.batch, device, seed=i)
               for i, (name, (cfg, _, _)) in enumerate(models.items())}
    losses = {}

    def step(name):
        cfg, model, opt = models[name]
        losses[name] = train_step(model, opt, batches[name], shapes.dtype, cfg.optim.grad_clip)

    for name in VARIANTS:  # allocator, cuBLAS handles, optimizer state
        for _ in range(shapes.warmup_steps):
            timed(lambda n=name: step(n), device)
    for r in range(shapes.rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        for name in order:
            for _ in range(shapes.steps_per_round):
                runs[name].append(timed(lambda n=name: step(n), device))
    base = statistics.median(runs["transformer"])
    variants = {}
    for name, times in runs.items():
        cfg = models[name][0]
        med = statistics.median(times)
        tokens = shapes.batch * cfg.model.seq_len
        flops = cfg.model.flops_per_token() * tokens / med
        variants[name] = {
            "median_step_s": med, "min_step_s": min(times), "max_step_s": max(times),
            "steps": len(times), "tokens_per_s": tokens / med, "model_tflops": flops / 1e12,
            "mfu": flops / peak["flops"], "mfu_vs_measured_matmul":
                flops / peak["measured_matmul_flops"],
            "vs_transformer": med / base, "params": models[name][1].num_params(),
            "last_loss": float(losses[name])}
    m = models["transformer"][0].model
    return {"shape": {"n_layers": m.n_layers, "d_model": m.d_model, "n_heads": m.n_heads,
                      "seq_len": m.seq_len, "vocab_size": m.vocab_size, "batch": shapes.batch},
            "dtype": str(shapes.dtype).removeprefix("torch."), "peak": peak,
            "rounds": shapes.rounds, "steps_per_round": shapes.steps_per_round,
            "variants": variants}


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


def section_memory(device: torch.device, shapes: Shapes, models: dict) -> dict:
    """parallel.memory's activation estimate against what a micro-batch really takes, for
    `block` and `dwa_block` checkpointing (on the CPU: the autograd probe, fp32)."""
    from parallel.checkpointing import apply_activation_checkpointing
    from parallel.memory import estimate

    dtypes = ("bf16", "fp32") if device.type == "cuda" else ("fp32",)
    rows = []
    for name in ("dense-1x1", "dense-4x5"):
        if name not in models:
            cfg = load(name, shapes)
            models[name] = (cfg, *build(cfg, device))
        cfg, model, _ = models[name]
        batch = synthetic_batch(cfg, shapes.memory_batch, device, seed=7)
        for mode in ("block", "dwa_block"):
            apply_activation_checkpointing(model, mode, 1)
            for dtype in dtypes:
                est_cfg = load(name, shapes, f"train.batch_size={shapes.memory_batch}",
                               "parallel.microbatches=1", f"train.dtype={dtype}",
                               f"parallel.activation_checkpointing={mode}")
                estimated = estimate(est_cfg, 1, device=device.type)[0].activation_bytes
                if device.type == "cuda":
                    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
                    measured = cuda_activation_bytes(model, batch, torch_dtype)
                else:
                    from parallel.memory_probe import measure_activations

                    report = measure_activations(model, batch[:, :-1], batch[:, 1:])
                    measured = {"measured_bytes": report.total_bytes,
                                "method": "parallel.memory_probe (saved tensors, fp32)"}
                # autocast keeps a bf16 copy of each matmul weight for backward: not a term
                # of the estimate, so it is listed beside it.
                copies = 2 * sum(p.numel() for p in model.parameters() if p.ndim >= 2) \
                    if dtype == "bf16" else 0
                rows.append({"model": name, "mode": mode, "dtype": dtype,
                             "estimated_bytes": estimated, **measured,
                             "autocast_weight_copies_bytes": copies,
                             "measured_over_estimated": measured["measured_bytes"] / estimated})
        apply_activation_checkpointing(model, "none")
    return {"micro_batch": shapes.memory_batch, "rows": rows}


def section_compile(device: torch.device, shapes: Shapes) -> dict:
    """DenseFormer 4x5: eager against every block compiled (torch.compile per block, as
    torchtitan does; the DWAs stay eager), same weights and data, interleaved rounds."""
    cfg = load("dense-4x5", shapes)
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    eager, compiled = build(cfg, device), build(cfg, device)
    for block in compiled[0].blocks:
        block.compile(backend=backend)
    batch = synthetic_batch(cfg, shapes.batch, device, seed=11)
    clip = cfg.optim.grad_clip
    first = {}
    first["eager"] = float(train_step(*eager, batch, shapes.dtype, clip))
    compile_s = timed(lambda: first.__setitem__(
        "compiled", float(train_step(*compiled, batch, shapes.dtype, clip))), device)
    times = {"eager": [], "compiled": []}
    for r in range(3):
        for name in (("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")):
            model, opt = eager if name == "eager" else compiled
            for _ in range(shapes.compile_steps):
                times[name].append(timed(lambda m=model, o=opt: train_step(
                    m, o, batch, shapes.dtype, clip), device))
    eager_s, compiled_s = (statistics.median(times[k]) for k in ("eager", "compiled"))
    return {"model": "dense-4x5", "backend": backend, "batch": shapes.batch,
            "dtype": str(shapes.dtype).removeprefix("torch."),
            "first_step_s_with_compile": compile_s, "eager_median_step_s": eager_s,
            "compiled_median_step_s": compiled_s, "speedup": eager_s / compiled_s,
            "steps": len(times["eager"]),
            "first_loss_abs_diff": abs(first["eager"] - first["compiled"])}
