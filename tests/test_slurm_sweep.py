"""Sweeps, fits and launcher pieces that need no Slurm: expansion, validation, injection
safety, the scaling-law fits on synthetic data, and `python -m slurm fit` on a synthetic
MLflow store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from parallel.primitives.groups import free_port
from slurm.launch import EXIT_PREEMPTED, combine_statuses, training_overrides
from slurm.scaling import compute_multiplier, fit_compute_law, fit_params_tokens
from slurm.sweep import sbatch_command
from slurm.sweep_spec import SweepError, expand
from tests.conftest import ROOT, cli_env

TINY_SWEEP = ROOT / "configs/sweeps/tiny-cpu.yaml"


def write_sweep(tmp_path: Path, file: str = "sweep.yaml", **changes) -> Path:
    spec = yaml.safe_load(TINY_SWEEP.read_text())
    spec["base"] = str(ROOT / "configs/tiny.yaml")
    for key, value in changes.items():
        if value is None:
            spec.pop(key, None)
        else:
            spec[key] = value
    path = tmp_path / file
    path.write_text(yaml.safe_dump(spec))
    return path


# ---------------------------------------------------------------------------------------
# Launcher pieces


def test_launcher_without_scontrol_names_it(tmp_path):
    """Node lists are expanded by `scontrol show hostnames` (tests/test_slurm.py runs it);
    without scontrol on PATH the launcher exits 2 naming it and the way around it."""
    env = {**cli_env(), "PATH": str(tmp_path), "SLURM_JOB_NODELIST": "gpu[07-09]",
           "SLURM_JOB_ID": "123"}
    env.pop("DENSEFORMER_RDZV_HOST", None)
    done = subprocess.run([sys.executable, "-m", "slurm", "launch", "--config",
                           str(ROOT / "configs/tiny.yaml")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "scontrol is not on PATH" in done.stderr, done.stderr
    assert "gpu[07-09]" in done.stderr and "DENSEFORMER_RDZV_HOST" in done.stderr


@pytest.mark.parametrize("task_id", ["", "7"])
def test_launcher_refuses_a_missing_sweep_or_task(tmp_path, task_id):
    """The sweep's own error (SweepError, no import of the launcher) ends the launcher with 2."""
    env = {**cli_env(), "SLURM_ARRAY_TASK_ID": task_id}
    sweep_dir = tmp_path / "sweep"
    if task_id:  # a manifest of one run: task 7 does not exist
        sweep_dir.mkdir()
        (sweep_dir / "sweep.json").write_text(json.dumps({"sweep": "s", "runs": [{}]}))
    done = subprocess.run([sys.executable, "-m", "slurm", "launch", "--sweep", str(sweep_dir),
                           "--rdzv-host", "127.0.0.1"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    expected = "SLURM_ARRAY_TASK_ID in 0..0, got '7'" if task_id else "cannot read sweep.json"
    assert "launcher: error: --sweep" in done.stderr and expected in done.stderr, done.stderr


def test_node_status_tells_preemption_from_failure():
    from pretrain.signals import EXIT_PREEMPTED as TRAINER_PREEMPTED

    assert EXIT_PREEMPTED == TRAINER_PREEMPTED
    assert combine_statuses(0, {"0": 0, "1": 0}) == 0
    assert combine_statuses(1, {"0": 75, "1": 75}) == 75  # torchrun calls 75 a failure
    assert combine_statuses(1, {"0": 75, "1": 0}) == 75
    assert combine_statuses(1, {"0": 75, "1": 3}) == 3
    assert combine_statuses(1, {}) == 1  # nothing started (e.g. rendezvous timeout)
    assert combine_statuses(0, {"0": 0, "1": 2}) == 2


def test_requeued_job_resumes_in_a_stable_run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = str(ROOT / "configs/tiny.yaml")
    env = {"SLURM_JOB_ID": "4242"}
    first = training_overrides(config, ["train.steps=50"], env)
    assert first == ["train.steps=50", f"run.dir={tmp_path / 'runs/tiny-4242'}",
                     "train.resume=auto"]
    again = training_overrides(config, ["train.steps=50"], {**env, "SLURM_RESTART_COUNT": "1"})
    assert again == first
    explicit = training_overrides(config, ["run.dir=/x", "train.resume=/x/checkpoints/a"],
                                  {**env, "SLURM_RESTART_COUNT": "2"})
    assert explicit == ["run.dir=/x", "train.resume=/x/checkpoints/a", "train.resume=auto"]
    array = training_overrides(config, [], {**env, "SLURM_ARRAY_JOB_ID": "7",
                                            "SLURM_ARRAY_TASK_ID": "3"})
    assert array[0] == f"run.dir={tmp_path / 'runs/tiny-7_3'}"
    # resume=auto without run.dir is refused by the trainer, not here: the job supplies one.
    asked = training_overrides(config, ["train.resume=auto"], env)
    assert asked == ["train.resume=auto", f"run.dir={tmp_path / 'runs/tiny-4242'}"]


@pytest.mark.timeout(120)
def test_a_signal_during_start_up_is_delivered_to_the_trainer():
    code = """
import os, signal, sys, time
from slurm.worker import EarlySignals
early = EarlySignals(); early.install()
os.kill(os.getpid(), signal.SIGUSR1)       # arrives before the trainer's handlers exist
time.sleep(0.3)
from pretrain.signals import StopRequest
with StopRequest() as stop:
    deadline = time.time() + 10
    while stop.received is None and time.time() < deadline:
        time.sleep(0.05)
print("received", stop.received)
"""
    done = subprocess.run([sys.executable, "-c", code], env=cli_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    assert f"received {int(__import__('signal').SIGUSR1)}" in done.stdout


# ---------------------------------------------------------------------------------------
# Sweeps


def test_tiny_sweep_expands_with_n_d_c(tmp_path, tiny_data):
    sweep = expand(TINY_SWEEP, [f"data.path={tiny_data}"], out=tmp_path / "out")
    assert [r.name for r in sweep.runs] == [
        "tiny-cpu-transformer-L2-W32-D5.12k-s0", "tiny-cpu-transformer-L2-W48-D5.12k-s0",
        "tiny-cpu-denseformer-1x1-L2-W32-D5.12k-s0", "tiny-cpu-denseformer-1x1-L2-W48-D5.12k-s0"]
    for run in sweep.runs:
        cfg = run.config
        assert run.tokens == cfg.train.steps * cfg.train.batch_size * cfg.model.seq_len == 5120
        model = cfg.model.with_vocab(512)
        assert run.n_params == model.num_params(non_embedding=True)
        assert run.compute == 6 * run.n_params * run.tokens
        assert cfg.tracking.experiment == "sweep-tiny-cpu"
        assert cfg.tracking.uri == f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}"
        assert cfg.run.dir == str(tmp_path / "out" / "runs" / run.name)
        assert cfg.optim.warmup_steps == 2 and run.memory_bytes > 0
    assert sweep.runs[2].config.model.dwa and not sweep.runs[0].config.model.dwa
    assert sweep.runs[2].n_params > sweep.runs[0].n_params  # the alphas
    again = expand(TINY_SWEEP, [f"data.path={tiny_data}"], out=tmp_path / "out")
    assert [r.name for r in again.runs] == [r.name for r in sweep.runs]  # stable
    command = sbatch_command(sweep, sweep.out)
    assert "--array=0-3%2" in command and command[-2:] == ["--sweep", str(sweep.out)]


@pytest.mark.timeout(120)
def test_dry_run_prints_the_table_and_writes_nothing(tmp_path, tiny_data):
    done = subprocess.run(
        [sys.executable, "-m", "slurm", "sweep", str(TINY_SWEEP), "--dry-run",
         "--out", str(tmp_path / "out"), "--set", f"data.path={tiny_data}"],
        env=cli_env(), cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    for text in ("4 runs", "C=6ND", "mem/rank", "an estimate", "--array=0-3%2",
                 "tiny-cpu-denseformer-1x1-L2-W48-D5.12k-s0"):
        assert text in done.stdout
    assert not (tmp_path / "out").exists()


def test_paper_sweep_uses_isoflop_budgets():
    sweep = expand(ROOT / "configs/sweeps/paper-owt2.yaml")
    assert len(sweep.runs) == 36
    budgets = sorted({round(r.compute, -16) for r in sweep.runs})
    assert len(budgets) == 3
    for run in sweep.runs:
        assert run.compute == pytest.approx(min(budgets, key=lambda b: abs(b - run.compute)),
                                            rel=1e-4)
        assert run.memory_bytes is not None and run.config.train.steps > 1000
    assert "--gpus-per-node=8" in sbatch_command(sweep, sweep.out)


@pytest.mark.timeout(120)
def test_sweep_memory_is_the_validated_estimator_and_stays_torch_free():
    """mem/rank is parallel.strategies.memory's fullest rank (the estimator tests/test_memory.py
    checks against autograd), not a formula of its own; expanding the sweep imports no torch."""
    code = ("import json, sys; from slurm.sweep_spec import expand; "
            "s = expand('configs/sweeps/paper-owt2.yaml'); "
            "assert 'torch' not in sys.modules, 'expanding the sweep imported torch'; "
            "print(json.dumps([r.memory_bytes for r in s.runs]))")
    done = subprocess.run([sys.executable, "-c", code], env=cli_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    from parallel.strategies.memory import estimate

    sweep = expand(ROOT / "configs/sweeps/paper-owt2.yaml")
    world = sweep.slurm["nodes"] * sweep.slurm["nproc_per_node"]
    printed = json.loads(done.stdout)
    assert len(printed) == len(sweep.runs) == 36
    for run, memory in zip(sweep.runs, printed, strict=True):
        c = run.config
        ranks = estimate(c.parallel, c.model, c.train.batch_size, c.train.dtype, world, "cuda",
                         c.optim.decay_alphas)
        assert memory == run.memory_bytes == max(r.total_bytes for r in ranks), run.name


def test_compute_with_tokens_per_param_picks_one_shape_per_budget(tmp_path):
    shapes = {"architecture": ["transformer"], "depth": [2], "width": [32, 64, 128],
              "head_dim": 16}
    every = expand(write_sweep(tmp_path, "all.yaml", grid={**shapes, "tokens": [5120]}),
                   ["model.vocab_size=512"], out=tmp_path / "all")
    n_of_width = {r.values["d_model"]: r.n_params for r in every.runs}
    budgets = [1e11, 1e13]
    path = write_sweep(tmp_path, grid={**shapes, "compute": budgets, "tokens_per_param": 20})
    sweep = expand(path, ["model.vocab_size=512"], out=tmp_path / "out")
    assert len(sweep.runs) == 2
    for run, budget in zip(sweep.runs, budgets, strict=True):
        best = (budget / (6 * 20)) ** 0.5  # N with D = 20 N at this budget
        nearest = min(n_of_width, key=lambda w: abs(np.log(n_of_width[w] / best)))
        assert run.values["d_model"] == nearest
        assert run.compute == pytest.approx(budget, rel=0.05)
    assert sweep.runs[0].values["d_model"] < sweep.runs[1].values["d_model"]


@pytest.mark.parametrize("changes,message", [
    ({"name": "x; rm -rf /"}, "name: 'x; rm -rf /' is not a valid name"),
    ({"name": "$(touch /tmp/pwned)"}, "is not a valid name"),
    ({"grid": {"architecture": [{"name": "a`id`", "set": {"model.dwa": False}}],
               "shape": [{"d_model": 32}], "tokens": [5120]}}, "grid.architecture.name"),
    ({"experiment": "e\nx"}, "experiment"),
    ({"slurm": {"extra_args": ["--wrap=rm -rf /"]}}, "slurm.extra_args"),
    ({"slurm": {"partition": "a b"}}, "slurm.partition"),
    ({"grid": {"shape": [{"d_model": 32}], "tokens": [5120], "compute": [1e9]}},
     "exactly one budget"),
    ({"grid": {"shape": [{"d_model": 32}]}}, "exactly one budget"),
    ({"grid": {"tokens": [5120]}}, "needs shape"),
    ({"grid": {"architecture": ["denseformer-4"], "shape": [{"d_model": 32}],
               "tokens": [5120]}}, "denseformer-KxP"),
    ({"grid": {"shape": [{"d_model": 30}], "tokens": [5120]}}, "model.n_heads"),
    ({"grid": {"shape": [{"d_model": 32}], "tokens": [-1]}}, "grid.tokens"),
    ({"grid": {"shape": [{"d_model": 32}], "tokens": [5120], "depth": [2]}}, "not both"),
    ({"grid": {"shape": [{"d_model": 32}], "tokens": [5120, 5130]}}, "several runs"),
    ({"gird": {}}, "unknown keys ['gird']"),
    ({"set": {"train.stepz": 3}}, "train.stepz"),
    ({"warmup_fraction": None, "set": {"optim.warmup_steps": 50}}, "optim.warmup_steps"),
    ({"base": "missing.yaml"}, "does not exist"),
])
def test_invalid_or_unsafe_sweeps_are_refused(tmp_path, changes, message):
    path = write_sweep(tmp_path, **changes)
    with pytest.raises(SweepError) as err:
        expand(path, ["model.vocab_size=512"], out=tmp_path / "out")
    assert message in str(err.value)


def test_unsafe_out_dir_is_refused_and_the_cli_exits_2(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "slurm", "sweep", str(write_sweep(tmp_path, name="a;b")),
         "--dry-run"], env=cli_env(), cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert done.returncode == 2 and "not a valid name" in done.stderr
    from slurm.sweep import write_sweep as write_dir

    sweep = expand(write_sweep(tmp_path), ["model.vocab_size=512"], out=tmp_path / "100%x")
    with pytest.raises(SweepError, match="'%' is not allowed"):
        write_dir(sweep)


# ---------------------------------------------------------------------------------------
# Fits


def test_fits_recover_known_exponents_within_5_percent():
    rng = np.random.default_rng(0)
    n, d = (a.ravel() for a in np.meshgrid(np.geomspace(1e7, 1e9, 5),
                                           np.geomspace(1e8, 1e10, 5)))
    truth = dict(E=1.69, A=406.4, a=0.34, B=410.7, b=0.28)
    loss = (truth["E"] + truth["A"] / n ** truth["a"] + truth["B"] / d ** truth["b"]) \
        * np.exp(rng.normal(0, 0.003, n.shape))
    fit = fit_params_tokens(n, d, loss)
    assert fit.a == pytest.approx(truth["a"], rel=0.05)
    assert fit.b == pytest.approx(truth["b"], rel=0.05)
    assert fit.E == pytest.approx(truth["E"], rel=0.05)
    assert np.isfinite(list(fit.errors.values())).all()

    compute = np.geomspace(1e15, 1e19, 8)
    base = fit_compute_law(compute, 40 * compute ** -0.05 * np.exp(rng.normal(0, 0.003, 8)))
    assert base.alpha == pytest.approx(0.05, rel=0.05) and base.alpha_err < 0.005
    # An architecture that is as good as the baseline with 1.5x the compute.
    dense = fit_compute_law(compute, 40 * (1.5 * compute) ** -0.05
                            * np.exp(rng.normal(0, 0.003, 8)))
    (m,) = compute_multiplier(dense, base, [1e17])
    assert m.value == pytest.approx(1.5, rel=0.2) and m.low < m.value < m.high


@pytest.mark.timeout(200)
def test_fit_command_on_a_synthetic_store(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("synthetic",
                                          artifact_location=(tmp_path / "art").as_uri())
    rng = np.random.default_rng(1)
    for arch, gain in (("transformer", 1.0), ("denseformer-1x1", 1.3)):
        for n in np.geomspace(1e6, 1e8, 3):
            for d in np.geomspace(1e8, 1e10, 3):
                loss = (1.7 + 400 / n ** 0.34 + 410 / (gain * d) ** 0.28) \
                    * np.exp(rng.normal(0, 0.002))
                run = client.create_run(experiment, tags={
                    "architecture": arch, "N": str(int(n)), "D": str(int(d)),
                    "C": str(6 * n * d), "sweep_id": "syn"})
                client.log_metric(run.info.run_id, "val_loss", float(loss), step=10)
                client.set_terminated(run.info.run_id, "FINISHED")
    client.create_run(experiment, tags={"architecture": "transformer", "N": "1",
                                                     "D": "1", "C": "6"})
    from slurm.__main__ import main

    status = main(["fit", "--experiment", "synthetic", "--tracking-uri", uri, "--out",
                   str(tmp_path / "fit"), "--budgets", "1e15,1e17"])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert "L(N, D) = E + A/N^a + B/D^b" in out
    assert "denseformer-1x1 at C = 1e+15" in out
    assert "status RUNNING" in err  # the unfinished run is skipped, and said so
    for name in ("loss_vs_compute.png", "loss_vs_compute_transformer.png",
                 "loss_vs_compute_denseformer-1x1.png", "fit.json"):
        assert (tmp_path / "fit" / name).stat().st_size > 500
    fits = client.search_runs([experiment], filter_string="tags.kind = 'scaling_fit'")
    assert len(fits) == 1
    assert fits[0].data.metrics["a.transformer"] == pytest.approx(0.34, rel=0.1)
    artifacts = {a.path for a in client.list_artifacts(fits[0].info.run_id, "scaling_fit")}
    assert "scaling_fit/loss_vs_compute.png" in artifacts

    assert main(["fit", "--experiment", "nope", "--tracking-uri", uri]) == 2
    assert "no experiment named 'nope'" in capsys.readouterr().err


def kill_everything_of(launcher: subprocess.Popen, marker: str) -> None:
    """SIGKILL the launcher's process group and the ranks (torchrun starts each in a session
    of its own), found by `marker` in their command line."""
    os.killpg(launcher.pid, signal.SIGKILL)
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
            if proc.name.isdigit() and marker.encode() in cmdline:
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue


@pytest.mark.timeout(300)
def test_sweep_tags_are_on_the_run_while_training_and_after_a_kill(tmp_path, tiny_data):
    """A task killed at its time limit never reaches its end: its MLflow run must carry the
    sweep's tags from the start, so that `slurm fit` reports it instead of not seeing it."""
    from mlflow.tracking import MlflowClient

    from slurm.sweep import write_sweep as write_dir

    sweep = expand(TINY_SWEEP, [f"data.path={tiny_data}"], out=tmp_path / "sweep")
    write_dir(sweep)
    manifest = json.loads((sweep.out / "sweep.json").read_text())
    entry = manifest["runs"][1]
    port = free_port()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "slurm", "launch", "--sweep", str(sweep.out),
         "--nproc-per-node", "1", "--rdzv-host", "127.0.0.1", "--rdzv-port", str(port),
         "--set", "train.steps=100000"],  # still training when it is killed
        env={**cli_env(), "SLURM_ARRAY_TASK_ID": "1"}, cwd=ROOT, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        metrics = Path(entry["run_dir"]) / "metrics.jsonl"
        deadline = time.monotonic() + 200
        while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        client = MlflowClient(manifest["tracking_uri"])
        experiment = client.get_experiment_by_name(manifest["experiment"])
        (run,) = client.search_runs([experiment.experiment_id])
        assert run.info.status == "RUNNING" and run.info.run_name == entry["name"]
        assert entry["tags"].items() <= run.data.tags.items()  # while it trains
    finally:
        kill_everything_of(launcher, str(sweep.out))  # as Slurm does at the time limit
        launcher.communicate(timeout=60)

    run = client.get_run(run.info.run_id)
    assert run.info.status == "RUNNING" and entry["tags"].items() <= run.data.tags.items()
    fitted = subprocess.run(
        [sys.executable, "-m", "slurm", "fit", "--experiment", manifest["experiment"],
         "--tracking-uri", manifest["tracking_uri"], "--out", str(tmp_path / "fit")],
        env=cli_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert fitted.returncode == 2, fitted.stderr
    assert f"skipped {entry['name']}: unfinished, status RUNNING" in fitted.stderr
    assert "1 run(s) with sweep tags are unfinished" in fitted.stderr


def test_paper_sweep_expands(tmp_path):
    """The GPU example sweep is valid: every run resolves to a loadable config."""
    sweep = expand(ROOT / "configs/sweeps/paper-owt2.yaml", [], out=tmp_path / "out")
    assert len(sweep.runs) >= 2
    assert len({run.name for run in sweep.runs}) == len(sweep.runs)
