"""`train.compile` (parallel/strategies/compile.py): compiled training equals eager training.

The trainer's engine runs 3 AdamW steps eager and compiled (`blocks`, `model`) on the same
data. The backend is aot_eager (dynamo's trace and AOT autograd's joint graph, run without
generating code: what changes the program, without inductor's minutes of C++ compilation on
a 2-core CPU); benchmarks/bench_compile.py measures inductor. Tolerance 1e-5 relative on the
losses and gradient norms per step (`model` runs the functional DWA, which sums in another
order than the eager buffered one).
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed_test
from tests.test_ddp import engine_run


def compiled_runs(world: int, overrides: tuple[str, ...], modes: tuple[str, ...]) -> dict:
    """Each mode's run, and the graphs dynamo compiled during it."""
    from torch._dynamo.utils import counters

    runs = {}
    for mode in modes:
        before = counters["stats"]["unique_graphs"]
        runs[mode] = engine_run(world, "ddp", *overrides, f"train.compile={mode}",
                                "train.compile_backend=aot_eager")
        runs[mode]["graphs"] = counters["stats"]["unique_graphs"] - before
    return runs


def assert_same_training(runs: dict) -> None:
    eager = runs.pop("none")
    assert eager["graphs"] == 0
    for mode, run in runs.items():
        assert run["graphs"] > 0, mode  # it was compiled, not run eagerly
        for key in ("losses", "norms"):
            assert run[key] == pytest.approx(eager[key], rel=1e-5), (mode, key)


@pytest.mark.timeout(300)
def test_compiled_blocks_and_model_train_as_eager():
    runs = run_distributed_test(compiled_runs, world_size=1, timeout_s=280, world=1,
                                overrides=("parallel.activation_checkpointing=block",),
                                modes=("none", "blocks", "model"))[0]
    assert_same_training(runs)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_compiled_blocks_in_pipeline_stages_and_tensor_parallel():
    for overrides, world in ((("parallel.pp=2",), 2), (("parallel.tp=2",), 2)):
        runs = run_distributed_test(compiled_runs, world_size=world, timeout_s=380,
                                    set_up_groups=False, world=world, overrides=overrides,
                                    modes=("none", "blocks"))
        for rank_runs in runs:
            assert_same_training(rank_runs)


@pytest.mark.parametrize("overrides, message", [
    (["train.compile=model", "parallel.pp=2"], "model compiles the whole model's loss"),
    (["train.compile=blocks", "parallel.zero_stage=3"], "blocks with ZeRO-3 is refused"),
])
def test_combinations_refused_before_launch(overrides, message):
    from pretrain.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, ["model.vocab_size=128", *overrides])
    assert err.value.key == "train.compile"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("blocks", [pytest.param("null", marks=pytest.mark.slow), "2"],
                         ids=["full", "block"])
def test_compiled_attnres_trains_as_eager(blocks):
    """Attention Residuals: `blocks` compiles the branches the program runs between the mixes
    (graphs > 0 says they were), `model` the whole loss with the mixes' autograd functions;
    both under dwa_block checkpointing (each unit recomputes its entry mix)."""
    runs = run_distributed_test(
        compiled_runs, world_size=1, timeout_s=280, world=1,
        overrides=("model.connection=attnres", f"model.attnres_blocks={blocks}",
                   "parallel.activation_checkpointing=dwa_block"),
        modes=("none", "blocks", "model"))[0]
    assert_same_training(runs)


def test_attnres_model_compiles_as_one_graph():
    """The mixes' custom autograd functions trace without a graph break (fullgraph)."""
    import torch

    from pretrain.model import DenseFormer, DenseFormerConfig

    cfg = DenseFormerConfig(n_layers=2, d_model=16, n_heads=2, vocab_size=64, seq_len=8,
                            connection="attnres", attnres_blocks=2)
    model = DenseFormer(cfg)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    eager = model.loss(tokens[:, :-1], tokens[:, 1:])
    whole = torch.compile(model.loss, backend="aot_eager", fullgraph=True)
    assert torch.equal(whole(tokens[:, :-1], tokens[:, 1:]), eager)
