"""Slurm launchers against real processes: the multi-node launcher as two local "nodes", and
sbatch, job arrays and preemption on a single-node Slurm cluster started for this module
(slurm/local_cluster.sh; needs root and Debian's slurm-wlm + munge, which
slurm/install_ci_deps.sh installs)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest

from parallel.primitives.groups import free_port
from tests.conftest import ROOT, cli_env

STEPS = 300  # long enough to signal a run mid-way; shorter tests stop at STOP_AT
STOP_AT = 40
TINY = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=32",
        "train.batch_size=8", "optim.lr=3e-3", "optim.min_lr=3e-4", "optim.warmup_steps=2",
        "data.val_batches=2", "train.log_every=50", "train.eval_every=0", "checkpoint.every=0",
        "checkpoint.keep=2", f"train.steps={STEPS}"]


def sets(*overrides: str) -> list[str]:
    return [x for o in overrides for x in ("--set", o)]


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory) -> dict[int, float]:
    """Losses of the 2-rank run launched directly with torchrun (no Slurm, no launcher)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "pretrain", "train", "--config", str(ROOT / "configs/tiny.yaml"),
           *sets(*TINY, f"data.path={tiny_data}", f"run.dir={run_dir}",
                 "tracking.enabled=false")]
    done = subprocess.run(cmd, cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    curve = losses(run_dir)
    assert sorted(curve) == list(range(1, STEPS + 1))
    return curve


# ---------------------------------------------------------------------------------------
# The multi-node launcher, two "nodes" on this machine (no Slurm needed)


def launcher_cmd(data: Path, run_dir: Path, node_rank: int, port: int, join_timeout: int,
                 *extra: str) -> list[str]:
    return [sys.executable, "-m", "slurm", "launch", "--config", str(ROOT / "configs/tiny.yaml"),
            *sets(*TINY, f"data.path={data}", f"run.dir={run_dir}", "tracking.enabled=false",
                  *extra),
            "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "1",
            "--rdzv-host", "127.0.0.1", "--rdzv-port", str(port), "--rdzv-id", "test",
            "--join-timeout", str(join_timeout)]


@pytest.mark.timeout(300)
def test_two_nodes_match_the_single_node_two_rank_run(tiny_data, tmp_path, reference):
    run_dir, port = tmp_path / "run", free_port()
    nodes = [subprocess.Popen(launcher_cmd(tiny_data, run_dir, rank, port, 60,
                                           f"train.stop_at={STOP_AT}"),
                              cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outputs = [node.communicate(timeout=240) for node in nodes]
    for node, (_, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err[-3000:]
    assert "node 1 of 2" in outputs[1][1] and "c10d rendezvous 127.0.0.1" in outputs[0][1]
    got = losses(run_dir)
    assert sorted(got) == list(range(1, STOP_AT + 1))
    assert got == pytest.approx({s: reference[s] for s in got}, abs=1e-6)


@pytest.mark.timeout(180)
def test_a_node_that_never_joins_fails_with_a_rendezvous_timeout(tiny_data, tmp_path):
    start = time.monotonic()
    alone = subprocess.run(launcher_cmd(tiny_data, tmp_path / "run", 0, free_port(), 20),
                           cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                           timeout=150)
    elapsed = time.monotonic() - start
    assert alone.returncode != 0
    assert "RendezvousTimeoutError" in alone.stderr
    assert "rendezvous at 127.0.0.1" in alone.stderr and "join timeout of 20s" in alone.stderr
    assert elapsed < 120, f"took {elapsed:.0f}s: the join timeout did not apply"
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---------------------------------------------------------------------------------------
# A real single-node Slurm cluster


def _loud_skip(reason: str) -> None:
    message = f"Slurm tests SKIPPED: {reason}"
    warnings.warn(message, pytest.PytestWarning, stacklevel=2)
    print(f"\n*** {message} ***", file=sys.stderr)
    pytest.skip(message)


@pytest.fixture(scope="module")
def cluster():
    """A private single-node Slurm (own state dir, ports and munge socket); SLURM_CONF path."""
    if os.geteuid() != 0:
        _loud_skip("they need root to run slurmd (run the suite as root, as CI does)")
    if not all(shutil.which(t) for t in ("slurmctld", "slurmd", "munged", "sbatch")):
        if not shutil.which("apt-get"):
            _loud_skip("slurm-wlm/munge are missing and apt-get is not available")
        installed = subprocess.run(["bash", str(ROOT / "slurm/install_ci_deps.sh")],
                                   capture_output=True, text=True, timeout=900)
        assert installed.returncode == 0, f"slurm/install_ci_deps.sh: {installed.stderr}"
    # munge needs a world-searchable path to its socket, so not pytest's 0700 tmp dirs.
    state = Path(tempfile.mkdtemp(prefix="denseformer-slurm-test-", dir="/tmp"))
    state.chmod(0o755)
    env = dict(os.environ, SLURM_LOCAL_DIR=str(state),
               SLURM_LOCAL_CTLD_PORT=str(free_port()), SLURM_LOCAL_SLURMD_PORT=str(free_port()))
    script = ["bash", str(ROOT / "slurm/local_cluster.sh")]
    started = subprocess.run([*script, "start"], env=env, capture_output=True, text=True,
                             timeout=120)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        again = subprocess.run([*script, "start"], env=env, capture_output=True, text=True,
                               timeout=60)
        assert again.returncode == 0, again.stderr  # idempotent
        status = subprocess.run([*script, "status"], env=env, capture_output=True, text=True,
                                timeout=60)
        assert status.returncode == 0 and "slurmd: running" in status.stdout, status.stdout
        yield state / "slurm.conf"
    finally:
        subprocess.run([*script, "stop"], env=env, capture_output=True, text=True, timeout=120)
        stopped = subprocess.run([*script, "status"], env=env, capture_output=True, text=True,
                                 timeout=60)
        shutil.rmtree(state, ignore_errors=True)
    assert stopped.returncode == 3, stopped.stdout  # all three daemons gone


def slurm_env(conf: Path, **extra: str) -> dict[str, str]:
    return {**cli_env(), "SLURM_CONF": str(conf), "DENSEFORMER_PYTHON": sys.executable,
            **extra}


def slurm(conf: Path, *args: str, timeout: float = 60) -> str:
    done = subprocess.run(list(args), env=slurm_env(conf), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{args}: {done.stderr}"
    return done.stdout


def job_field(conf: Path, job: str, name: str) -> str:
    text = slurm(conf, "scontrol", "show", "job", job)
    return text.split(f"{name}=")[1].split()[0]


def wait_for_job(conf: Path, job: str, timeout: float) -> None:
    """Until no task of `job` is pending or running (a requeued job counts as pending)."""
    deadline = time.monotonic() + timeout
    while slurm(conf, "squeue", "-h", "-j", job).strip():
        assert time.monotonic() < deadline, f"job {job} still queued after {timeout}s"
        time.sleep(1)


def sbatch_training(conf: Path, data: Path, run_dir: Path, log_dir: Path, *extra: str,
                    mode: str = "torchrun") -> str:
    """Submit train.sbatch for 2 ranks: one task running torchrun, or two srun tasks."""
    layout = ["--cpus-per-task=2"] if mode == "torchrun" else ["--ntasks-per-node=2"]
    out = subprocess.run(
        ["sbatch", "--parsable", *layout, f"--output={log_dir}/%x-%j.out",
         str(ROOT / "slurm/train.sbatch"), str(ROOT / "configs/tiny.yaml"),
         *sets(*TINY, f"data.path={data}", f"run.dir={run_dir}", *extra)],
        env=slurm_env(conf, DENSEFORMER_NPROC_PER_NODE="2", DENSEFORMER_LAUNCHER=mode),
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


@pytest.mark.timeout(120)
def test_node_lists_are_expanded_by_scontrol(cluster):
    from slurm.launch import LaunchError, node_hosts

    env = slurm_env(cluster)
    assert node_hosts("vm", env) == ["vm"]
    assert node_hosts("gpu[07-09,12],cpu1", env) == ["gpu07", "gpu08", "gpu09", "gpu12", "cpu1"]
    assert node_hosts("rack[2-3]-n[001-002]", env) == [
        "rack2-n001", "rack2-n002", "rack3-n001", "rack3-n002"]
    for bad in ("bad host;rm", "a[1-", " "):  # scontrol turns the first two into odd names
        with pytest.raises(LaunchError, match="SLURM_JOB_NODELIST"):
            node_hosts(bad, env)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["torchrun", "srun"])
def test_sbatch_two_ranks_matches_the_direct_run(cluster, tiny_data, tmp_path, reference, mode):
    run_dir = tmp_path / "run"
    job = sbatch_training(cluster, tiny_data, run_dir, tmp_path, f"train.stop_at={STOP_AT}",
                          "tracking.enabled=false", mode=mode)
    wait_for_job(cluster, job, 240)
    log = (tmp_path / f"denseformer-{job}.out").read_text()
    assert job_field(cluster, job, "JobState") == "COMPLETED", log[-3000:]
    assert job_field(cluster, job, "ExitCode") == "0:0"
    assert ("2 ranks per node" if mode == "torchrun" else "rank 1 of 2") in log
    assert "training exited with status 0" in log
    got = losses(run_dir)
    assert sorted(got) == list(range(1, STOP_AT + 1))
    assert got == pytest.approx({s: reference[s] for s in got}, abs=1e-6)


@pytest.mark.timeout(240)
def test_sbatch_exit_status_reflects_a_bad_config(cluster, tiny_data, tmp_path):
    """Exit 2, and the log's last line is the status with the one-line cause: refused by the
    launcher (a bad config) or by the ranks (missing data), no torchrun traceback after it."""
    job = sbatch_training(cluster, tiny_data, tmp_path / "run", tmp_path, "model.n_heads=3")
    missing = tmp_path / "nope"
    ranks = sbatch_training(cluster, missing, tmp_path / "run2", tmp_path)
    for job_id, cause in ((job, "model.n_heads: "),
                          (ranks, f"{missing}: not a directory (expected a prepared dataset)")):
        wait_for_job(cluster, job_id, 100)
        log = (tmp_path / f"denseformer-{job_id}.out").read_text()
        assert job_field(cluster, job_id, "JobState") == "FAILED", log
        assert job_field(cluster, job_id, "ExitCode") == "2:0"
        assert "requeue" not in log and "Traceback" not in log, log
        last = log.strip().splitlines()[-1]
        assert last.split("] ", 1)[1].startswith(f"training exited with status 2: {cause}"), log


# Slow: tests/test_study_run.py submits a job array (and dependent jobs) on the local Slurm
# and reads every run back in its default test; the fit is checked on exact laws in
# tests/test_study_report.py.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_job_array_lands_four_runs_in_one_experiment_and_fits(cluster, tiny_data, tmp_path):
    out = tmp_path / "sweep"
    submitted = subprocess.run(
        [sys.executable, "-m", "slurm", "sweep", str(ROOT / "configs/sweeps/tiny-cpu.yaml"),
         "--submit", "--out", str(out), "--set", f"data.path={tiny_data}"],
        env=slurm_env(cluster), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.split("submitted job array ")[1].split()[0]
    manifest = json.loads((out / "sweep.json").read_text())
    assert len(manifest["runs"]) == 4
    wait_for_job(cluster, job, 270)
    logs = sorted((out / "logs").glob("*.out"))
    assert len(logs) == 4
    for log in logs:
        assert "training exited with status 0" in log.read_text(), log.read_text()[-3000:]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(manifest["tracking_uri"])
    experiment = client.get_experiment_by_name(manifest["experiment"])
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 4
    by_name = {r.data.tags["mlflow.runName"]: r for r in runs}
    assert set(by_name) == {r["name"] for r in manifest["runs"]}
    for entry in manifest["runs"]:
        run = by_name[entry["name"]]
        assert run.info.status == "FINISHED"
        assert run.data.tags["sweep_id"] == "tiny-cpu"
        assert run.data.tags["architecture"] == entry["architecture"]
        assert int(run.data.tags["N"]) == entry["N"] and int(run.data.tags["D"]) == entry["D"]
        assert float(run.data.tags["C"]) == pytest.approx(6 * entry["N"] * entry["D"], rel=1e-5)
        assert "val_loss" in run.data.metrics

    fitted = subprocess.run(
        [sys.executable, "-m", "slurm", "fit", "--experiment", manifest["experiment"],
         "--tracking-uri", manifest["tracking_uri"], "--out", str(tmp_path / "fit")],
        env=cli_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert fitted.returncode == 0, fitted.stderr
    # Two widths at one D: 2 budgets within 2x, too few for a law (3+ spanning 4x); said so.
    assert "no L(C) fit: 2 distinct compute budget(s)" in fitted.stdout
    assert "compute multiplier: none" in fitted.stdout
    assert (tmp_path / "fit" / "loss_vs_compute_denseformer-1x1.png").stat().st_size > 1000


@pytest.mark.timeout(360)
def test_preempted_job_requeues_and_resumes_to_the_same_result(cluster, tiny_data, tmp_path,
                                                              reference):
    run_dir = tmp_path / "run"
    job = sbatch_training(cluster, tiny_data, run_dir, tmp_path)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and metrics.read_text().count("\n") >= 5):
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.2)
    slurm(cluster, "scancel", "--signal=USR1", "--batch", job)
    # A second signal while the first is being handled (maybe while saving) changes nothing.
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm_env(cluster),
                   capture_output=True, timeout=60)
    wait_for_job(cluster, job, 300)
    log = (tmp_path / f"denseformer-{job}.out").read_text()
    assert job_field(cluster, job, "JobState") == "COMPLETED", log[-3000:]
    assert job_field(cluster, job, "Restarts") == "1"
    # The line is written before `scontrol requeue`, which ends the batch script at once.
    assert "SLURM_RESTART_COUNT=1" in log and f"requeueing job {job}:" in log
    assert log.index(f"requeueing job {job}:") < log.index("SLURM_RESTART_COUNT=1")
    resumed_at = int(log.split("resuming from ")[1].split("(step ")[1].split(")")[0])
    assert 1 <= resumed_at < STEPS  # stopped mid-run, at a step boundary

    assert losses(run_dir) == pytest.approx(reference, abs=1e-6)  # every step, final included
    from pretrain.checkpoint import latest_checkpoint, read_meta

    meta = read_meta(latest_checkpoint(run_dir / "checkpoints"))
    assert meta["step"] == STEPS
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.run_id for r in runs] == [meta["mlflow_run_id"]]  # the same MLflow run
    assert runs[0].info.status == "FINISHED" and runs[0].data.tags["resume_count"] == "1"
