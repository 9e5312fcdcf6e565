"""The GPU check's `dwa` part: what the DWAs cost in a train step, and alone.

- dwa_steps: our Transformer and DenseFormer 1x1, 4x1, 4x5 with `model.dwa_dtype` fp32 and
  bf16 (`model.dwa_impl` auto: the Triton kernels on a GPU; each row records the
  implementation it ran), the torch implementation beside them at 1x1 and 4x5 (rows
  `.../torch`), and the nanoGPT-style anchor alone and with the official DWA (`--official PATH`, a
  DenseFormer checkout) or the clean-room `ReferenceDWA` (benchmarks/nanogpt_anchor.py) at
  the same patterns; all eager, bf16 autocast, fused AdamW, interleaved
  (gpu_check_timing.py). Ratios: each of ours to our Transformer, each anchor row to the
  anchor, and our DWA's added time (ours - our Transformer) over the other code's (anchor
  with DWA - anchor), per round; goals from issue 30.
- dwa_alone: the same DWAs with every block replaced by a scalar multiply, forward +
  backward under the same autocast, minus the same without DWA, against the byte floor:
  `buffered_traffic`'s floor count (pretrain/model/dwa_layout.py: what any scheme that reads
  every (i, j) pair once must move) x one hidden-size tensor's bytes, at the copy bandwidth
  measured on the device (best of 10 large copies). The tensor bytes are those of the
  storage dtype (for bf16 a lower bound: the outputs and gradients stay fp32). Goal (issue
  33): at most 1.3x the floor, each storage dtype.
- dwa_compiled (its own part, `--only dwa_compiled`: compilation takes minutes): our
  Transformer and DenseFormer 1x1 and 4x5 at both storage dtypes, compiled as
  `train.compile` does (parallel/strategies/compile.py): `blocks` (every block compiled, the
  buffered DWAs eager between them) for every row, `model` (the whole loss one graph, the DWAs as
  the custom op of pretrain/model/dwa_op.py) for the Transformer and 1x1 bf16, and 1x1
  bf16 with `model.dwa_impl: torch` (its products traced by inductor instead); each
  against the Transformer compiled the same way. Goals from issue 33 (default rows).
"""

from __future__ import annotations

import torch
from gpu_check_perf import (
    Shapes,
    anchor,
    goal_reason,
    load,
    ours,
    peak_flops,
    timed_rows,
    timing_header,
)
from gpu_check_timing import (
    INTERVAL,
    copy_bandwidth,
    interleaved,
    median_ci,
    ratio_ci,
    round_means,
    timer_name,
    verdict,
)
from torch import nn

PATTERNS = {"1x1": (1, 1), "4x1": (4, 1), "4x5": (4, 5)}
STORAGE = ("fp32", "bf16")
# Issue 30's goals, at the paper shape on a GPU: step time over our Transformer's, and our
# DWA's added time over the official code's (both storage dtypes are checked against each).
STEP_GOALS = {("1x1", "fp32"): 1.25, ("1x1", "bf16"): 1.15, ("4x5", "fp32"): 1.05,
              ("4x5", "bf16"): 1.05}
ADDED_GOAL = 0.5
ADDED_GOAL_PATTERNS = ("1x1", "4x5")
TORCH_ROW_PATTERNS = ("1x1", "4x5")  # the torch implementation beside the default
FLOOR_GOAL = 1.3  # the DWAs' added time over their pairwise byte floor (issue 33)
# Issue 33's goals: step time over our Transformer's, both compiled.
COMPILED_GOALS = {("1x1", "bf16"): 1.10, ("1x1", "fp32"): 1.20, ("4x5", "fp32"): 1.03,
                  ("4x5", "bf16"): 1.03}
# (row, compile mode) of the dwa_compiled part; "transformer" is each mode's denominator.
COMPILED_ROWS = [*((f"dense-{p}/{s}", "blocks") for p in ("1x1", "4x5") for s in STORAGE),
                 ("dense-1x1/bf16", "model"), ("dense-1x1/bf16/torch", "model")]


def our_rows(with_torch: bool = False) -> dict[str, tuple[str, str, str, str]]:
    """{row: (paper variant, pattern, storage dtype, model.dwa_impl)}: each pattern at each
    storage dtype with the default implementation, and `with_torch` the torch rows."""
    rows = {f"dense-{pattern}/{storage}": (f"dense-{pattern}", pattern, storage, "auto")
            for pattern in PATTERNS for storage in STORAGE}
    if with_torch:
        rows.update({f"dense-{pattern}/{storage}/torch": (f"dense-{pattern}", pattern,
                                                          storage, "torch")
                     for pattern in TORCH_ROW_PATTERNS for storage in STORAGE})
    return rows


def our_config(shapes: Shapes, variant: str, storage: str, impl: str):
    """The paper config of `variant` with the DWA storage dtype and implementation."""
    return load(variant, shapes, f"model.dwa_dtype={storage}", f"model.dwa_impl={impl}")


def impl_ran(impl: str, device: torch.device) -> str:
    """What `model.dwa_impl=impl` runs on `device` (triton or torch)."""
    from pretrain.model.dwa_impl import resolve

    return resolve(impl, device)


def other_dwa(official_cls, n_layers: int, pattern: str) -> nn.Module:
    """The official DWAModules (a class from --official) or the clean-room ReferenceDWA."""
    from nanogpt_anchor import ReferenceDWA

    return (official_cls or ReferenceDWA)(n_layers, *PATTERNS[pattern])


def section_dwa_steps(device: torch.device, shapes: Shapes, fused: bool, official_cls,
                      keep: dict) -> dict:
    """The step rows and ratios (module docstring); `keep` gets the models for dwa_alone."""
    rows = our_rows(with_torch=True)
    style = "official" if official_cls is not None else "reference"
    trainees = {"transformer": ours(load("transformer", shapes), device, shapes, fused)}
    for name, (variant, _, storage, impl) in rows.items():
        trainees[name] = ours(our_config(shapes, variant, storage, impl), device, shapes,
                              fused)
    trainees["anchor"] = anchor(load("transformer", shapes), device, shapes, fused)
    for pattern in PATTERNS:
        cfg = load(f"dense-{pattern}", shapes)
        trainees[f"{style}-{pattern}"] = anchor(cfg, device, shapes, fused, other_dwa(
            official_cls, cfg.model.n_layers, pattern))
    peak = peak_flops(device, shapes.dtype)
    figures, times = timed_rows(trainees, device, shapes, peak)
    keep.update({name: t.model for name, t in trainees.items() if name != "anchor"})

    def added(name: str, pattern: str) -> dict:  # per round: ours' added / the other's
        ours_added = [a - b for a, b in zip(round_means(times[name]),
                                            round_means(times["transformer"]), strict=True)]
        other_added = [a - b for a, b in zip(round_means(times[f"{style}-{pattern}"]),
                                             round_means(times["anchor"]), strict=True)]
        return median_ci([a / b for a, b in zip(ours_added, other_added, strict=True)])

    reason = goal_reason(device, shapes)
    goals = []
    for name, (_, pattern, storage, impl) in rows.items():
        figures[name].update(dwa_dtype=storage, dwa_impl=impl_ran(impl, device))
        figures[name]["vs_transformer"] = ratio_ci(times[name], times["transformer"])
        figures[name][f"added_time_vs_{style}"] = added(name, pattern)
        if impl != "auto":  # the goals are the default implementation's
            continue
        if (pattern, storage) in STEP_GOALS:
            goals.append({"measure": f"{pattern} step / Transformer step, {storage} storage",
                          "row": name, **verdict(figures[name]["vs_transformer"],
                                                 STEP_GOALS[pattern, storage], "<=", reason)})
        if pattern in ADDED_GOAL_PATTERNS:
            why = reason or (None if official_cls is not None else
                             "measured against the clean-room ReferenceDWA; the goal is "
                             "against the official code (--official PATH)")
            goals.append({"measure": f"our DWA's added time / the official code's, {pattern}"
                                     f", {storage} storage", "row": name,
                          **verdict(figures[name][f"added_time_vs_{style}"], ADDED_GOAL,
                                    "<=", why)})
    for pattern in PATTERNS:
        figures[f"{style}-{pattern}"]["vs_anchor"] = ratio_ci(times[f"{style}-{pattern}"],
                                                              times["anchor"])
    return {**timing_header(device, shapes, fused), "peak": peak, "other_dwa": style,
            "rows": figures, "goals": goals}


def section_dwa_alone(device: torch.device, shapes: Shapes, official_cls, keep: dict) -> dict:
    """The DWAs alone against their byte floor (module docstring); reuses `keep`'s models
    (dwa_steps') where it has them."""
    from bench_model import Scale  # the stand-in block of bench_model's DWA-alone rows
    from nanogpt_anchor import AnchorGPT

    from pretrain.evaluate import autocast_for
    from pretrain.model.dwa_layout import buffered_traffic

    rows = our_rows(with_torch=True)
    style = "official" if official_cls is not None else "reference"
    m = load("transformer", shapes).model
    x0 = torch.randn(shapes.batch, m.seq_len, m.d_model, device=device, requires_grad=True)

    def run_of(model: nn.Module):
        model.blocks = nn.ModuleList(Scale() for _ in range(m.n_layers)).to(device)

        def run():
            with autocast_for(device, shapes.dtype):
                y = model.run_blocks(x0)
            y.float().sum().backward()
        return run

    def ours_model(name: str, cfg) -> nn.Module:
        if name in keep:
            return keep.pop(name)
        from gpu_check_perf import build

        return build(cfg, device)

    runs = {"no DWA": run_of(ours_model("transformer", load("transformer", shapes)))}
    for name, (variant, _, storage, impl) in rows.items():
        runs[name] = run_of(ours_model(name, our_config(shapes, variant, storage, impl)))
    for pattern in PATTERNS:
        other = keep.pop(f"{style}-{pattern}", None) or AnchorGPT(
            1, 8, 1, 1, 8, other_dwa(official_cls, m.n_layers, pattern)).to(device)
        runs[f"{style}-{pattern}"] = run_of(other)
    keep.clear()
    bandwidth = copy_bandwidth(device, shapes.copy_bytes)
    times = interleaved(runs, device, rounds=shapes.rounds, steps=shapes.steps_per_round,
                        warmup=shapes.warmup_steps)
    none = round_means(times.pop("no DWA"))
    tokens = shapes.batch * m.seq_len
    figures, goals = {}, []
    reason = goal_reason(device, shapes)
    for name, series in times.items():
        pattern = name.split("-")[1].split("/")[0]
        storage = rows[name][2] if name in rows else None
        traffic = buffered_traffic(load(f"dense-{pattern}", shapes).model.dwa_pattern)
        tensor_bytes = tokens * m.d_model * (2 if storage == "bf16" else 4)
        floor_s = (traffic["floor_forward"] + traffic["floor_backward"]) * tensor_bytes / \
            bandwidth["best_bytes_per_s"]
        added = [a - b for a, b in zip(round_means(series), none, strict=True)]
        figures[name] = {"dwa_dtype": storage, "added_ms": median_ci([a * 1e3 for a in added]),
                         "floor_tensors": traffic["floor_forward"] + traffic["floor_backward"],
                         "tensor_bytes": tensor_bytes, "floor_ms": floor_s * 1e3,
                         "vs_floor": median_ci([a / floor_s for a in added])}
        if name in rows:
            impl = rows[name][3]
            figures[name].update(buffered_tensors=traffic["forward"] + traffic["backward"],
                                 dwa_impl=impl_ran(impl, device))
            if impl == "auto":
                goals.append({"measure": f"DWA added time / pairwise byte floor, {pattern}, "
                                         f"{storage} storage", "row": name,
                              **verdict(figures[name]["vs_floor"], FLOOR_GOAL, "<=", reason)})
    return {"timer": timer_name(device), "interval": INTERVAL, "rounds": shapes.rounds,
            "steps_per_round": shapes.steps_per_round, "batch": shapes.batch,
            "autocast": str(shapes.dtype).removeprefix("torch."), "copy_bandwidth": bandwidth,
            "other_dwa": style, "no_dwa_ms": median_ci([t * 1e3 for t in none]),
            "rows": figures, "goals": goals}


def section_dwa_compiled(device: torch.device, shapes: Shapes, fused: bool) -> dict:
    """COMPILED_ROWS and each mode's compiled Transformer, interleaved (module docstring);
    the first step of each (compilation included) is timed on its own."""
    import time

    from gpu_check_timing import sync

    from parallel.strategies.compile import apply_compile

    backend = "inductor" if device.type == "cuda" else "aot_eager"
    rows = our_rows(with_torch=True)
    modes = sorted({mode for _, mode in COMPILED_ROWS})
    trainees, first = {}, {}
    for name, mode in [("transformer", m) for m in modes] + COMPILED_ROWS:
        variant, _, storage, impl = rows.get(name, ("transformer", None, "fp32", "auto"))
        trainee = ours(our_config(shapes, variant, storage, impl), device, shapes, fused)
        apply_compile(trainee.model, mode, backend)
        sync(device)
        start = time.perf_counter()
        trainee.step()
        sync(device)
        first[f"{name}/{mode}"] = time.perf_counter() - start
        trainees[f"{name}/{mode}"] = trainee
    figures, times = timed_rows(trainees, device, shapes)
    reason = goal_reason(device, shapes)
    goals = []
    for row, mode in COMPILED_ROWS:
        name = f"{row}/{mode}"
        _, pattern, storage, impl = rows[row]
        figures[name].update(dwa_dtype=storage, dwa_impl=impl_ran(impl, device), compile=mode,
                             vs_transformer=ratio_ci(times[name], times[f"transformer/{mode}"]))
        if impl == "auto" and (pattern, storage) in COMPILED_GOALS:
            goals.append({"measure": f"{pattern} step / Transformer step, both compiled "
                                     f"({mode}), {storage} storage", "row": name,
                          **verdict(figures[name]["vs_transformer"],
                                    COMPILED_GOALS[pattern, storage], "<=", reason)})
    for name, seconds in first.items():
        figures[name]["first_step_s_with_compile"] = seconds
    return {**timing_header(device, shapes, fused), "backend": backend, "rows": figures,
            "goals": goals}
