"""DeepSpeed ZeRO with MUDD: ZeRO 1-3 at DP=2 reproduce the single-process AdamW run (ZeRO
0), with the harness and tolerances of tests/test_zero.py and tests/test_zero_attnres.py.
The MUDD static weights and dynamic-weight MLPs are small replicated tensors in the
no-decay group: partitioned and gathered like the norm weights.

All slow (the default suite's time budget; tests/test_zero_attnres.py covers replicated
connection weights there): ZeRO-1 with static r-only MUDD and ZeRO-3 with dynamic qkvr
MUDD; every stage, dwa_block checkpointing under ZeRO-2; ZeRO-1 at TP=2 x DP=2 with
sequence parallelism.
"""

from __future__ import annotations

import pytest

from tests.test_zero_attnres import CHECKPOINTED, TP_SP, check

DYNAMIC = ("model.connection=mudd", "optim.eps=1e-6")
STATIC_R = ("model.connection=mudd", "model.mudd_dynamic=false", "model.mudd_streams=r",
            "optim.eps=1e-6")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_zero1_static_r_and_zero3_dynamic_mudd_equal_zero0():
    check({"ZeRO-1 static r MUDD": (1, STATIC_R), "ZeRO-3 dynamic MUDD": (3, DYNAMIC)})


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_every_stage_with_mudd_equals_zero0():
    layouts = {f"ZeRO-{stage} {name} MUDD": (stage, model)
               for stage in (1, 2, 3) for name, model in (("dynamic", DYNAMIC),
                                                          ("static r", STATIC_R))}
    layouts["ZeRO-2 dynamic MUDD dwa_block every 2"] = (2, (*DYNAMIC, *CHECKPOINTED))
    check(layouts)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_zero1_at_tp2_with_sequence_parallel_mudd_equals_zero0():
    check({"ZeRO-1 TP=2 SP dynamic MUDD": (1, (*DYNAMIC, *TP_SP)),
           "ZeRO-1 TP=2 SP static r MUDD dwa_block": (1, (*STATIC_R, *TP_SP, *CHECKPOINTED))},
          world_size=4, tp=2)
