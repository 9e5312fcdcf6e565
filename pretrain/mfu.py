"""Model FLOPs utilisation: model FLOP/s over the device's peak, and where the peak comes from.

On a GPU the peak is the device's dense (no sparsity) datasheet figure for the compute
dtype, looked up by `torch.cuda.get_device_name` in `DATASHEET_PEAKS`; a device not in the
table falls back to the best matmul throughput measured at start-up, and says so. On a CPU
there is no datasheet figure: the peak is the measured fp32 (or bf16) matmul, named as such.
`peak_flops` returns the figure and a one-line source that the trainer logs and tags on the
MLflow run (`mfu_peak_flops`, `mfu_peak_source`; the metric stays `mfu`).
"""

from __future__ import annotations

import time

import torch

# Dense peak FLOP/s per device from NVIDIA's datasheets: (name fragment, bf16, fp32), matched
# in order against torch.cuda.get_device_name (so "H100 PCIe" before "H100"). fp32 is
# plain FP32 (matmuls under TF32 can reach more; the trainer does not enable TF32).
DATASHEET_PEAKS = (
    ("H200", 989e12, 67e12),
    ("H100 PCIe", 756e12, 51e12),
    ("H100 NVL", 835e12, 60e12),
    ("H100", 989e12, 67e12),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("GH200", 989e12, 67e12),
    ("A100", 312e12, 19.5e12),
    ("L40S", 362e12, 91.6e12),
    ("L40", 181e12, 90.5e12),
    ("L4", 121e12, 30.3e12),
)


def datasheet_peak(device_name: str, dtype: torch.dtype) -> float | None:
    """The datasheet peak of a device by name, None if it is not in the table."""
    for fragment, bf16, fp32 in DATASHEET_PEAKS:
        if fragment in device_name:
            return bf16 if dtype == torch.bfloat16 else fp32
    return None


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s, what it is) for MFU on `device` computing in `dtype`."""
    kind = str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = datasheet_peak(name, dtype)
        if peak is not None:
            return peak, f"datasheet dense {kind} peak of {name}"
        return (measure_matmul_flops(device, dtype),
                f"measured {kind} matmul ({name} is not in pretrain/mfu.py's datasheet table)")
    return measure_matmul_flops(device, dtype), f"measured {kind} matmul on {device.type}"


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
