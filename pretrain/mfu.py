"""Model FLOPs utilisation: model FLOP/s over one named peak.

    MFU = flops_per_token x tokens/s / (peak x devices)

(`DenseFormerConfig.flops_per_token`: 6N + 12 L H T, the nanoGPT/PaLM count, plus the DWAs).
What the peak is, by device (`device_peak`):

- a GPU in `DEVICE_PEAKS`: its dense (no sparsity) datasheet peak for the training precision
  (bf16 and fp16 alike; fp32 as TF32 tensor cores when torch allows TF32 matmuls, else the
  plain fp32 rate), the same number on every run;
- any other GPU: a matmul of that dtype measured once at start-up, and the source says so;
- a CPU (or any other device): a matmul at the current thread count, re-measured every
  `CPU_REMEASURE_S` seconds (`TrainingPeak`), so that on a shared machine the peak and the
  step time see the same contention. It is "the fraction of this machine's matmul speed
  right now", not a hardware peak, and is named that way in the logs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

# (fragment of torch.cuda.get_device_name, dense FLOP/s for bf16, tf32, fp32), most specific
# first: NVIDIA datasheets, sparsity excluded (their "with sparsity" figures halved).
DEVICE_PEAKS = (
    ("H200 NVL", 835e12, 417.5e12, 60e12),
    ("H200", 989e12, 494.7e12, 67e12),
    ("H100 NVL", 835e12, 417.5e12, 60e12),
    ("H100 PCIe", 756e12, 378e12, 51e12),
    ("H100", 989e12, 494.7e12, 67e12),  # SXM: "NVIDIA H100 80GB HBM3"
    ("A100", 312e12, 156e12, 19.5e12),
    ("L40S", 362e12, 183e12, 91.6e12),
    ("L40", 181e12, 90.5e12, 90.5e12),
    ("L4", 121e12, 60e12, 30.3e12),
)
_COLUMNS = {"bf16": 1, "tf32": 2, "fp32": 3}
CPU_REMEASURE_S = 300.0


def precision_of(device: torch.device, dtype: torch.dtype) -> str:
    """The precision a matmul of `dtype` runs at: bf16 (also fp16), tf32 or fp32."""
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    if device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


def spec_peak(device_name: str, precision: str = "bf16") -> float | None:
    """The dense datasheet peak (FLOP/s) of a device named `device_name`, None if unknown."""
    row = next((row for row in DEVICE_PEAKS if row[0] in device_name), None)
    return None if row is None else row[_COLUMNS[precision]]


@dataclass(frozen=True)
class Peak:
    """An MFU denominator and what it is (`source`, for logs and run params)."""

    flops: float
    source: str
    fixed: bool  # False: a CPU measurement, re-taken as training goes
    versus: str = ""  # after "MFU 40%" in a log line when the peak is no datasheet's


def device_peak(device: torch.device, dtype: torch.dtype) -> Peak:
    """The peak MFU is measured against on `device` for `dtype` (see the module docstring)."""
    precision = precision_of(device, dtype)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        spec = spec_peak(name, precision)
        if spec is not None:
            return Peak(spec, f"datasheet: dense {precision} peak of {name}", True)
        measured = measure_matmul_flops(device, dtype, size=8192, seconds=1.0)
        return Peak(measured, f"measured: {precision} matmul on {name}, which is not in "
                    "the table of known devices (pretrain/mfu.py)", True,
                    versus=" vs measured GPU matmul")
    measured = measure_matmul_flops(device, dtype, size=1024, seconds=0.3)
    return Peak(measured, f"measured: {precision} matmul on {device.type} with "
                f"{torch.get_num_threads()} threads, re-measured every "
                f"{CPU_REMEASURE_S:.0f} s", fixed=False, versus=" vs measured CPU matmul")


class TrainingPeak:
    """The peak of the training log: fixed on a GPU; on a CPU re-measured every `interval`
    seconds (0.3 s each), between steps."""

    def __init__(self, device: torch.device, dtype: torch.dtype,
                 interval: float = CPU_REMEASURE_S):
        self.device, self.dtype, self.interval = device, dtype, interval
        self.peak = device_peak(device, dtype)
        self.measured_at = time.monotonic()

    @property
    def source(self) -> str:
        return self.peak.source

    def flops(self) -> float:
        """The current peak (FLOP/s), re-measured first if it is due."""
        if not self.peak.fixed and time.monotonic() - self.measured_at >= self.interval:
            self.peak = device_peak(self.device, self.dtype)
            self.measured_at = time.monotonic()
        return self.peak.flops


def measure_matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32,
                         size: int = 1024, seconds: float = 0.3) -> float:
    """Best-of achieved FLOP/s of a square matmul on `device` (a short warm benchmark)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = 0.0
    deadline = time.perf_counter() + seconds
    a @ b  # warm-up
    while time.perf_counter() < deadline or best == 0.0:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, 4 * 2 * size**3 / (time.perf_counter() - start))
    return best
