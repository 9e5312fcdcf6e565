"""MFU inside a study: every run against one peak, so that MFU orders runs as their model
FLOP/s do.

Each run logs the model FLOP/s per device it achieved only as MFU against its own peak
(pretrain/mfu.py: a GPU's datasheet peak; on a CPU a matmul measured at start-up and every
300 s, 4.2e10 on one run and 1.8e11 on the next on a shared machine). The report multiplies
them back (`flops_per_device`, slurm/report_data.py) and divides by the study's one peak:

- declared (`python -m slurm report --mfu-peak`: FLOP/s, or a device of pretrain.mfu's
  table, its dense bf16 peak);
- else, when every run measured against the same datasheet peak: that spec peak;
- else, runs on a measured matmul (a CPU, a GPU not in the table): the median of the runs'
  measurements, and the column says "vs measured matmul": relative to that machine's
  matmul, not comparable across machines; the report compares tokens/s instead;
- else (GPUs with different datasheet peaks, or no peak recorded): no MFU, and why.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from slurm.report_data import ReportError, StudyRun

DATASHEET, MEASURED = "datasheet:", "measured:"


@dataclass
class StudyPeak:
    """The one MFU denominator of a study (flops None: no MFU, `why` says why)."""

    flops: float | None
    source: str
    comparable: bool  # False: a measured matmul, meaningful on that machine only
    why: str = ""

    @property
    def header(self) -> str:
        return "MFU" if self.comparable else "MFU vs measured matmul"


def parse_peak(text: str) -> float:
    """--mfu-peak: FLOP/s (`989e12`), or a device name of pretrain.mfu.DEVICE_PEAKS (`H100`)."""
    try:
        value = float(text)
    except ValueError:
        # deferred: pulls in torch (slow to start, or optional)
        from pretrain.mfu import spec_peak

        value = spec_peak(text) or 0.0
        if not value:
            raise ReportError(f"--mfu-peak {text!r}: neither FLOP/s nor a device of "
                              "pretrain/mfu.py's table (H100, A100, ...)") from None
    if value <= 0:
        raise ReportError(f"--mfu-peak {text!r}: must be positive FLOP/s")
    return value


def _source(run: StudyRun) -> str:
    return run.params.get("mfu_peak_source") or run.tags.get("mfu_peak_source") or ""


def _peak(run: StudyRun) -> float | None:
    """The run's peak: the median of its steps' (re-measured on a CPU), else its param."""
    value = (run.speed.get("mfu_peak_flops") or run.params.get("mfu_peak_flops")
             or run.tags.get("mfu_peak_flops"))
    return float(value) if value else None


def study_peak(runs: list[StudyRun], declared: float | None = None) -> StudyPeak:
    """The peak every run's MFU is taken against (see the module docstring)."""
    if declared is not None:
        return StudyPeak(declared, f"declared: {declared:.4g} FLOP/s (--mfu-peak)", True)
    timed = [r for r in runs if "flops_per_device" in r.speed]
    if not timed:
        return StudyPeak(None, "", True, "no run recorded its MFU and peak")
    sources = {_source(r) for r in timed}
    if all(s.startswith(DATASHEET) for s in sources):
        peaks = {_peak(r) for r in timed}
        if len(peaks) == 1 and None not in peaks:
            (peak,) = peaks
            return StudyPeak(peak, f"{sorted(sources)[0]} ({peak:.4g} FLOP/s)", True)
        return StudyPeak(None, "", True, "the runs measured against different datasheet "
                         f"peaks ({'; '.join(sorted(sources))}): declare one with "
                         "--mfu-peak")
    measured = [p for r in timed if _source(r).startswith(MEASURED)
                and (p := _peak(r)) is not None]
    if not measured or len(measured) < len(timed):
        return StudyPeak(None, "", True, "runs without a recorded peak, or on datasheet and "
                         "measured peaks at once: declare one with --mfu-peak")
    peak = statistics.median(measured)
    return StudyPeak(peak, f"the median of the runs' measured matmuls ({peak:.3g} FLOP/s, "
                     f"from {min(measured):.3g} to {max(measured):.3g})", False)


def study_mfu(run: StudyRun, peak: StudyPeak) -> float | None:
    """The run's MFU against the study's peak."""
    achieved = run.speed.get("flops_per_device")
    return None if achieved is None or peak.flops is None else achieved / peak.flops
