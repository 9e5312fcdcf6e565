"""`parallel.pipeline_dtype`: stage boundaries cross in the compute dtype (bf16 under bf16
autocast) or in fp32.

A PP=2 run under bf16 autocast, its boundaries in bf16 (`compute`) and in fp32, against the
same model in one process under the same autocast, on the same data. On the first step
(before any update) the fp32 boundaries give what one process computes (the boundary
tensors are the fp32 residual stream): loss to 1e-6 and gradient norm to 1e-5 relative.
bf16 boundaries round each crossing tensor (an X_j or a DWA partial sum) to bf16's 8-bit
mantissa, a relative error of at most 2^-9 per element: loss to 1e-5 and gradient norm to
1e-3 relative (measured 2e-6 and 9e-5). Over 3 AdamW steps at lr 1e-2 bf16 noise grows in
either layout: losses to 1e-3 relative. fp32 runs are unchanged by the option
(tests/test_pipeline.py and tests/test_ddp.py run them).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed_test
from tests.test_ddp import engine_run

PIPELINE = ("parallel.pp=2", "parallel.dp_reduction=flat", "model.dwa_period=1")


def pipeline_runs() -> dict:
    return {mode: engine_run(2, "flat", *PIPELINE, f"parallel.pipeline_dtype={mode}",
                             dtype=torch.bfloat16) for mode in ("compute", "fp32")}


def single_process_run() -> dict:
    return engine_run(1, "flat", "model.dwa_period=1", dtype=torch.bfloat16)


@pytest.mark.timeout(300)
def test_bf16_boundaries_halve_the_traffic_within_the_stated_tolerance():
    reference = run_distributed_test(single_process_run, world_size=1, timeout_s=120)[0]
    runs = run_distributed_test(pipeline_runs, world_size=2, timeout_s=280,
                                set_up_groups=False)[0]
    exact, narrow = runs["fp32"], runs["compute"]
    for run, loss_tol, norm_tol in ((exact, 1e-6, 1e-5), (narrow, 1e-5, 1e-3)):
        assert run["losses"][0] == pytest.approx(reference["losses"][0], rel=loss_tol)
        assert run["norms"][0] == pytest.approx(reference["norms"][0], rel=norm_tol)
        assert run["losses"] == pytest.approx(reference["losses"], rel=1e-3)
    assert narrow["norms"][0] != exact["norms"][0]  # the bf16 boundary did round something
    # The run log's boundary line: the same tensors, half the bytes.
    sizes = [[line for line in run["describe"] if "after block" in line]
             for run in (exact, narrow)]
    assert sizes[0] and sizes[0] != sizes[1], sizes


def test_plan_and_estimator_count_the_boundary_dtype():
    from parallel.strategies.memory import estimate
    from parallel.strategies.plan import boundary_dtype_bytes
    from pretrain.config import load_config

    def cfg(*extra: str):
        return load_config(None, ["model.vocab_size=512", "model.n_layers=8",
                                  "parallel.pp=2", *extra])

    def dtype_bytes(run, device: str) -> int:
        return boundary_dtype_bytes(run.parallel, run.train.dtype, device)

    assert dtype_bytes(cfg(), "cuda") == 2  # auto -> bf16 on a GPU
    assert dtype_bytes(cfg(), "cpu") == 4
    assert dtype_bytes(cfg("parallel.pipeline_dtype=fp32"), "cuda") == 4
    # The last stage receives the boundary tensors: bf16 copies beside the widened ones.
    narrow, wide = (estimate(c.parallel, c.model, c.train.batch_size, c.train.dtype,
                             device="cuda")[-1].activation_bytes
                    for c in (cfg(), cfg("parallel.pipeline_dtype=fp32")))
    assert narrow > wide
