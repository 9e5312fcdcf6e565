"""Host memory of this process from /proc (Linux), for the benchmarks' peak-memory figures."""

from __future__ import annotations

import ctypes
from pathlib import Path


def status_kib(field: str) -> int:
    """A /proc/self/status field in KiB: VmRSS (resident now), VmHWM (its high-water mark)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> int:
    """Reset the RSS high-water mark to the current RSS; the RSS in KiB. Free heap memory goes
    back to the system first (glibc keeps freed 4 MiB tensors for reuse, which would hide
    the next allocations from the high-water mark)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return status_kib("VmRSS")
