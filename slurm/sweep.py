"""`python -m slurm sweep SWEEP.yaml --dry-run | --submit`: one job array per sweep.

--submit first runs every task's start-up checks (slurm/preflight.py; --no-preflight skips
them) and exits 2 naming the task and the key before anything is written or queued; then it
writes the sweep directory (default runs/sweeps/<name>, or --out):

    sweep.json          the manifest: every run's name, config, run dir, N, D, C, MLflow tags
    configs/<run>.yaml  each run's resolved training config (run.dir, tracking set)
    runs/<run>/         the run directories (written by training)
    logs/               one Slurm log per array task: <sweep>-<array job>_<task>.out
    mlflow.db           the default MLflow store (sqlite), unless tracking_uri is given

creates the MLflow experiment, and submits slurm/train.sbatch as one job array
(--array=0-<n-1>%<max_parallel>) whose task i trains run i (`--sweep DIR`: the launcher
reads the manifest). The runs of a dependent stage (`continue:`, slurm/sweep_stages.py) are
submitted after it, each as a one-task array `--array=<i>` with
`--dependency=afterok:<array job>_<parent task> --kill-on-invalid-dep=yes`: it starts when
its parent finished and is cancelled by Slurm if the parent failed. The experiment carries
the tag `sweep_manifest` (the path of sweep.json), so that `python -m slurm report` can name
runs that never started. Each task's MLflow run carries the sweep's tags (sweep_id,
architecture, N, D, C, ...) from the moment training creates it (the launcher passes them in
$DENSEFORMER_MLFLOW_TAGS), so `python -m slurm fit` sees every task, an unfinished one too;
after each task the launcher adds its exit_status. Submitting the same sweep again resubmits
it: finished runs end at once, interrupted ones resume.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from pretrain.checkpoint import latest_checkpoint
from pretrain.config import save_config
from pretrain.tracking import ensure_experiment, mlflow_client
from slurm.preflight import format_problems, preflight
from slurm.sweep_spec import Sweep, SweepError, check_name, expand
from slurm.sweep_stages import follow_up_commands

MANIFEST = "sweep.json"
REPO_ROOT = Path(__file__).resolve().parent.parent
TRAIN_SBATCH = REPO_ROOT / "slurm" / "train.sbatch"


def format_table(sweep: Sweep) -> str:
    """The runs with N, D, C and the estimated memory per rank, one line each."""
    width = max([len(r.name) for r in sweep.runs] + [3])
    arch = max([len(r.architecture) for r in sweep.runs] + [4])
    header = (f"{'#':>3}  {'run':<{width}} {'arch':<{arch}} {'L':>3} {'W':>5} {'N':>10} "
              f"{'D':>10} {'steps':>7} {'C=6ND':>10} {'FLOPs':>10} {'mem/rank':>9}")
    lines = [f"sweep {sweep.name}: {len(sweep.runs)} runs from {sweep.path}", header]
    for run in sweep.runs:
        memory = _bytes(run.memory_bytes) if run.memory_bytes is not None else "n/a"
        lines.append(
            f"{run.index:>3}  {run.name:<{width}} {run.architecture:<{arch}} "
            f"{run.values['n_layers']:>3} {run.values['d_model']:>5} {run.n_params:>10.4g} "
            f"{run.tokens:>10.4g} {run.config.train.steps:>7} {run.compute:>10.3e} "
            f"{run.model_flops:>10.3e} {memory:>9}")
    for run in sweep.runs:
        if run.depends_on is not None:
            lines.append(f"  run {run.index} starts after run {run.depends_on} "
                         f"(train.init_from={sweep.runs[run.depends_on].config.run.dir})")
    lines.append("N: non-embedding parameters; D: tokens = steps x batch x seq_len; "
                 "C = 6 N D FLOPs; FLOPs: flops_per_token() x D (attention, LM head and "
                 "depth connections included); mem/rank: an estimate of the fullest rank "
                 "(python -m parallel.strategies.memory: weights, gradients, AdamW, "
                 "activations), n/a until the vocabulary is known")
    return "\n".join(lines)


def _bytes(value: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if value >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value / 2**10:.3g}KiB"


def first_stage(sweep: Sweep) -> int:
    """How many runs the first job array holds: those that depend on no other run."""
    return sum(run.depends_on is None for run in sweep.runs)


def sbatch_command(sweep: Sweep, out: Path, array: str | None = None,
                   dependency: str | None = None) -> list[str]:
    """The sbatch argument list (no shell is involved anywhere): by default the array of the
    first stage; `array` and `dependency` for a dependent run."""
    s = sweep.slurm
    array = array or f"0-{first_stage(sweep) - 1}%{s['max_parallel']}"
    command = ["sbatch", "--parsable", f"--array={array}",
               f"--job-name={sweep.name}", f"--output={out / 'logs'}/%x-%A_%a.out",
               f"--chdir={REPO_ROOT}", f"--nodes={s['nodes']}", "--ntasks-per-node=1",
               f"--cpus-per-task={s['cpus_per_task']}",
               f"--signal=B:USR1@{int(s['signal_seconds'])}", "--requeue"]
    if dependency:
        command += [f"--dependency={dependency}", "--kill-on-invalid-dep=yes"]
    if s["gpus_per_node"]:
        command.append(f"--gpus-per-node={int(s['gpus_per_node'])}")
    for key in ("time", "partition", "account"):
        if s[key]:
            command.append(f"--{key}={s[key]}")
    return [*command, *s["extra_args"], str(TRAIN_SBATCH), "--sweep", str(out)]


def manifest_of(sweep: Sweep) -> dict:
    """The sweep.json content: the runs, their configs, run dirs, N, D, C and tags."""
    return {
        "format": 1, "sweep": sweep.name, "source": str(sweep.path), "base": str(sweep.base),
        "experiment": sweep.experiment, "tracking_uri": sweep.tracking_uri,
        "lm_eval": sweep.lm_eval, "inference": sweep.inference,
        "runs": [{"index": r.index, "name": r.name, "architecture": r.architecture,
                  "config": f"configs/{r.name}.yaml", "run_dir": r.config.run.dir,
                  "N": r.n_params, "D": r.tokens, "C": r.compute, "C_model": r.model_flops,
                  "steps": r.config.train.steps, "depends_on": r.depends_on,
                  "tags": r.tags(sweep.name)}
                 for r in sweep.runs]}


def write_sweep(sweep: Sweep) -> Path:
    """Write the manifest and the run configs; refuse a directory holding another sweep."""
    out = sweep.out
    if "%" in str(out):
        raise SweepError(f"out: {out}: '%' is not allowed (Slurm expands it in log names)")
    manifest = manifest_of(sweep)
    existing = out / MANIFEST
    if existing.exists():
        old = json.loads(existing.read_text())
        if [r["name"] for r in old.get("runs", [])] != [r["name"] for r in manifest["runs"]]:
            raise SweepError(f"out: {out} already holds a different sweep ({old.get('sweep')}, "
                             f"{len(old.get('runs', []))} runs); choose another --out")
    (out / "configs").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    for run in sweep.runs:
        save_config(run.config, out / "configs" / f"{run.name}.yaml")
    tmp = existing.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, existing)
    return existing


def submit(sweep: Sweep) -> list[str]:
    """Write the sweep directory, create the experiment, submit the first stage's array and
    then each dependent run; the job ids, the array's first."""
    manifest = write_sweep(sweep)
    client = mlflow_client(sweep.tracking_uri)
    tags = {"sweep_id": sweep.name, "sweep_manifest": str(manifest)}
    experiment_id = ensure_experiment(client, sweep.tracking_uri, sweep.experiment, tags)
    client.set_experiment_tag(experiment_id, "sweep_manifest", str(manifest))
    jobs = [_sbatch(sweep, sbatch_command(sweep, sweep.out))]
    for run in sweep.runs:
        if run.depends_on is not None:
            jobs.append(_sbatch(sweep, sbatch_command(
                sweep, sweep.out, array=str(run.index),
                dependency=f"afterok:{jobs[0]}_{run.depends_on}")))
    return jobs


def _sbatch(sweep: Sweep, command: list[str]) -> str:
    """Run one sbatch command; its job id, logged to <out>/submissions.log."""
    env = {**os.environ, "DENSEFORMER_PYTHON": sys.executable,
           "DENSEFORMER_ROOT": str(REPO_ROOT),
           "DENSEFORMER_NPROC_PER_NODE": str(sweep.slurm["nproc_per_node"])}
    try:
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise SweepError("sbatch not found: run on a Slurm login node (or start "
                         "slurm/local_cluster.sh and export SLURM_CONF)") from None
    if result.returncode != 0:
        raise SweepError(f"sbatch failed ({result.returncode}): {result.stderr.strip()}")
    job_id = result.stdout.strip().split(";")[0]
    with open(sweep.out / "submissions.log", "a") as log:
        log.write(json.dumps({"job_id": job_id, "command": command}) + "\n")
    return job_id


def cmd_sweep(args) -> int:
    """`python -m slurm sweep`: print the table, then submit unless --dry-run."""
    try:
        sweep = expand(args.sweep_file, args.overrides, out=args.out,
                       tracking_uri=args.tracking_uri)
        print(format_table(sweep))
        if args.dry_run:
            print(f"MLflow: experiment {sweep.experiment} in {sweep.tracking_uri}\n"
                  f"would write {sweep.out} and run: "
                  f"{shlex.join(sbatch_command(sweep, sweep.out))}")
            dependent = len(sweep.runs) - first_stage(sweep)
            if dependent:
                print(f"then {dependent} dependent run(s), each: sbatch --array=<i> "
                      "--dependency=afterok:<array job>_<parent> --kill-on-invalid-dep=yes")
            return 0
        if not args.no_preflight:
            problems = preflight(sweep)
            if problems:
                print(format_problems(problems, len(sweep.runs)), file=sys.stderr)
                return 2
        jobs = submit(sweep)
    except SweepError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"submitted job array {jobs[0]} ({first_stage(sweep)} tasks, at most "
          f"{sweep.slurm['max_parallel']} at a time)"
          + (f" and {len(jobs) - 1} dependent job(s) {' '.join(jobs[1:])}"
             if len(jobs) > 1 else "")
          + f"; logs in {sweep.out / 'logs'}\n"
          f"MLflow: experiment {sweep.experiment} in {sweep.tracking_uri}\n"
          f"when done: python -m slurm fit --experiment {sweep.experiment} "
          f"--tracking-uri {shlex.quote(sweep.tracking_uri)}\n"
          f"report: python -m slurm report --experiment {sweep.experiment} "
          f"--tracking-uri {shlex.quote(sweep.tracking_uri)} --out {sweep.out / 'report'}")
    return 0


# ---------------------------------------------------------------------------------------
# The array task side (called by slurm/launch.py)


@dataclass
class SweepTask:
    sweep: str
    name: str
    config_path: Path
    run_dir: Path
    tags: dict[str, str]
    tracking_uri: str
    experiment: str
    lm_eval: dict | None = None
    inference: dict | None = None


def sweep_task(sweep_dir: Path, env: dict) -> SweepTask:
    """The run that this array task trains: entry SLURM_ARRAY_TASK_ID of the manifest."""
    manifest_path = sweep_dir / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as err:
        raise SweepError(f"--sweep {sweep_dir}: cannot read {MANIFEST}: {err}") from None
    index = env.get("SLURM_ARRAY_TASK_ID", "")
    runs = manifest.get("runs", [])
    if not index.isdigit() or int(index) >= len(runs):
        raise SweepError(f"--sweep needs SLURM_ARRAY_TASK_ID in 0..{len(runs) - 1}, "
                          f"got {index!r}")
    run = runs[int(index)]
    name = check_name(run["name"], "run name", r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
    return SweepTask(sweep=manifest["sweep"], name=name,
                     config_path=sweep_dir / run["config"], run_dir=Path(run["run_dir"]),
                     tags=dict(run["tags"]), tracking_uri=manifest["tracking_uri"],
                     experiment=manifest["experiment"], lm_eval=manifest.get("lm_eval"),
                     inference=manifest.get("inference"))


def find_run_id(task: SweepTask, client) -> str | None:
    """The MLflow run of a task: from its latest checkpoint, else by run name."""
    checkpoint = latest_checkpoint(task.run_dir / "checkpoints")
    if checkpoint is not None:
        meta = json.loads((checkpoint / "meta.json").read_text())
        if meta.get("mlflow_run_id"):
            return meta["mlflow_run_id"]
    experiment = client.get_experiment_by_name(task.experiment)
    if experiment is None:
        return None
    runs = client.search_runs([experiment.experiment_id],
                              filter_string=f"tags.`mlflow.runName` = '{task.name}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else None


def tag_finished_task(task: SweepTask, status: int, cause: str | None = None) -> None:
    """Add the task's exit status (and a failed one's one-line cause, tag exit_cause) to its
    MLflow run (the sweep's tags were set when training created the run; they are set again
    here); a failure only warns."""
    try:
        # deferred: pulls in MLflow (slow to start, or optional)
        from mlflow.entities import RunTag

        # deferred: pulls in an optional library (slow to start, or optional)
        from pretrain.tracking import bounded_http_requests, mlflow_client

        with bounded_http_requests():
            client = mlflow_client(task.tracking_uri)
            run_id = find_run_id(task, client)
            if run_id is None:
                print(f"launcher: warning: no MLflow run found for {task.name}; not tagged",
                      file=sys.stderr)
                return
            tags = {**task.tags, "exit_status": str(status),
                    **({"exit_cause": cause[:5000]} if cause else {})}
            client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        print(f"launcher: MLflow run {run_id} ({task.name}): tagged exit_status={status}",
              file=sys.stderr)
    except Exception as err:  # tracking must not turn a finished run into a failure
        print(f"launcher: warning: tagging the MLflow run of {task.name} failed: "
              f"{type(err).__name__}: {err}", file=sys.stderr)


def after_training(task: SweepTask, env: dict) -> dict[str, str]:
    """Run what the sweep asks for on a finished run (lm-eval tasks, the inference speed;
    both log to the run's MLflow run); {status tag: exit status}. A failure is reported and
    tagged but does not fail the training task."""
    gpus = env.get("SLURM_GPUS_ON_NODE") or env.get("CUDA_VISIBLE_DEVICES", "")
    device = "cuda" if gpus and gpus not in ("0", "-1", "NoDevFiles") else "cpu"
    statuses = {}
    for tag, arguments in follow_up_commands(task.lm_eval, task.inference, task.run_dir,
                                             device).items():
        command = [sys.executable, *arguments]
        print(f"launcher: after training: {shlex.join(command)}", file=sys.stderr, flush=True)
        status = subprocess.run(command, env=env).returncode
        if status != 0:
            print(f"launcher: warning: {shlex.join(arguments[:2])} on {task.name} exited "
                  f"{status}; its figures are missing from the report", file=sys.stderr,
                  flush=True)
        statuses[tag] = str(status)
    return statuses
