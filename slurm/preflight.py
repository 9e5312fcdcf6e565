"""What every task of a sweep would check at start-up, run on the submitting machine before
anything is queued (`python -m slurm sweep --submit`; `--no-preflight` skips it, for data
that only the compute nodes can see).

The config of each run was validated when the sweep was expanded (`pretrain.config.validate`,
at the sweep's world size). Here, per task: its data (`pretrain.data_checks.check_data`, the
trainer's own checks: index.json, the tokenizer's sha256, every shard's size, the
vocabulary, sequence length and validation split against the config), and its run directory
(`pretrain.run_dir.check_writable`, a real write; not locked by a live run). Nothing is
created: a run directory that does not exist yet is probed through its nearest existing
parent. A dependent run's `train.init_from` names a parent that has not trained yet: not
checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from data_pipeline import DataError
from data_pipeline.index import read_index
from pretrain.config import ConfigError
from pretrain.data_checks import check_data
from slurm.sweep_spec import Sweep


@dataclass
class Problem:
    """A check that a task would fail at start-up."""

    index: int
    run: str
    key: str
    message: str


def _existing(path: Path) -> Path:
    """`path`, or its nearest parent that exists (what a write probe may touch)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_run_dir(run_dir: Path) -> None:
    """The trainer's run-directory checks that can be made from here: writable, not locked."""
    # deferred: pulls in torch (slow to start, or optional)
    from pretrain.run_dir import LOCK_FILE, RunDirLock, check_writable

    check_writable(_existing(run_dir), "run.dir")
    if (run_dir / LOCK_FILE).exists():
        lock = RunDirLock(run_dir)
        lock.acquire()  # RunDirLocked (a ConfigError of run.dir) while a run holds it
        lock.release()


def preflight(sweep: Sweep) -> list[Problem]:
    """Every start-up check of every task; the problems found (empty: all would start)."""
    problems: list[Problem] = []
    indexes: dict[str, object] = {}  # data.path -> its checked index, or the DataError
    try:
        # deferred: pulls in torch (slow to start, or optional)
        from pretrain.run_dir import check_writable

        check_writable(_existing(sweep.out / "logs"), "out")
    except ConfigError as err:
        problems.append(Problem(-1, "(the sweep)", "out", f"Slurm logs: {err}"))
    for run in sweep.runs:
        cfg = run.config
        try:
            path = str(cfg.data.path)
            if path not in indexes:
                try:
                    indexes[path] = read_index(path) if cfg.data.path else None
                except DataError as err:
                    indexes[path] = err
            if isinstance(indexes[path], DataError):
                raise indexes[path]
            check_data(cfg, indexes[path])
            _check_run_dir(Path(cfg.run.dir))
        except ConfigError as err:
            problems.append(Problem(run.index, run.name, err.key,
                                    str(err).removeprefix(f"{err.key}: ")))
        except DataError as err:
            problems.append(Problem(run.index, run.name, "data.path", str(err)))
    return problems


def format_problems(problems: list[Problem], total: int) -> str:
    """One line per distinct problem, naming its key and every task it stops."""
    grouped: dict[tuple[str, str], list[Problem]] = {}
    for problem in problems:
        grouped.setdefault((problem.key, problem.message), []).append(problem)
    lines = []
    for (key, message), hit in grouped.items():
        first = hit[0]
        who = ("the sweep" if first.index < 0 else f"task {first.index} ({first.run})")
        more = f" and {len(hit) - 1} more task(s): {', '.join(str(p.index) for p in hit[1:])}" \
            if len(hit) > 1 else ""
        lines.append(f"preflight: {who}{more}: {key}: {message}")
    tasks = len({p.index for p in problems if p.index >= 0})
    lines.append(f"preflight: {tasks} of {total} task(s) would fail at start-up; nothing was "
                 "submitted (--no-preflight skips these checks, for data that only the "
                 "compute nodes can see)")
    return "\n".join(lines)
