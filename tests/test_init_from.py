"""train.init_from: a new run from another run's weights; a Transformer grows identity DWAs."""

import pytest

from tests.test_train import losses, on_ranks, run, train_cmd

TRANSFORMER = ["model.dwa=false", "train.log_every=1", "data.val_batches=0"]
ONE_STEP = ["train.steps=1", "optim.warmup_steps=0", "train.log_every=1", "data.val_batches=0",
            "tracking.enabled=false"]


@pytest.fixture(scope="module")
def transformer_run(tiny_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("init") / "transformer"
    done = run(train_cmd(tiny_data, run_dir, *TRANSFORMER, "train.steps=3",
                         "tracking.enabled=false"))
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def continued_transformer(tiny_data, transformer_run):
    """The Transformer continued as itself: the loss a grown DenseFormer must match."""
    run_dir = transformer_run.parent / "continued"
    done = run(train_cmd(tiny_data, run_dir, *TRANSFORMER, *ONE_STEP,
                         f"train.init_from={transformer_run}"))
    assert done.returncode == 0, done.stderr[-3000:]
    return losses(run_dir)[1]


@pytest.mark.timeout(300)
def test_a_transformer_starts_a_denseformer_at_the_transformers_loss(
        tiny_data, transformer_run, continued_transformer, tmp_path):
    from mlflow.tracking import MlflowClient

    from pretrain.tracking import default_tracking_uri

    trained = losses(transformer_run)
    run_dir = tmp_path / "dense"
    done = run(train_cmd(tiny_data, run_dir, *ONE_STEP[:-1],  # tracking on
                         f"train.init_from={transformer_run}"))
    assert done.returncode == 0, done.stderr[-3000:]
    first = losses(run_dir)[1]
    assert first == pytest.approx(continued_transformer, rel=1e-6)
    # The trained weights, not a fresh init (whose first loss is the Transformer run's own).
    assert first != pytest.approx(trained[1], rel=1e-4)
    client = MlflowClient(tracking_uri=default_tracking_uri(run_dir))
    [mlflow_run] = client.search_runs(
        [e.experiment_id for e in client.search_experiments()])
    assert mlflow_run.data.tags["init_from"].endswith("step-00000003")
    assert mlflow_run.data.tags["init_from_step"] == "3"
    # Every checkpoint's DWA heatmap, in the run directory and in MLflow.
    assert (run_dir / "dwa" / "step-00000001.png").stat().st_size > 0
    assert [a.path for a in client.list_artifacts(mlflow_run.info.run_id, "dwa")] == \
        ["dwa/step-00000001.png"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [  # ZeRO-2 (a DeepSpeed engine, about a minute): slow
    "parallel.tp=2", pytest.param("parallel.zero_stage=2", marks=pytest.mark.slow)])
def test_init_from_loads_across_layouts(tiny_data, transformer_run, continued_transformer,
                                        tmp_path, layout):
    run_dir = tmp_path / "run"
    done = run(on_ranks(2, train_cmd(tiny_data, run_dir, *ONE_STEP, layout,
                                     f"train.init_from={transformer_run}")), timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    assert losses(run_dir)[1] == pytest.approx(continued_transformer, rel=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("source,override,differs", [
    ("dense", "model.dwa_period=2", "model.dwa_period: 1 in the checkpoint, 2 now"),
    ("dense", "model.dwa=false", "model.dwa: True in the checkpoint, False now"),
    ("transformer", "model.d_model=64", "model.d_model: 32 in the checkpoint, 64 now"),
    ("missing", "train.steps=1", "is neither a checkpoint"),
])
def test_a_checkpoint_that_cannot_start_the_run_exits_2_naming_the_keys(
        tiny_data, transformer_run, tmp_path, source, override, differs):
    if source == "dense":
        source_dir = transformer_run.parent / "dense-source"
        if not source_dir.exists():
            done = run(train_cmd(tiny_data, source_dir, *ONE_STEP))
            assert done.returncode == 0, done.stderr[-3000:]
    else:
        source_dir = transformer_run if source == "transformer" else tmp_path / "nothing"
    result = run(train_cmd(tiny_data, tmp_path / "run", *ONE_STEP, override,
                           f"train.init_from={source_dir}"), timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "train.init_from" in result.stderr and differs in result.stderr
