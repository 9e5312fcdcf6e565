"""Freed memory kept for the next step on the CPU, as the CUDA caching allocator keeps it
on a GPU (glibc's malloc, set through `mallopt`).

By default glibc hands a freed block back to the kernel when it was mapped on its own (any
block above M_MMAP_THRESHOLD, a threshold that rises with the blocks freed, up to 32 MiB)
or when the free space at the top of the heap passes M_TRIM_THRESHOLD (twice that). A train
step frees its activations at its end and makes them again in the next, so each step can
take fresh pages, which the kernel zeroes on first touch: a Hyper-Connections model at 48
blocks x 256 (n = 4 streams, 4 MB states) took about 95,000 page faults a step (370 MB) that
way, and the page-zeroing alone was 6.5% of its CPU time. `keep_freed_memory` fixes both
thresholds: blocks under 64 MiB come from the heap, and the heap is not trimmed below
2 GiB of free space, so the process keeps its peak, which the next step needs again.

A choice of the user's is left alone: a glibc malloc setting in the environment (MALLOC_*
or GLIBC_TUNABLES) or another allocator preloaded (LD_PRELOAD, e.g. jemalloc or tcmalloc);
and there is nothing to set off glibc.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 64 << 20  # larger blocks are still mapped on their own
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: 2 GiB


def reason_to_leave() -> str | None:
    """Why the allocator is left as it is (naming the setting), or None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc"
    chosen = sorted(k for k in os.environ if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES")
    if chosen:
        return f"{', '.join(chosen)} set in the environment"
    if os.environ.get("LD_PRELOAD"):
        return f"LD_PRELOAD={os.environ['LD_PRELOAD']}"
    return None


@functools.cache
def keep_freed_memory() -> str:
    """Set glibc's thresholds for this process (once); returns a line for the log saying
    what was done or why not."""
    reason = reason_to_leave()
    if reason is not None:
        return f"CPU memory: malloc left as it is ({reason})"
    libc = ctypes.CDLL(None)
    if not (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
            and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "CPU memory: malloc left as it is (mallopt refused the thresholds)"
    return ("CPU memory: freed blocks under 64 MiB kept for the next step (glibc mallopt; "
            "a MALLOC_* setting in the environment leaves malloc alone)")
