"""Model FLOPs utilisation against this machine's measured matmul throughput."""

from __future__ import annotations

import time

import torch


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
