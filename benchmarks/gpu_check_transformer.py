"""The GPU check's `transformer` part (with gpu_check_perf.section_compile): the scoreboard of
our Transformer against the nanoGPT-style anchors, and where one step's time goes.

- transformer (the scoreboard): at micro-batches 32 x 256, 128 x 256 and 32 x 1024 (batch x
  sequence; the paper Transformer, 48 x 768, vocabulary 50304, bf16 autocast, fused AdamW),
  ours, `anchor-rope` (the anchor with RoPE in plain ops: our architecture) and `anchor`
  (learned positions), benchmarks/nanogpt_anchor.py, first all eager, then all compiled
  (ours as `train.compile: auto` picks on a GPU, parallel/strategies/compile_choice.py; each anchor
  whole), each trio interleaved (gpu_check_timing.py): tokens/s, MFU against the spec peak
  and against the measured matmul peak, our tokens/s over each anchor's (their step over
  ours, per round) as a median with its interval, the first compiled step's time; and our
  activation memory at each shape, measured (torch.cuda.max_memory_allocated over a forward
  and backward, parameters, gradients and AdamW state excluded) against the estimate
  (parallel/strategies/memory.py: activations, autocast's weight copies, the chunked loss's working
  set). A shape is skipped (`skipped_shapes`) when the time left (SCOREBOARD_BUDGET_S) is
  less than the last shape's compilation (its first compiled steps) plus the rest of its
  time scaled by the tokens. Goals (issue 34): ours over
  anchor-rope >= 1.00 at each shape, eager and compiled (6); MFU >= 45% at the paper
  sequence's best micro-batch, compiled; MFU >= 35% at 32 x 256, compiled; the memory
  estimate within 10% at each shape (3).
- profile: one step of each under torch.profiler after two warm-up steps: the 15 kernels
  with the most self device time (on the CPU: the 15 ops with the most self CPU time), the
  kernel count and total, and the whole table in OUT/profile_<name>.txt.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import gpu_check_perf as perf
import torch
from gpu_check_timing import median_ci, ratio_ci, round_means, sync, verdict

ANCHOR_GOAL = 1.00  # our tokens/s over anchor-rope's
MFU_BEST_GOAL = 0.45  # paper sequence, best micro-batch, compiled
MFU_32_GOAL = 0.35  # 32 x 256, compiled
MEMORY_GOAL = 0.10  # |measured / estimated - 1|
TOP_KERNELS = 15
GPU_SCOREBOARD = ((32, 256), (128, 256), (32, 1024))  # (sequences, sequence length)
CPU_SCOREBOARD = ((4, 32), (8, 32), (4, 64))
SCOREBOARD_BUDGET_S = {"cuda": 170.0, "cpu": 60.0}
# Fewer steps than the other timed sections: three shapes, two modes each.
GPU_SCOREBOARD_TIMING = {"rounds": 8, "steps_per_round": 3, "warmup_steps": 2}


def trainees(device: torch.device, shapes: perf.Shapes, fused: bool, *extra: str) -> dict:
    """{name: builder of its Trainee}: ours and the two anchors, at the paper Transformer."""
    cfg = perf.load("transformer", shapes, *extra)
    return {"transformer": lambda: perf.ours(cfg, device, shapes, fused),
            "anchor-rope": lambda: perf.anchor(cfg, device, shapes, fused, rope=True),
            "anchor": lambda: perf.anchor(cfg, device, shapes, fused)}


def compiled(trainee: perf.Trainee, name: str, cfg, backend: str) -> perf.Trainee:
    """`trainee` compiled: ours as train.compile=auto picks on a GPU, an anchor whole."""
    from parallel.strategies.compile import apply_compile
    from parallel.strategies.compile_choice import compile_mode

    if name == "transformer":
        mode = compile_mode(cfg.train.compile, cfg.parallel, cfg.model, "cuda")[0]
        apply_compile(trainee.model, mode, backend)
        model = trainee.model
        trainee.loss = lambda: model.loss(*trainee.inputs_and_targets)
    else:
        whole = torch.compile(trainee.model, backend=backend)
        trainee.loss = lambda: whole(*trainee.inputs_and_targets)
    return trainee


def shape_overrides(batch: int, seq: int) -> tuple[str, ...]:
    return (f"model.seq_len={seq}", f"train.batch_size={batch}", "parallel.microbatches=1")


def run_shape(device, shapes: perf.Shapes, fused: bool, peak: dict, batch: int,
              seq: int) -> dict:
    """Eager, then compiled, rows of the three at one micro-batch shape, and our memory."""
    extra = shape_overrides(batch, seq)
    cfg = perf.load("transformer", shapes, *extra)
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    result = {"batch": batch, "seq": seq, "tokens": batch * seq}
    for mode in ("eager", "compiled"):
        built = {name: make() for name, make in trainees(device, shapes, fused,
                                                           *extra).items()}
        first = {}
        if mode == "compiled":
            for name, trainee in built.items():
                compiled(trainee, name, cfg, backend)
                sync(device)
                start = time.perf_counter()
                trainee.step()
                sync(device)
                first[name] = time.perf_counter() - start
        else:
            result["memory"] = memory_row(built["transformer"], device, shapes, extra)
        rows, times = perf.timed_rows(built, device, shapes, peak)
        for name in ("anchor-rope", "anchor"):
            rows["transformer"][f"tokens_per_s_vs_{name}"] = ratio_ci(times[name],
                                                                      times["transformer"])
        for name, t in built.items():
            rows[name]["mfu_per_round"] = median_ci([
                t.flops_per_token * t.tokens / s / peak["flops"]
                for s in round_means(times[name])])
            if first:
                rows[name]["first_step_s_with_compile"] = first[name]
        result[mode] = rows
        del built
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def memory_row(trainee: perf.Trainee, device, shapes: perf.Shapes, extra) -> dict:
    """Our activation memory at this shape against the estimate (module docstring)."""
    from parallel.strategies.memory import estimate

    dtype = "bf16" if shapes.dtype == torch.bfloat16 else "fp32"
    cfg = perf.load("transformer", shapes, *extra, f"train.dtype={dtype}")
    est = estimate(cfg.parallel, cfg.model, cfg.train.batch_size, cfg.train.dtype, 1,
                   device.type)[0]
    terms = {"activation_bytes": est.activation_bytes,
             "autocast_copies_bytes": est.autocast_copies_bytes,
             "loss_working_set_bytes": est.loss_working_set_bytes}
    if device.type == "cuda":
        estimated = sum(terms.values())
        measured = perf.cuda_activation_bytes(trainee.model, trainee.batch, shapes.dtype)
    else:  # the CPU probe sees what autograd keeps: the activation term
        from parallel.strategies.memory_probe import measure_activations

        estimated = est.activation_bytes
        report = measure_activations(trainee.model, *trainee.inputs_and_targets)
        measured = {"measured_bytes": report.total_bytes,
                    "method": "parallel.strategies.memory_probe (saved tensors, fp32)"}
    return {"dtype": dtype, "estimated_bytes": estimated, "estimate_terms": terms, **measured,
            "measured_over_estimated": measured["measured_bytes"] / estimated}


def section_transformer(device: torch.device, shapes: perf.Shapes, fused: bool) -> dict:
    """The scoreboard (module docstring): every shape that the time allows, and the goals."""
    reason = perf.goal_reason(device, shapes)
    timing = GPU_SCOREBOARD_TIMING if device.type == "cuda" else {}
    shapes = dataclasses.replace(shapes, **timing)
    scoreboard = GPU_SCOREBOARD if device.type == "cuda" else CPU_SCOREBOARD
    peak = perf.peak_flops(device, shapes.dtype)
    deadline = time.monotonic() + SCOREBOARD_BUDGET_S[device.type]
    results, skipped, last = {}, [], None  # last: (compile s, other s, tokens)
    for batch, seq in scoreboard:
        name = f"{batch}x{seq}"
        left = deadline - time.monotonic()
        if last is not None and left < last[0] + last[1] * batch * seq / last[2]:
            skipped.append(name)
            continue
        start = time.monotonic()
        result = results[name] = run_shape(device, dataclasses.replace(shapes, batch=batch),
                                           fused, peak, batch, seq)
        compile_s = sum(row["first_step_s_with_compile"]
                        for row in result["compiled"].values())
        last = (compile_s, time.monotonic() - start - compile_s, batch * seq)
    return {**perf.timing_header(device, shapes, fused), "peak": peak, "shapes": results,
            "skipped_shapes": skipped, "budget_s": SCOREBOARD_BUDGET_S[device.type],
            "goals": scoreboard_goals(results, scoreboard, reason)}


def scoreboard_goals(results: dict, scoreboard, reason: str | None) -> list[dict]:
    """The 11 goals (module docstring), null where a shape did not run or `reason` says the
    run cannot judge them."""
    names = [f"{b}x{s}" for b, s in scoreboard]
    paper_seq = scoreboard[0][1]
    goals = []
    for name in names:
        for mode in ("eager", "compiled"):
            ci = results.get(name, {}).get(mode, {}).get("transformer", {}).get(
                "tokens_per_s_vs_anchor-rope")
            goals.append({"measure": f"our tokens/s / anchor-rope's, {name}, {mode}",
                          **verdict(ci, ANCHOR_GOAL, ">=", reason)})
    best = max((results[n]["compiled"]["transformer"]["mfu_per_round"] for n in names
                if n in results and results[n]["seq"] == paper_seq),
               key=lambda ci: ci["median"], default=None)
    goals.append({"measure": f"MFU, sequence {paper_seq}, best micro-batch, compiled",
                  **verdict(best, MFU_BEST_GOAL, ">=", reason)})
    first = results.get(names[0], {}).get("compiled", {}).get("transformer", {})
    goals.append({"measure": f"MFU, {names[0]}, compiled",
                  **verdict(first.get("mfu_per_round"), MFU_32_GOAL, ">=", reason)})
    for name in names:
        row = results.get(name, {}).get("memory")
        error = None if row is None else abs(row["measured_over_estimated"] - 1)
        met = None if reason or error is None else error <= MEMORY_GOAL
        goals.append({"measure": f"|measured / estimated activation memory - 1|, {name}",
                      "goal": f"<= {MEMORY_GOAL}", "value": error, "met": met,
                      **({"reason": reason or "the shape did not run"} if met is None
                         else {})})
    return goals


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
