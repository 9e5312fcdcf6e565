"""Freed memory kept for the next step on the CPU (pretrain/cpu_memory.py): after
`keep_freed_memory`, a step's worth of large blocks freed and made again takes no fresh
pages from the kernel; a malloc setting of the user's is left alone, by name."""

from __future__ import annotations

import os
import resource

import pytest
import torch

from pretrain import cpu_memory


def _faults_of_a_step(blocks: int = 24, block_bytes: int = 4 << 20) -> int:
    """Minor page faults of one 'step': `blocks` large tensors made, written and freed
    (96 MiB, far above glibc's default trim threshold)."""
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    kept = [torch.empty(block_bytes // 4).fill_(1.0) for _ in range(blocks)]
    del kept
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start


def test_freed_blocks_come_back_without_fresh_pages():
    line = cpu_memory.keep_freed_memory()
    if cpu_memory.reason_to_leave() is not None:
        pytest.skip(line)
    assert "kept for the next step" in line
    for _ in range(3):  # the heap grows to the step's peak
        _faults_of_a_step()
    faults = [_faults_of_a_step() for _ in range(3)]
    # glibc's defaults hand the 96 MiB back each time: about 24,000 faults a step.
    assert max(faults) < 2400, faults


@pytest.mark.parametrize("env", [{"MALLOC_ARENA_MAX": "2"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
                                 {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}])
def test_a_malloc_setting_of_the_users_is_left_alone(monkeypatch, env):
    for key in [k for k in os.environ if k.startswith("MALLOC_")] + ["LD_PRELOAD",
                                                                      "GLIBC_TUNABLES"]:
        monkeypatch.delenv(key, raising=False)
    assert cpu_memory.reason_to_leave() in (None, "not glibc")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    reason = cpu_memory.reason_to_leave()
    if reason == "not glibc":
        pytest.skip(reason)
    assert reason is not None and (next(iter(env)) in reason)
