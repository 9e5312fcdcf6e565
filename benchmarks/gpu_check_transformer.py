"""The GPU check's `transformer` part (with gpu_check_perf.section_compile): our Transformer
against the nanoGPT-style anchors, and where one step's time goes.

- transformer: ours, `anchor-rope` (the anchor with RoPE in plain ops: our architecture) and
  `anchor` (learned positions), benchmarks/nanogpt_anchor.py, all eager, bf16 autocast, fused
  AdamW, interleaved (gpu_check_timing.py): tokens/s, MFU, and our tokens/s over each
  anchor's (their step over ours, per round) as a median with its interval; issue 31's
  goal: >= 1.00 against anchor-rope.
- profile: one step of each under torch.profiler after two warm-up steps: the 15 kernels
  with the most self device time (on the CPU: the 15 ops with the most self CPU time), the
  kernel count and total, and the whole table in OUT/profile_<name>.txt.
"""

from __future__ import annotations

from pathlib import Path

import gpu_check_perf as perf
import torch
from gpu_check_timing import ratio_ci, sync, verdict

ANCHOR_GOAL = 1.00  # our tokens/s over anchor-rope's (issue 31)
TOP_KERNELS = 15


def trainees(device: torch.device, shapes: perf.Shapes, fused: bool) -> dict:
    """{name: builder of its Trainee}: ours and the two anchors, at the paper Transformer."""
    cfg = perf.load("transformer", shapes)
    return {"transformer": lambda: perf.ours(cfg, device, shapes, fused),
            "anchor-rope": lambda: perf.anchor(cfg, device, shapes, fused, rope=True),
            "anchor": lambda: perf.anchor(cfg, device, shapes, fused)}


def section_transformer(device: torch.device, shapes: perf.Shapes, fused: bool) -> dict:
    """Step figures of the three and our tokens/s over each anchor's (module docstring)."""
    built = {name: make() for name, make in trainees(device, shapes, fused).items()}
    peak = perf.peak_flops(device, shapes.dtype)
    figures, times = perf.timed_rows(built, device, shapes, peak)
    for name in ("anchor-rope", "anchor"):
        figures["transformer"][f"tokens_per_s_vs_{name}"] = ratio_ci(times[name],
                                                                     times["transformer"])
    goal = {"measure": "our Transformer's tokens/s / anchor-rope's", "row": "transformer",
            **verdict(figures["transformer"]["tokens_per_s_vs_anchor-rope"], ANCHOR_GOAL,
                      ">=", perf.goal_reason(device, shapes))}
    return {**perf.timing_header(device, shapes, fused), "peak": peak, "rows": figures,
            "goals": [goal]}


def _self_time_us(event, device: torch.device) -> float:
    if device.type == "cuda":  # self_cuda_time_total before torch 2.4
        return getattr(event, "self_device_time_total", None) or getattr(
            event, "self_cuda_time_total", 0)
    return event.self_cpu_time_total


def profile_step(trainee: perf.Trainee, device: torch.device, name: str, out: Path) -> dict:
    """Top kernels (or CPU ops) of one profiled step of `trainee` (module docstring)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        trainee.step()
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        trainee.step()
        sync(device)
    events = prof.key_averages()
    # Device events are kernels, memcpys and memsets, and the GPU spans of user annotations
    # (e.g. Optimizer.step), which cover kernels already counted: those are left out.
    kernels = [e for e in events if e.device_type == DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]
    kind = "kernels" if kernels else "ops"
    ranked = sorted(kernels or events, key=lambda e: _self_time_us(e, device), reverse=True)
    sort_by = "self_cpu_time_total" if device.type != "cuda" else (
        "self_device_time_total" if hasattr(events[0], "self_device_time_total")
        else "self_cuda_time_total")
    (out / f"profile_{name}.txt").write_text(events.table(sort_by=sort_by, row_limit=60,
                                                          max_name_column_width=90))
    return {"ranked": kind, "by": "self device time" if device.type == "cuda" else
            "self CPU time", "count": sum(e.count for e in kernels or events),
            "total_ms": sum(_self_time_us(e, device) for e in kernels or events) / 1e3,
            "top": [{"name": e.key, "self_ms": _self_time_us(e, device) / 1e3,
                     "calls": e.count} for e in ranked[:TOP_KERNELS]],
            "table": f"profile_{name}.txt"}


def section_profile(device: torch.device, shapes: perf.Shapes, fused: bool, out: Path) -> dict:
    """One profiled step of each of the three, built one at a time."""
    result = {}
    for name, make in trainees(device, shapes, fused).items():
        result[name] = profile_step(make(), device, name, out)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"steps_profiled": 1, "warmup_steps": 2, "models": result}
