"""The node launcher behind slurm/train.sbatch: `python -m slurm launch ...`, one per node.

Two ways to start the ranks (DENSEFORMER_LAUNCHER or --mode):

- `torchrun` (default): this process runs torchrun with a c10d rendezvous hosted by node 0
  (the first node of SLURM_JOB_NODELIST), `nproc_per_node` ranks per node;
- `srun`: Slurm started one task per rank; this process runs that one rank, with RANK,
  WORLD_SIZE and LOCAL_RANK from SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID.

Either way the ranks run `python -m slurm.worker train --config ...` (slurm/worker.py), which
records each rank's PID and exit status in a private directory. A stop signal (SIGUSR1,
SIGTERM, SIGINT) reaching this process is forwarded to the local ranks; torchrun itself
ignores SIGUSR1, so a preemption warning lets training finish its step, save and exit 75
(EXIT_PREEMPTED) instead of killing it. This process exits with the training's status: 0,
75 when every rank stopped on a signal after the checkpoint, or the first failure; a failure
ends with its one-line cause (a rank's, slurm/worker.py; or the launcher's own), printed
last, tagged on the MLflow run (exit_cause) and handed to train.sbatch.

Nothing here needs Slurm: the tests start it twice on one machine as two "nodes" with
--nnodes 2 --node-rank 0/1 --rdzv-host 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pretrain.config import ConfigError, load_config, override_argument
from pretrain.exit_codes import EXIT_PREEMPTED, EXIT_USAGE  # torch-free
from pretrain.tracking import RUN_TAGS_ENV
from slurm.sweep import after_training, sweep_task, tag_finished_task
from slurm.sweep_spec import SweepError
from slurm.worker import LAUNCH_DIR_ENV, STOP_SIGNALS

DEFAULT_RDZV_PORT = 29400
ENV_PREFIX = "DENSEFORMER_"


class LaunchError(ValueError):
    """A launcher setting is missing or invalid (exit status 2)."""


@dataclass
class Rendezvous:
    """Where and how the nodes of one job meet."""

    nnodes: int
    node_rank: int
    nproc_per_node: int
    host: str
    port: int
    run_id: str
    join_timeout: int

    @property
    def endpoint(self) -> str:
        """host:port of the c10d store (or MASTER_ADDR:MASTER_PORT in srun mode)."""
        return f"{self.host}:{self.port}"


HOST_NAME = re.compile(r"[A-Za-z0-9._-]+")


def node_hosts(nodelist: str, env: dict) -> list[str]:
    """Every host of a Slurm node list, in order, as `scontrol show hostnames` expands it."""
    if not nodelist.strip():
        raise LaunchError("SLURM_JOB_NODELIST is empty")
    scontrol = shutil.which("scontrol", path=env.get("PATH"))
    if scontrol is None:
        raise LaunchError(
            f"scontrol is not on PATH; the launcher runs `scontrol show hostnames` to find "
            f"the first node of SLURM_JOB_NODELIST={nodelist!r}. Install Slurm's client "
            f"commands or set {ENV_PREFIX}RDZV_HOST (or --rdzv-host)")
    try:
        done = subprocess.run([scontrol, "show", "hostnames", nodelist], env=env,
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"`scontrol show hostnames {nodelist}` took over 60s") from None
    hosts = done.stdout.split()
    # scontrol is lenient ("a[1-" gives "a]"): a host the rendezvous cannot use is refused here.
    if done.returncode != 0 or not hosts or not all(HOST_NAME.fullmatch(h) for h in hosts):
        raise LaunchError(
            f"cannot read the nodes of SLURM_JOB_NODELIST={nodelist!r}: `scontrol show "
            f"hostnames` exited {done.returncode} with "
            f"{(done.stderr.strip() or done.stdout.strip() or 'no output')!r}")
    return hosts


def _env_int(env: dict, name: str, default: int | None) -> int | None:
    value = env.get(name)
    if value in (None, ""):
        return default
    try:
        return int(value.split("(")[0])  # SLURM_TASKS_PER_NODE style "2(x3)"
    except ValueError:
        raise LaunchError(f"{name}={value!r} is not an integer") from None


def _default_nproc(env: dict) -> int:
    """Ranks per node: DENSEFORMER_NPROC_PER_NODE, Slurm's GPUs on the node, visible GPUs, 1."""
    for name in (ENV_PREFIX + "NPROC_PER_NODE", "SLURM_GPUS_ON_NODE"):
        value = _env_int(env, name, None)
        if value:
            return value
    visible = env.get("CUDA_VISIBLE_DEVICES", "")
    if visible and visible not in ("-1", "NoDevFiles"):
        return len(visible.split(","))
    return 1


def rendezvous_from(args: argparse.Namespace, env: dict) -> Rendezvous:
    """Command-line options first, then DENSEFORMER_* and SLURM_* variables, then defaults."""
    nnodes = args.nnodes or _env_int(env, "SLURM_JOB_NUM_NODES", None) \
        or _env_int(env, "SLURM_NNODES", 1)
    node_rank = args.node_rank if args.node_rank is not None \
        else _env_int(env, "SLURM_NODEID", 0)
    host = args.rdzv_host or env.get(ENV_PREFIX + "RDZV_HOST")
    if not host:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        host = node_hosts(nodelist, env)[0] if nodelist else "127.0.0.1"
    job = env.get("SLURM_JOB_ID", "")
    port = args.rdzv_port or _env_int(env, ENV_PREFIX + "RDZV_PORT", None) \
        or DEFAULT_RDZV_PORT + (int(job) % 1000 if job.isdigit() else 0)
    run_id = args.rdzv_id or env.get(ENV_PREFIX + "RDZV_ID") or job or "denseformer"
    join_timeout = args.join_timeout or _env_int(env, ENV_PREFIX + "JOIN_TIMEOUT", 600)
    rdzv = Rendezvous(nnodes=nnodes, node_rank=node_rank,
                      nproc_per_node=args.nproc_per_node or _default_nproc(env),
                      host=host, port=port, run_id=run_id, join_timeout=join_timeout)
    if not 0 <= rdzv.node_rank < rdzv.nnodes:
        raise LaunchError(f"node rank {rdzv.node_rank} is outside 0..{rdzv.nnodes - 1}")
    if rdzv.nproc_per_node < 1 or not 0 < rdzv.port < 65536 or rdzv.join_timeout < 1:
        raise LaunchError(f"invalid rendezvous settings: {rdzv}")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", rdzv.run_id):
        raise LaunchError(f"rendezvous id {rdzv.run_id!r}: use letters, digits, . _ -")
    return rdzv


def torchrun_command(rdzv: Rendezvous, worker_args: list[str]) -> list[str]:
    """torchrun (slurm/torchrun.py: one line per failed rank, no traceback) with a c10d
    rendezvous that node 0 hosts, running slurm.worker."""
    conf = f"join_timeout={rdzv.join_timeout},is_host={'1' if rdzv.node_rank == 0 else '0'}"
    return [sys.executable, "-m", "slurm.torchrun",
            f"--nnodes={rdzv.nnodes}", f"--nproc-per-node={rdzv.nproc_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv.endpoint}",
            f"--rdzv-id={rdzv.run_id}", f"--rdzv-conf={conf}", "--max-restarts=0",
            "-m", "slurm.worker", *worker_args]


def srun_rank_env(rdzv: Rendezvous, env: dict) -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, ... of this Slurm task (one task per rank)."""
    missing = [n for n in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID") if n not in env]
    if missing:
        raise LaunchError(f"--mode srun needs {', '.join(missing)}: run it under srun")
    local_world = _env_int(env, "SLURM_NTASKS_PER_NODE", None) \
        or _env_int(env, "SLURM_TASKS_PER_NODE", 1)
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"],
            "LOCAL_RANK": env["SLURM_LOCALID"], "LOCAL_WORLD_SIZE": str(local_world),
            "MASTER_ADDR": rdzv.host, "MASTER_PORT": str(rdzv.port)}


# ---------------------------------------------------------------------------------------
# What to train


def training_overrides(config: str, overrides: list[str], env: dict) -> list[str]:
    """The overrides plus what a (re)queued job needs: a run.dir that is the same on every
    node and every restart, and train.resume=auto. Raises ConfigError for a bad config."""
    # resume=auto needs a run.dir, which is decided here: read the rest first, then check all.
    cfg = load_config(config, [*overrides, "train.resume=null"])
    resume = load_config(config, overrides, check=False).train.resume
    extra = []
    job = env.get("SLURM_JOB_ID")
    if cfg.run.dir is None and job:
        if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
            job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
        extra.append(f"run.dir={Path('runs').absolute() / f'{cfg.run.name}-{job}'}")
    restarted = _env_int(env, "SLURM_RESTART_COUNT", 0) > 0
    if resume is None or restarted:
        extra.append("train.resume=auto")
    load_config(config, [*overrides, *extra])
    return [*overrides, *extra]


# ---------------------------------------------------------------------------------------
# Running the ranks


class SignalForwarder:
    """Forwards stop signals received by the launcher to the local ranks (by PID file)."""

    def __init__(self, launch_dir: Path):
        self.launch_dir = launch_dir
        self.received: int | None = None

    def __enter__(self) -> SignalForwarder:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame: object) -> None:
        if self.received is None:
            print(f"launcher: received {signal.Signals(signum).name}; forwarding it to the "
                  "training processes (they save a checkpoint at the end of the step)",
                  file=sys.stderr, flush=True)
        self.received = signum
        for pid in self.worker_pids():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def worker_pids(self) -> list[int]:
        """PIDs of this node's live ranks, from their PID files."""
        pids = []
        for path in self.launch_dir.glob("rank-*.pid"):
            try:
                pid = int(path.read_text())
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except (OSError, ValueError):
                continue
            if b"slurm.worker" in cmdline:  # never signal a recycled PID
                pids.append(pid)
        return pids


def _ignore_usr1() -> None:
    # Runs in the child before exec: torchrun has no SIGUSR1 handler, and Slurm delivers a
    # step's signals to every process of the step; the ranks install their own handler.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def combine_statuses(child_status: int, rank_statuses: dict[str, int]) -> int:
    """The node's exit status from torchrun's (or the rank's) and each local rank's."""
    values = set(rank_statuses.values())
    if child_status == 0 and values <= {0}:
        return 0
    if values and values <= {0, EXIT_PREEMPTED} and EXIT_PREEMPTED in values:
        return EXIT_PREEMPTED
    failures = [v for v in rank_statuses.values() if v not in (0, EXIT_PREEMPTED)]
    if failures:
        return failures[0]
    return child_status if child_status > 0 else 1


def run_ranks(command: list[str], env: dict[str, str],
              launch_dir: Path) -> tuple[int, dict[str, int], bool, str | None]:
    """Start the child, forward stop signals, wait: (child status, {rank: status}, whether
    any rank started, the one-line cause of the lowest failed rank that wrote one)."""
    env = {**env, LAUNCH_DIR_ENV: str(launch_dir)}
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "300")  # let a checkpoint finish
    with SignalForwarder(launch_dir):
        status = subprocess.Popen(command, env=env, preexec_fn=_ignore_usr1).wait()
    statuses = {}
    for path in launch_dir.glob("rank-*.status"):
        try:
            statuses[path.name[5:-7]] = int(path.read_text())
        except ValueError:
            pass
    started = any(launch_dir.glob("rank-*.pid"))
    causes = sorted(launch_dir.glob("rank-*.cause"), key=lambda p: int(p.name[5:-6]))
    cause = causes[0].read_text().strip() if causes else None
    return (status if status >= 0 else 128 - status), statuses, started, cause


def launch(args: argparse.Namespace) -> int:
    """Start this node's ranks for the configured training; returns the exit status."""
    env = dict(os.environ)
    try:
        rdzv = rendezvous_from(args, env)
        if args.sweep:
            task = sweep_task(Path(args.sweep), env)
            config, overrides = str(task.config_path), list(args.overrides)
        else:
            task, config, overrides = None, args.config, list(args.overrides)
        overrides = training_overrides(config, overrides, env)
    except (LaunchError, SweepError, ConfigError) as err:
        return _refuse(str(err), env)
    worker_args = ["train", "--config", config, *[x for o in overrides for x in ("--set", o)]]
    mode = args.mode or env.get(ENV_PREFIX + "LAUNCHER", "torchrun")
    if mode == "srun":
        try:
            env.update(srun_rank_env(rdzv, env))
        except LaunchError as err:
            return _refuse(str(err), env)
        command = [sys.executable, "-m", "slurm.worker", *worker_args]
        where = f"rank {env['RANK']} of {env['WORLD_SIZE']}, master {rdzv.endpoint}"
    elif mode == "torchrun":
        command = torchrun_command(rdzv, worker_args)
        where = (f"node {rdzv.node_rank} of {rdzv.nnodes}, {rdzv.nproc_per_node} ranks per "
                 f"node, c10d rendezvous {rdzv.endpoint} (id {rdzv.run_id}, join timeout "
                 f"{rdzv.join_timeout}s)")
    else:
        return _refuse(f"mode {mode!r}: use torchrun or srun", env)
    if task is not None:
        # The MLflow run gets the sweep's tags when training creates it, so that a task
        # killed before it ends (time limit, node failure) is still seen by `slurm fit`.
        env[RUN_TAGS_ENV] = json.dumps(task.tags)
    print(f"launcher: {where}; config {config}"
          + (f" (sweep run {task.name})" if task else "")
          + (f"; overrides {' '.join(overrides)}" if overrides else ""),
          file=sys.stderr, flush=True)

    launch_dir = Path(tempfile.mkdtemp(prefix="denseformer-launch-"))
    started_at = time.monotonic()
    try:
        child_status, rank_statuses, started, cause = run_ranks(command, env, launch_dir)
    finally:
        shutil.rmtree(launch_dir, ignore_errors=True)
    status = combine_statuses(child_status, rank_statuses)
    elapsed = time.monotonic() - started_at
    if status != 0 and not started and mode == "torchrun":
        cause = (f"no training process started within {elapsed:.0f}s: the c10d rendezvous at "
                 f"{rdzv.endpoint} did not complete; {rdzv.nnodes} nodes were expected within "
                 f"the join timeout of {rdzv.join_timeout}s (is every node running the "
                 f"launcher, and can it reach {rdzv.endpoint}?)")
    elif status not in (0, EXIT_PREEMPTED):
        cause = cause or f"training failed with exit status {status}"
    if task is not None and (mode == "torchrun" and rdzv.node_rank == 0
                             or mode == "srun" and env.get("RANK") == "0"):
        if status == 0:
            task.tags.update(after_training(task, env))
        tag_finished_task(task, status, cause)
    # Last, so that a failed job's log ends with why (train.sbatch repeats it after the
    # status): nothing of torchrun's or of the MLflow tagging comes after it.
    if status == EXIT_PREEMPTED:
        print(f"launcher: training stopped on a signal after saving a checkpoint (exit "
              f"{EXIT_PREEMPTED}); resume with train.resume=auto", file=sys.stderr, flush=True)
    elif status != 0:
        write_cause(cause, env)
        print(f"launcher: error: {cause}", file=sys.stderr, flush=True)
    return status


CAUSE_FILE_ENV = ENV_PREFIX + "CAUSE_FILE"  # set by slurm/train.sbatch


def _refuse(cause: str, env: dict) -> int:
    """Nothing started: say why (last) and exit 2."""
    write_cause(cause, env)
    print(f"launcher: error: {cause}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def write_cause(cause: str, env: dict) -> None:
    """Hand the one-line cause to train.sbatch (the file $DENSEFORMER_CAUSE_FILE), which
    ends the job's log with it after the exit status."""
    path = env.get(CAUSE_FILE_ENV)
    if path:
        try:
            Path(path).write_text(cause + "\n")
        except OSError as err:
            print(f"launcher: warning: cannot write {CAUSE_FILE_ENV}={path}: {err}",
                  file=sys.stderr, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `python -m slurm launch`."""
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--config", help="training config (YAML)")
    what.add_argument("--sweep", help="a sweep directory: train the run of SLURM_ARRAY_TASK_ID")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", type=override_argument,
                        help="config override, as for pretrain train")
    parser.add_argument("--mode", choices=("torchrun", "srun"),
                        help="torchrun: one launcher per node (default; $DENSEFORMER_LAUNCHER)"
                             "; srun: one Slurm task per rank")
    parser.add_argument("--nnodes", type=int, help="default: $SLURM_JOB_NUM_NODES or 1")
    parser.add_argument("--node-rank", type=int, help="default: $SLURM_NODEID or 0")
    parser.add_argument("--nproc-per-node", type=int,
                        help="default: $DENSEFORMER_NPROC_PER_NODE, $SLURM_GPUS_ON_NODE, "
                             "visible GPUs, or 1")
    parser.add_argument("--rdzv-host", help="default: $DENSEFORMER_RDZV_HOST or the first "
                        "node of $SLURM_JOB_NODELIST")
    parser.add_argument("--rdzv-port", type=int, help="default: $DENSEFORMER_RDZV_PORT or "
                        f"{DEFAULT_RDZV_PORT} + job id mod 1000")
    parser.add_argument("--rdzv-id", help="default: $SLURM_JOB_ID")
    parser.add_argument("--join-timeout", type=int, help="seconds to wait for all nodes "
                        "(default: $DENSEFORMER_JOIN_TIMEOUT or 600)")
