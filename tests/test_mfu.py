"""The MFU peak: a datasheet table for known GPUs, a measured matmul otherwise, named."""

import pytest
import torch

from pretrain import mfu


@pytest.mark.parametrize("name,precision,peak", [
    ("NVIDIA H200", "bf16", 989e12), ("NVIDIA H200 NVL", "bf16", 835e12),
    ("NVIDIA H100 80GB HBM3", "fp32", 67e12), ("NVIDIA H100 PCIe", "tf32", 378e12),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312e12), ("NVIDIA L40S", "fp32", 91.6e12),
    ("NVIDIA L4", "bf16", 121e12), ("NVIDIA GeForce RTX 4090", "bf16", None)])
def test_spec_peak_table(name, precision, peak):
    assert mfu.spec_peak(name, precision) == peak


def test_gpu_peak_from_the_table_or_measured_and_said_so(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(mfu, "measure_matmul_flops", lambda *a, **k: 123e12)
    known = mfu.device_peak(cuda, torch.bfloat16)
    assert (known.flops, known.fixed) == (989e12, True)
    assert known.source == "datasheet: dense bf16 peak of NVIDIA H200"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU 9000")
    unknown = mfu.device_peak(cuda, torch.bfloat16)
    assert unknown.flops == 123e12 and "not in the table of known devices" in unknown.source


def test_cpu_peak_is_measured_and_re_measured():
    peak = mfu.TrainingPeak(torch.device("cpu"), torch.float32, interval=0.0)
    assert not peak.peak.fixed and peak.source.startswith("measured: fp32 matmul on cpu")
    first = peak.measured_at
    assert peak.flops() > 0 and peak.measured_at > first  # interval 0: every call measures
